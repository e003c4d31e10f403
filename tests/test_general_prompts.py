"""The shipped general prompt mix (specdec/data/general.jsonl): reproducible from its script, free of the
benchmark sets' text, and readable by bench and by `train --prompts`."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from specdec.bench.tasks import DATA_DIR, load_tasks
from specdec.train.prompts import parse_prompt_spec, read_prompt_sets

ROOT = Path(__file__).resolve().parent.parent
RUN = 8  # words in a row that a training prompt may not share with a benchmark prompt


def generator():
    spec = importlib.util.spec_from_file_location("make_general_prompts", ROOT / "scripts" / "make_general_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def word_runs(text: str, n: int = RUN) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_the_script_reproduces_the_shipped_file():
    lines = (DATA_DIR / "general.jsonl").read_text(encoding="utf-8").splitlines()
    made = generator().prompts()
    assert [json.loads(line)["turns"] for line in lines] == [[p] for _, p in made]
    assert [json.loads(line)["category"] for line in lines] == [c for c, _ in made]
    assert len(set(p for _, p in made)) == len(made)  # no prompt twice


@pytest.mark.parametrize("benchmark", ["mixed", "heldout", "gsm8k-eval"])
def test_no_prompt_shares_eight_words_in_a_row_with_a_benchmark_set(benchmark):
    seen = set().union(*(word_runs(t.prompt) for t in load_tasks(benchmark)))
    shared = [t.prompt[:80] for t in load_tasks("general") if word_runs(t.prompt) & seen]
    assert not shared, shared


def test_the_check_finds_a_shared_run():
    """The overlap check can fail: a benchmark prompt's own words are found."""
    prompt = load_tasks("mixed")[-1].prompt
    assert word_runs("Please answer this. " + prompt) & word_runs(prompt)


def test_bench_and_train_read_it_as_a_built_in_set():
    tasks = load_tasks("general")
    assert len(tasks) == 636 and {t.category for t in tasks} >= {"explain", "passage", "translation"}
    sets = read_prompt_sets(parse_prompt_spec("gsm8k-train:3,general"))
    assert [len(s.prompts) for s in sets] == [6973, 636] and [s.file.weight for s in sets] == [3.0, 1.0]
    assert sets[1].prompts[0].answer is None  # --data self only

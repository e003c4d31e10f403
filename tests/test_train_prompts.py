"""`specdec train ... --prompts FILE[:WEIGHT],...`: the spec parser and its errors, the loaders on each
format bench reads (GSM8K-style and Spec-Bench-style JSONL, plain text, built-in sets), the weighting
rule (token shares follow the weights, deterministic for a seed), `--data self` collecting a tiny
random target's own continuations of the given prompts in batches, and training that stays seeded and
resumable, its collected data keyed by the prompt files' contents and weights."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import specdec
from conftest import DEVICE, tiny_folder_with_tokenizer
from specdec.api import encode_prompt
from specdec.bench.tasks import DATA_DIR, GSM8K_INSTRUCTION, load_tasks
from specdec.cli import main
from specdec.engine import SpecEngine
from specdec.errors import UserError
from specdec.train import common
from specdec.train import draft as train_draft
from specdec.train.common import CHECKPOINT
from specdec.train.data import Features, Mix, collect_features, draw_file, text_examples
from specdec.train.prompts import PromptFile, check_answers, parse_prompt_spec, read_prompt_sets

WORDS = ["the", "cat", "sat", "on", "mat", "The", "Cat", "+", "-", "=", "*", "."] + [str(d) for d in range(10)]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def word_prompts(n: int, length: int, seed: int) -> list[str]:
    """n prompts of `length` words from the tiny tokenizer's vocabulary."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, length)) for _ in range(n)]


def read_one(path: Path, limit: int | None = None):
    return read_prompt_sets([PromptFile(str(path), 1.0)], limit)[0]


# --- the --prompts parser -------------------------------------------------------------------------

def test_spec_entries_take_optional_weights(tmp_path):
    colon = write(tmp_path / "a:b.txt", ["x"])  # an existing file is a file, ':' and all
    assert parse_prompt_spec(f"chat.jsonl:2, qa.txt:0.5,gsm8k-train,{colon}") == [
        PromptFile("chat.jsonl", 2.0), PromptFile("qa.txt", 0.5), PromptFile("gsm8k-train", 1.0), PromptFile(str(colon), 1.0)]
    assert parse_prompt_spec(f"{colon}:3") == [PromptFile(str(colon), 3.0)]


@pytest.mark.parametrize("spec,message", [
    ("x.jsonl:abc", "the weight 'abc' is not a number"),
    ("x.jsonl:0", "the weight must be a positive number, got 0"),
    ("x.jsonl:-2", "the weight must be a positive number"),
    ("x.jsonl:nan", "the weight must be a positive number"),
    ("x.jsonl:inf", "the weight must be a positive number"),
    (":0", "no file before ':0'"),
    ("a.jsonl,,b.txt", "an empty entry"),
    ("", "an empty entry"),
])
def test_a_bad_spec_is_a_user_error(spec, message):
    with pytest.raises(UserError, match=re.escape(message)):
        parse_prompt_spec(spec)


@pytest.mark.parametrize("name,lines,message", [
    ("missing.jsonl", None, "--prompts {path}: no such file"),
    ("empty.jsonl", [], "--prompts {path}: no prompts in the file"),
    ("blank.txt", ["", "   "], "--prompts {path}: no prompts in the file"),
    ("bad.jsonl", ['{"question": "q"}', "not json"], "{path}:2: not valid JSON"),
    ("list.jsonl", ["[1, 2]"], "{path}:1: expected a JSON object"),
    ("fields.jsonl", ['{"prompt": "q"}'], "{path}:1: a task needs a 'question' or a 'turns' field"),
    ("answer.jsonl", ['{"turns": ["q"], "answer": ""}'], "{path}:1: 'answer' must be non-empty text"),
    ("data.csv", ["a,b"], "unsupported task file type '.csv'"),
])
def test_a_bad_prompt_file_is_a_user_error(tmp_path, name, lines, message):
    path = tmp_path / name
    if lines is not None:
        path.write_text("\n".join(lines))
    with pytest.raises(UserError, match=re.escape(message.format(path=path))):
        read_one(path)


def test_a_file_named_twice_or_a_bad_limit_is_a_user_error(tmp_path):
    path = write(tmp_path / "p.txt", ["the cat"])
    with pytest.raises(UserError, match="names .*p.txt twice"):
        read_prompt_sets(parse_prompt_spec(f"{path}:1,{path}:2"))
    with pytest.raises(UserError, match="--limit must be a positive number"):
        read_prompt_sets(parse_prompt_spec(str(path)), limit=0)


# --- loaders, on each format bench reads ----------------------------------------------------------

def test_gsm8k_style_jsonl_gives_bench_prompts_and_solutions_as_answers(tmp_path):
    path = write(tmp_path / "math.jsonl", [json.dumps({"question": "What is 2+3?", "answer": "2+3 = <<2+3=5>>5\n#### 5"}),
                                           json.dumps({"question": " Half of 8? ", "answer": 4, "category": "easy"})])
    prompts = read_one(path).prompts
    assert [p.text for p in prompts] == [t.prompt for t in load_tasks(str(path))]  # bench's prompts exactly
    assert prompts[0].text == f"What is 2+3?\n\n{GSM8K_INSTRUCTION}"
    assert [p.answer for p in prompts] == ["2+3 = 5\n#### 5", "4"]  # calculator annotations removed


def test_spec_bench_style_jsonl_gives_the_first_turn_and_free_text_answers(tmp_path):
    bench_file = write(tmp_path / "question.jsonl", [
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another one."]}),
        json.dumps({"question_id": 82, "category": "qa", "turns": ["Why is the sky blue?"]})])
    assert [p.text for p in read_one(bench_file).prompts] == [t.prompt for t in load_tasks(str(bench_file))]
    assert [p.text for p in read_one(bench_file).prompts] == ["Write a haiku.", "Why is the sky blue?"]
    assert [p.answer for p in read_one(bench_file).prompts] == [None, None]
    answered = write(tmp_path / "traffic.jsonl", [json.dumps({"turns": ["Say hi."], "answer": " Hi! <<not math>> "})])
    [prompt] = read_one(answered).prompts  # any text is an answer here (bench reads only numbers)
    assert (prompt.text, prompt.answer, prompt.where) == ("Say hi.", "Hi! <<not math>>", f"{answered}:1")


def test_text_file_gives_one_prompt_per_line(tmp_path):
    path = write(tmp_path / "prompts.txt", ["the cat sat", "", "  on the mat  ", "1 + 2 ="])
    prompts = read_one(path).prompts
    assert [p.text for p in prompts] == [t.prompt for t in load_tasks(str(path))] == ["the cat sat", "on the mat", "1 + 2 ="]
    assert all(p.answer is None for p in prompts)
    assert [p.text for p in read_one(path, limit=2).prompts] == ["the cat sat", "on the mat"]


def test_builtin_sets_read_like_bench_and_eval_sets_warn(capsys):
    [train] = read_prompt_sets(parse_prompt_spec("gsm8k-train"), limit=3)
    assert [p.text for p in train.prompts] == [t.prompt for t in load_tasks("gsm8k-train", 3)]
    assert all(p.answer and "####" in p.answer and "<<" not in p.answer for p in train.prompts)
    assert capsys.readouterr().err == ""
    for spec in ("heldout", "mixed", str(DATA_DIR / "gsm8k-eval.jsonl")):
        read_prompt_sets(parse_prompt_spec(spec), limit=1)
        err = capsys.readouterr().err
        assert err.startswith(f"specdec: warning: --prompts {spec} is an evaluation set") and err.count("\n") == 1


def test_data_text_needs_answers_and_says_to_use_self(tmp_path):
    txt = write(tmp_path / "p.txt", ["the cat"])
    with pytest.raises(UserError, match=re.escape(f"{txt} holds prompts only") + ".*use --data self"):
        check_answers([read_one(txt)])
    partial = write(tmp_path / "p.jsonl", [json.dumps({"turns": ["a"], "answer": "b"}), json.dumps({"turns": ["c"]})])
    with pytest.raises(UserError, match=re.escape(f"{partial}:2 has no 'answer'") + ".*use --data self"):
        check_answers([read_one(partial)])
    check_answers([read_one(partial, limit=1)])  # only the prompts used need answers


# --- the weighting rule ---------------------------------------------------------------------------

def draw_all(weights: list[float], sizes: list[int], lengths: list[int], seed: int) -> tuple[list[int], list[float]]:
    """(files in draw order, tokens per file) when file i's examples have lengths[i] tokens each."""
    mix = Mix(list(weights), list(sizes), [0] * len(sizes), [0.0] * len(sizes), np.random.default_rng(seed))
    order = []
    while (i := draw_file(mix)) is not None:
        mix.drawn[i] += 1
        mix.tokens[i] += lengths[i]
        order.append(i)
    return order, mix.tokens


@pytest.mark.parametrize("weights,lengths", [([2, 1], [10, 35]), ([1, 1, 3], [7, 20, 5]), ([0.3, 5], [40, 3])])
def test_token_shares_follow_the_weights_at_every_draw(weights, lengths):
    sizes = [10_000] * len(weights)
    mix = Mix(list(weights), sizes, [0] * len(sizes), [0.0] * len(sizes), np.random.default_rng(0))
    for draw in range(2000):
        i = draw_file(mix)
        mix.drawn[i] += 1
        mix.tokens[i] += lengths[i]
        total = sum(mix.tokens)
        for t, w in zip(mix.tokens, weights):  # within about one example of the weight's share
            assert abs(t / total - w / sum(weights)) <= len(weights) * max(lengths) / total + 1e-9, (draw, mix.tokens)


def test_draws_are_deterministic_for_a_seed():
    a, _ = draw_all([1, 1], [200, 200], [10, 10], seed=3)
    assert a == draw_all([1, 1], [200, 200], [10, 10], seed=3)[0]
    assert a != draw_all([1, 1], [200, 200], [10, 10], seed=4)[0]
    assert draw_all([5], [7], [10], seed=0)[0] == [0] * 7  # one file: read in order


def test_a_file_that_runs_out_leaves_its_part_to_the_others():
    order, _ = draw_all([3, 1, 1], [4, 100, 100], [10, 10, 10], seed=0)
    assert len(order) == 204 and max(i for i, f in enumerate(order) if f == 0) < 8  # its 4 prompts go first
    assert abs(order[:60].count(1) - order[:60].count(2)) <= 1  # then the other two share equally


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny random Llama with a word-level tokenizer (no chat template, no EOS)."""
    return tiny_folder_with_tokenizer(tmp_path_factory.mktemp("prompts-model"))


@pytest.fixture(scope="module")
def target(folder):
    return specdec.load_model(str(folder), dtype="float32", device=DEVICE)


def test_text_examples_follow_the_weights_and_the_seed(target, tmp_path):
    short = write(tmp_path / "short.jsonl", [json.dumps({"turns": [p], "answer": "the cat"}) for p in word_prompts(300, 2, 0)])
    long = write(tmp_path / "long.jsonl", [json.dumps({"turns": [p], "answer": "on the mat . 1 2 3"}) for p in word_prompts(200, 9, 1)])
    sets = read_prompt_sets(parse_prompt_spec(f"{short}:3,{long}:1"))
    examples = text_examples(target.tokenizer, sets, max_tokens=1000, seed=0)
    tokens = [sum(e.size for e in examples if e.file == i) for i in (0, 1)]
    assert 1000 - max(e.size for e in examples) < sum(tokens) <= 1000
    assert abs(tokens[0] / sum(tokens) - 0.75) < 0.03, tokens
    assert 40 < sum(e.file == 0 for e in examples) < 300 and sum(e.file == 1 for e in examples) > 8
    first = next(e for e in examples if e.file == 1)  # each file is read in order, answers as the assistant turn
    assert first.prompt == encode_prompt(target.tokenizer, sets[1].prompts[0].text)
    assert first.response == target.tokenizer("on the mat . 1 2 3", add_special_tokens=False)["input_ids"]
    again = text_examples(target.tokenizer, sets, max_tokens=1000, seed=0)
    assert [(e.prompt, e.response, e.file) for e in again] == [(e.prompt, e.response, e.file) for e in examples]
    other = text_examples(target.tokenizer, sets, max_tokens=1000, seed=1)
    assert [e.file for e in other] != [e.file for e in examples]


# --- --data self on a tiny random target ----------------------------------------------------------

def test_self_collects_the_targets_continuations_of_the_given_prompts_in_batches(target, tmp_path, monkeypatch):
    path = write(tmp_path / "traffic.txt", ["the cat sat on", "1 + 2 =", "the mat", "on the cat . the", "3 * 4", "cat cat"])
    sets = read_prompt_sets(parse_prompt_spec(str(path)))
    batches, real = [], SpecEngine.generate

    def recording(self, prompts, config, *rest):
        batches.append(len(prompts))
        return real(self, prompts, config, *rest)

    monkeypatch.setattr(SpecEngine, "generate", recording)
    features = collect_features(target, "self", sets, max_new_tokens=8, batch_size=4, progress=False)
    monkeypatch.undo()
    assert batches == [4, 2]
    prompts = [encode_prompt(target.tokenizer, p.text) for p in sets[0].prompts]
    rows = specdec.SpecEngine(target, "none").generate(prompts, specdec.SpecConfig(max_new_tokens=8)).rows
    assert [t.tolist() for t in features.tokens] == [p + r.token_ids for p, r in zip(prompts, rows)]
    assert features.response_start == [len(p) for p in prompts]
    assert features.source == "self" and all(len(r.token_ids) == 8 for r in rows)
    assert [h.shape for h in features.hidden] == [(len(t), target.config.hidden_size) for t in features.tokens]


def test_self_mixes_weighted_files_and_reports_the_shares(target, tmp_path, capsys):
    a = write(tmp_path / "a.txt", word_prompts(60, 3, 2))  # prompts of 3 tokens (one per word) ...
    b = write(tmp_path / "b.txt", word_prompts(60, 5, 3))  # ... and of 5: response_start tells the files apart
    sets = read_prompt_sets(parse_prompt_spec(f"{a}:1,{b}:3"))
    features = collect_features(target, "self", sets, max_tokens=900, max_new_tokens=8, batch_size=8, progress=False)
    assert set(features.response_start) == {3, 5}
    from_a = sum(len(t) for t, start in zip(features.tokens, features.response_start) if start == 3)
    assert 800 < features.num_tokens <= 900
    assert abs(from_a / features.num_tokens - 0.25) < 0.05, from_a
    err = capsys.readouterr().err
    assert re.search(r"training on \d+ tokens: a\.txt [\d.]+% \(weight 25\.0%\), b\.txt [\d.]+% \(weight 75\.0%\)", err), err


# --- the command line: errors, seeding, the data key, resuming ------------------------------------

def train_args(folder: Path, out: Path, prompts: str, steps: int, *extra: str, kind: str = "eagle") -> list[str]:
    return ["train", kind, "--model", str(folder), "--dtype", "float32", "--device", DEVICE, "--threads", "1",
            "--data", "self", "--prompts", prompts, "--max-new-tokens", "8", "--max-tokens", "500",
            "--steps", str(steps), "--batch-tokens", "128", "--draft-vocab", "32", "--out", str(out), *extra,
            *(["--layers", "1"] if kind == "draft" else [])]


@pytest.fixture
def prompt_files(tmp_path) -> tuple[Path, Path]:
    return write(tmp_path / "chat.txt", word_prompts(30, 4, 4)), write(tmp_path / "qa.txt", word_prompts(30, 6, 5))


@pytest.mark.parametrize("kind", ["eagle", "medusa", "draft"])
@pytest.mark.parametrize("extra,message", [
    (["--prompts", "x.jsonl:abc"], "--prompts 'x.jsonl:abc': the weight 'abc' is not a number"),
    (["--prompts", "x.jsonl:0"], "the weight must be a positive number"),
    (["--prompts", "/no/such.jsonl"], "--prompts /no/such.jsonl: no such file"),
    (["--prompts", "{empty}"], "no prompts in the file"),
    (["--prompts", "{txt}", "--data", "text"], "use --data self"),
    (["--prompts", "{txt}", "--features", "{txt}"], "--features and --prompts: give one"),
    (["--prompts", "{txt}", "--data", "self", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_bad_prompts_input_is_one_line_before_the_target_loads(tmp_path, capsys, kind, extra, message):
    (tmp_path / "empty.jsonl").write_text("")
    write(tmp_path / "p.txt", ["the cat"])
    extra = [e.format(empty=tmp_path / "empty.jsonl", txt=tmp_path / "p.txt") for e in extra]
    code = main(["train", kind, "--model", "/no/such/model", "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specdec: error: ") and message in err and err.count("\n") == 1, err


def test_same_seed_same_data_and_same_first_steps(folder, prompt_files, tmp_path):
    spec = f"{prompt_files[0]}:2,{prompt_files[1]}:1"
    for out in ("one", "two"):
        assert main(train_args(folder, tmp_path / out, spec, 4)) == 0
    one, two = (Features.load(tmp_path / out / "features-self.safetensors") for out in ("one", "two"))
    assert [t.tolist() for t in one.tokens] == [t.tolist() for t in two.tokens]
    assert all(torch.equal(a, b) for a, b in zip(one.hidden, two.hidden)) and one.recipe == two.recipe
    assert [p["sha256"] for p in one.recipe["prompts"]] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in prompt_files]
    assert [p["weight"] for p in one.recipe["prompts"]] == [2.0, 1.0]
    a, b = (torch.load(tmp_path / out / CHECKPOINT, weights_only=True) for out in ("one", "two"))
    assert a["log"]["losses"] == b["log"]["losses"] and a["step"] == 4
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert json.loads((tmp_path / "one" / "config.json").read_text())["trained_with"].count("--prompts") == 1


@pytest.mark.parametrize("change", ["file contents", "weights", "limit"])
def test_resume_refuses_features_of_other_prompts(folder, prompt_files, tmp_path, capsys, change):
    chat, qa = prompt_files
    spec = f"{chat}:2,{qa}:1"
    assert main(train_args(folder, tmp_path / "out", spec, 2)) == 0
    assert main(train_args(folder, tmp_path / "out", spec, 3, "--resume")) == 0  # the same data resumes
    extra = []
    if change == "file contents":
        qa.write_text(qa.read_text() + "the cat sat\n")
    elif change == "weights":
        spec = f"{chat}:1,{qa}:1"
    else:
        extra = ["--limit", "10"]
    capsys.readouterr()
    assert main(train_args(folder, tmp_path / "out", spec, 4, "--resume", *extra)) == 2
    err = capsys.readouterr().err
    changed = "limit" if change == "limit" else "prompts"
    assert f"features-self.safetensors was collected from other data ({changed})" in err and err.count("\n") == 1, err


def test_interrupted_then_resumed_equals_uninterrupted(folder, prompt_files, tmp_path, monkeypatch):
    spec = f"{prompt_files[0]}:1,{prompt_files[1]}:3"
    monkeypatch.setattr(train_draft, "CHECKPOINT_EVERY", 2)
    assert main(train_args(folder, tmp_path / "whole", spec, 6, kind="draft")) == 0
    real_step, calls = train_draft.train_step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_draft, "train_step", interrupted_step)
    assert main(train_args(folder, tmp_path / "cut", spec, 6, kind="draft")) == 130
    assert torch.load(tmp_path / "cut" / CHECKPOINT, weights_only=True)["step"] == 4
    monkeypatch.setattr(train_draft, "train_step", real_step)

    def no_collecting(*args, **kwargs):
        raise AssertionError("--resume must reuse the features collected from the same prompts")

    monkeypatch.setattr(common, "collect_features", no_collecting)
    assert main(train_args(folder, tmp_path / "cut", spec, 6, "--resume", kind="draft")) == 0
    whole, resumed = (load_file(str(tmp_path / out / "model.safetensors")) for out in ("whole", "cut"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)

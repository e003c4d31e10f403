"""`specdec train ... --prompts SPEC`: the prompt files a drafter's training data comes from.

SPEC is one entry or several, comma-separated, each `FILE` or `FILE:WEIGHT`:
- FILE is anything `specdec bench --task` reads (specdec.bench.tasks, whose loaders this reuses): a
  `.jsonl` file of `question` records (GSM8K style: the prompt is the question plus
  GSM8K_INSTRUCTION) or `turns` records (Spec-Bench / MT-bench style: the first turn is the prompt), a
  `.txt` file with one prompt per line, or a built-in set: gsm8k-train (the default), general (chat,
  writing, rewriting, translation and passages: a general mix), or gsm8k-eval, mixed and heldout, which
  are evaluation sets: training on them is allowed, with a warning on stderr.
  An entry naming an existing file is that file even when its name holds a ':'.
- WEIGHT is a positive number (default 1): the file's share of the collected tokens is
  WEIGHT / (sum of the weights); the drawing rule is in specdec.train.data.

Answers. A JSONL record's `answer` is the assistant turn `--data text` teacher-forces: any text (bench
reads it only as a final number; here it is the whole turn); a `question` record's answer is a GSM8K
solution, whose calculator annotations (<<48/2=24>>) are removed. `.txt` files hold no answers, so
`--data text` refuses them (`check_answers`) and tells the user to use `--data self`.

Identity (`PromptSet.describe`): each file's name, size in bytes, SHA-256 of its contents and weight;
the training-data cache key is built from it (specdec.train.common), so features collected from other
prompts are never taken for these.

Every mistake (a missing, empty or malformed file, a bad weight, a file named twice) is one UserError line.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.tasks import BUILTIN_TASKS, DATA_DIR, parse_record, read_lines, read_records, resolve_spec
from specdec.errors import UserError

DEFAULT_PROMPTS = "gsm8k-train"
EVAL_SETS = ("gsm8k-eval", "mixed", "heldout")  # what bench and the drafters' targets are measured on
CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. <<48/2=24>>


@dataclass(frozen=True)
class PromptFile:
    spec: str  # a file path or a built-in set name, as given
    weight: float  # > 0


@dataclass(frozen=True)
class Prompt:
    text: str  # the user message, before the chat template (bench's prompt)
    answer: str | None  # the assistant turn --data text teacher-forces, where the file gives one
    where: str  # file:line, for messages


@dataclass
class PromptSet:
    file: PromptFile
    path: Path  # the file read
    prompts: list[Prompt]  # in file order, the first --limit

    def describe(self) -> dict:
        """What identifies this set's data (with --limit): file name, size, SHA-256 of the contents, weight."""
        content = self.path.read_bytes()
        return {"file": self.path.name, "bytes": len(content), "sha256": hashlib.sha256(content).hexdigest(),
                "weight": self.file.weight}


def parse_prompt_spec(spec: str) -> list[PromptFile]:
    """The entries of a --prompts SPEC (see the module docstring), in order."""
    entries = [entry.strip() for entry in spec.split(",")]
    if not all(entries):
        raise UserError(f"--prompts {spec!r}: an empty entry; give FILE or FILE:WEIGHT, comma-separated")
    return [parse_entry(entry) for entry in entries]


def parse_entry(entry: str) -> PromptFile:
    if entry in BUILTIN_TASKS or Path(entry).is_file() or ":" not in entry:
        return PromptFile(entry, 1.0)
    name, _, weight = entry.rpartition(":")
    if not name:
        raise UserError(f"--prompts {entry!r}: no file before ':{weight}'")
    return PromptFile(name, parse_weight(weight, entry))


def parse_weight(text: str, entry: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise UserError(f"--prompts {entry!r}: the weight {text!r} is not a number") from None
    if not math.isfinite(weight) or weight <= 0:
        raise UserError(f"--prompts {entry!r}: the weight must be a positive number, got {text}")
    return weight


def read_prompt_sets(files: list[PromptFile], limit: int | None = None) -> list[PromptSet]:
    """Each file's prompts (the first `limit` of each); a file named twice is an error, an evaluation
    set gets a warning on stderr."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be a positive number of prompts, got {limit}")
    sets = [read_prompt_set(file, limit) for file in files]
    paths = [s.path.resolve() for s in sets]
    twice = next((s for s, p in zip(sets, paths) if paths.count(p) > 1), None)
    if twice is not None:
        raise UserError(f"--prompts names {twice.path} twice; give it once, with a weight")
    return sets


def read_prompt_set(file: PromptFile, limit: int | None) -> PromptSet:
    if file.spec not in BUILTIN_TASKS and not Path(file.spec).is_file():
        raise UserError(f"--prompts {file.spec}: no such file")
    path, _ = resolve_spec(file.spec)  # bench's checks: a built-in set, or a .jsonl / .txt file
    prompts = read_txt(path) if path.suffix == ".txt" else read_jsonl(path)
    if not prompts:
        raise UserError(f"--prompts {file.spec}: no prompts in the file")
    warn_if_eval_set(file.spec, path)
    return PromptSet(file, path, prompts[:limit])


def read_txt(path: Path) -> list[Prompt]:
    return [Prompt(line, None, f"{path}:{n}") for n, line in read_lines(path)]


def read_jsonl(path: Path) -> list[Prompt]:
    """Bench's records (parse_record gives the prompt), each with its `answer` as free text."""
    prompts = []
    for i, (where, record) in enumerate(read_records(path)):
        answer = record.pop("answer", None)
        task = parse_record(record, where, str(i))
        prompts.append(Prompt(task.prompt, answer_text(answer, "question" in record, where), where))
    return prompts


def answer_text(answer, gsm8k: bool, where: str) -> str | None:
    """A record's answer as the assistant turn: stripped text; a GSM8K solution without its calculator annotations."""
    if answer is None:
        return None
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise UserError(f"{where}: 'answer' must be non-empty text")
    text = str(answer).strip()
    return CALCULATOR.sub("", text).strip() if gsm8k else text


def check_answers(sets: list[PromptSet]) -> None:
    """--data text teacher-forces answers: every prompt used needs one."""
    for prompt_set in sets:
        missing = next((p for p in prompt_set.prompts if p.answer is None), None)
        if missing is None:
            continue
        what = (f"{prompt_set.path} holds prompts only (a .txt file has no answers)" if prompt_set.path.suffix == ".txt"
                else f"{missing.where} has no 'answer'")
        raise UserError(f"--data text teacher-forces answers, but {what}: use --data self to train on the "
                        f"target's own continuations of these prompts")


def warn_if_eval_set(spec: str, path: Path) -> None:
    if path.resolve() in {(DATA_DIR / f"{name}.jsonl").resolve() for name in EVAL_SETS}:
        print(f"specdec: warning: --prompts {spec} is an evaluation set: a drafter trained on it will measure "
              f"better on it than it drafts elsewhere", file=sys.stderr)

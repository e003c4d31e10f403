"""Task sets: the prompts a benchmark runs, and the scoring of GSM8K-style answers.

`load_tasks(spec)` accepts
- a built-in set: `gsm8k-eval` (the default; 500 GSM8K problems no drafter trains on), `gsm8k-train`
  (the other 6,973, for training drafters), `mixed` (24 reasoning / summarisation / chat prompts) or
  `heldout` (40 qa / rag / translation / summarisation / chat prompts nothing trains on) or `general`
  (636 chat, writing, rewriting, translation and passage prompts, for training drafters beyond GSM8K);
- a `.jsonl` file whose lines hold either a `question` (GSM8K style: optional `answer` ending in
  `#### N`, optional `category`; the prompt is the question plus GSM8K_INSTRUCTION) or `turns`
  (MT-bench / Spec-Bench style: the first turn is the prompt; optional `category`, `question_id`,
  and `answer` as above);
- a `.txt` file with one prompt per line (blank lines skipped).
Anything else, an empty set, a bad line or a repeated `question_id` raises UserError with one line naming
the file and line.

Prompts are plain user messages: the engine applies the chat template (specdec.api.encode_prompt).
A task's `reference` is the normalised final number (see `normalise_number`) or None where unknown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from specdec.errors import UserError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUILTIN_TASKS = ("gsm8k-eval", "gsm8k-train", "mixed", "heldout", "general")
DEFAULT_TASKS = "gsm8k-eval"
GSM8K_INSTRUCTION = (
    "Solve the problem step by step. "
    "Then write the final answer on the last line as '#### <number>'."
)
# A number with an optional '$', thousands separators and decimal part. A sign counts only where it
# does not follow a word or ')': in "10-3" the '-' is subtraction, so that number is 3, not -3.
NUMBER = re.compile(r"(?:(?<![\w)])[-+])?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str                # the user message, before any chat template
    category: str | None
    reference: str | None      # normalised final answer, where known


def load_tasks(spec: str = DEFAULT_TASKS, limit: int | None = None) -> list[Task]:
    """The tasks of a built-in set or a file (see the module docstring); the first `limit` if given."""
    if limit is not None and limit < 1:
        raise UserError(f"limit must be a positive number of tasks, got {limit}")
    path, name = resolve_spec(spec)
    tasks = read_txt(path, name) if path.suffix == ".txt" else read_jsonl(path, name)
    if not tasks:
        raise UserError(f"{path}: no tasks in the file")
    return tasks[:limit]


def resolve_spec(spec: str) -> tuple[Path, str]:
    """(file, name used in task ids) for a built-in set name or a file path."""
    if spec in BUILTIN_TASKS:
        return DATA_DIR / f"{spec}.jsonl", spec
    path = Path(spec)
    if path.is_file():
        if path.suffix not in (".jsonl", ".txt"):
            raise UserError(f"{path}: unsupported task file type {path.suffix!r}; use .jsonl or .txt")
        return path, path.stem
    if path.suffix in (".jsonl", ".txt") or len(path.parts) > 1:
        raise UserError(f"{spec}: no such task file")
    raise UserError(f"unknown task set {spec!r}: use {', '.join(BUILTIN_TASKS)} or a .jsonl / .txt file")


def read_lines(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, stripped text) of each non-blank line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    return [(n, line.strip()) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def read_txt(path: Path, name: str) -> list[Task]:
    return [Task(f"{name}-{i}", line, None, None) for i, (_, line) in enumerate(read_lines(path))]


def read_records(path: Path) -> list[tuple[str, dict]]:
    """Each line of a JSONL file as (where: "file:line", its JSON object); UserError for a bad line."""
    records = []
    for n, line in read_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise UserError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
        records.append((f"{path}:{n}", record))
    return records


def read_jsonl(path: Path, name: str) -> list[Task]:
    """The file's tasks; UserError where two lines give the same `question_id` (two files run together,
    say): reports and the lossless check match each method's output to plain's by task id."""
    tasks, first = [], {}
    for i, (where, record) in enumerate(read_records(path)):
        task = parse_record(record, where, f"{name}-{i}")
        if task.id in first:
            raise UserError(f"{where}: question_id {task.id!r} repeats {first[task.id]}'s: give every task its own "
                            f"id (results are matched prompt by prompt by id)")
        first[task.id] = where
        tasks.append(task)
    return tasks


def parse_record(record: dict, where: str, default_id: str) -> Task:
    """One JSONL record as a Task; `where` (file:line) prefixes any error."""
    if "question" in record:
        prompt = f"{check_text(record['question'], where, 'question')}\n\n{GSM8K_INSTRUCTION}"
    elif "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise UserError(f"{where}: 'turns' must be a non-empty list of strings")
        prompt = check_text(turns[0], where, "turns[0]")
    else:
        raise UserError(f"{where}: a task needs a 'question' or a 'turns' field")
    category = record.get("category")
    reference = parse_reference(record["answer"], where) if record.get("answer") is not None else None
    task_id = str(record["question_id"]) if record.get("question_id") is not None else default_id
    return Task(task_id, prompt, None if category is None else str(category), reference)


def check_text(value, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{where}: '{field}' must be a non-empty string")
    return value.strip()


def parse_reference(answer, where: str) -> str:
    """The normalised number after the last '####' of a GSM8K answer, or a bare number."""
    text = str(answer).rsplit("####", 1)[-1].strip()
    reference = normalise_number(text)
    if reference is None:
        raise UserError(f"{where}: 'answer' must end in '#### <number>' or be a number, got {text[:40]!r}")
    return reference


def normalise_number(text: str) -> str | None:
    """Canonical form of a number: no '$', ',' or leading '+'; integral values as integers ('5.00' -> '5');
    other decimals without trailing zeros. None if `text` is not a number."""
    cleaned = text.strip().replace("$", "").replace(",", "").rstrip(".").lstrip("+")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final number of a model output: the first number after the last '####' if there is one,
    else the last number in the text; normalised. None when the text holds no number."""
    head, marker, tail = text.rpartition("####")
    after = NUMBER.findall(tail) if marker else []
    numbers = after[:1] or NUMBER.findall(head if marker else tail)[-1:]
    return normalise_number(numbers[0]) if numbers else None


def is_correct(output: str, reference: str) -> bool:
    """Whether the output's final number equals the reference (both normalised)."""
    answer = extract_answer(output)
    return answer is not None and answer == (normalise_number(reference) or reference.strip())


def accuracy(outputs: list[str], tasks: list[Task]) -> float | None:
    """Fraction correct over the tasks that have a reference; None when none has one."""
    scored = [is_correct(out, task.reference) for out, task in zip(outputs, tasks, strict=True) if task.reference is not None]
    return sum(scored) / len(scored) if scored else None


def categories(tasks: list[Task]) -> list[str]:
    """The distinct categories of `tasks`, sorted; tasks without one are left out."""
    return sorted({task.category for task in tasks if task.category is not None})

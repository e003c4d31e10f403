"""Task sets: every loader format and error, the shipped GSM8K split, answer extraction and scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.bench.tasks import (
    GSM8K_INSTRUCTION,
    Task,
    accuracy,
    categories,
    extract_answer,
    is_correct,
    load_tasks,
)
from specdec.errors import UserError

DATA = Path(__file__).resolve().parent.parent / "specdec" / "data"
SOURCE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def questions(path: Path) -> list[str]:
    return [json.loads(line)["question"] for line in path.read_text(encoding="utf-8").splitlines()]


# --- loaders -------------------------------------------------------------------------------------


def test_question_jsonl_gets_instruction_reference_and_category(tmp_path):
    path = write_jsonl(tmp_path / "maths.jsonl", [
        {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5", "category": "sums"},
        {"question": "  How many legs have 2 cats? ", "answer": "#### 1,008"},
        {"question": "Name a prime."},
    ])
    tasks = load_tasks(str(path))
    assert tasks[0] == Task("maths-0", f"What is 2 + 3?\n\n{GSM8K_INSTRUCTION}", "sums", "5")
    assert tasks[1].prompt.startswith("How many legs have 2 cats?\n\n") and tasks[1].reference == "1008"
    assert tasks[1].category is None
    assert tasks[2].reference is None and tasks[2].id == "maths-2"


def test_turns_jsonl_uses_first_turn_and_question_id(tmp_path):
    path = write_jsonl(tmp_path / "mt.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
        {"turns": ["Tell me a joke."]},
        {"question_id": 83, "category": "math", "turns": ["What is 6 * 7?"], "answer": "42"},
    ])
    tasks = load_tasks(str(path))
    assert tasks[0] == Task("81", "Write a haiku.", "writing", None)
    assert tasks[1] == Task("mt-1", "Tell me a joke.", None, None)
    assert tasks[2].reference == "42" and categories(tasks) == ["math", "writing"]


def test_txt_one_prompt_per_line_skips_blank_lines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("First prompt\n\n   \nSecond prompt  \n", encoding="utf-8")
    assert load_tasks(str(path)) == [Task("prompts-0", "First prompt", None, None), Task("prompts-1", "Second prompt", None, None)]


def test_blank_jsonl_lines_are_skipped_but_counted_in_line_numbers(tmp_path):
    path = tmp_path / "gappy.jsonl"
    path.write_text('{"turns": ["a"]}\n\n{"turns": ["b"]}\n', encoding="utf-8")
    assert [t.prompt for t in load_tasks(str(path))] == ["a", "b"]
    path.write_text('{"turns": ["a"]}\n\n{"turns": ["b"]}\n{oops\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"gappy.jsonl:4: not valid JSON"):
        load_tasks(str(path))


def test_limit_takes_the_first_n(tmp_path):
    path = write_jsonl(tmp_path / "five.jsonl", [{"turns": [f"p{i}"]} for i in range(5)])
    assert [t.prompt for t in load_tasks(str(path), limit=3)] == ["p0", "p1", "p2"]
    assert len(load_tasks(str(path), limit=50)) == 5
    with pytest.raises(UserError, match="limit"):
        load_tasks(str(path), limit=0)


# --- load errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", "", r"no tasks"),
    ("blank.txt", "\n  \n", r"no tasks"),
    ("bad.jsonl", '{"turns": ["ok"]}\n{"turns": [\n', r"bad.jsonl:2: not valid JSON"),
    ("list.jsonl", '["not", "an", "object"]\n', r"list.jsonl:1: expected a JSON object"),
    ("neither.jsonl", '{"turns": ["ok"]}\n{"prompt": "hi"}\n', r"neither.jsonl:2: a task needs a 'question' or a 'turns'"),
    ("noturns.jsonl", '{"turns": []}\n', r"noturns.jsonl:1: 'turns' must be a non-empty list"),
    ("emptyq.jsonl", '{"question": "  "}\n', r"emptyq.jsonl:1: 'question' must be a non-empty string"),
    ("badanswer.jsonl", '{"question": "q", "answer": "no number here"}\n', r"badanswer.jsonl:1: 'answer' must end in"),
    ("tasks.csv", "question\nhi\n", r"unsupported task file type '.csv'"),
    ("twice.jsonl", '{"question_id": 1, "turns": ["a"]}\n{"question_id": 2, "turns": ["b"]}\n{"question_id": 1, "turns": ["c"]}\n',
     r"twice.jsonl:3: question_id '1' repeats .*twice.jsonl:1's"),
])
def test_bad_files_raise_one_line_user_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message) as info:
        load_tasks(str(path))
    assert "\n" not in str(info.value)


def test_unknown_spec_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="unknown task set 'gsm9k'"):
        load_tasks("gsm9k")
    with pytest.raises(UserError, match="missing.jsonl: no such task file"):
        load_tasks(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="no such task file"):
        load_tasks(str(tmp_path / "prompts"))


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        load_tasks(str(path))


# --- shipped data --------------------------------------------------------------------------------


def test_default_is_the_500_problem_eval_split():
    tasks = load_tasks()
    assert len(tasks) == 500 and len({t.id for t in tasks}) == 500
    assert all(t.reference is not None and t.prompt.endswith(GSM8K_INSTRUCTION) for t in tasks)


def test_eval_and_train_are_disjoint():
    eval_q, train_q = questions(DATA / "gsm8k-eval.jsonl"), questions(DATA / "gsm8k-train.jsonl")
    assert len(eval_q) == 500 and not set(eval_q) & set(train_q)
    assert all(set(json.loads(line)) == {"question", "answer"} for line in (DATA / "gsm8k-eval.jsonl").read_text().splitlines())


@pytest.mark.skipif(not SOURCE.is_file(), reason="the GSM8K source (../shared) is not beside this checkout")
def test_split_partitions_the_source():
    source = questions(SOURCE)
    eval_q, train_q = questions(DATA / "gsm8k-eval.jsonl"), questions(DATA / "gsm8k-train.jsonl")
    assert sorted(eval_q + train_q) == sorted(source) and len(source) == 7473


def test_mixed_set_covers_three_categories_from_held_out_problems():
    tasks = load_tasks("mixed")
    assert categories(tasks) == ["chat", "reasoning", "summarisation"]
    assert len(tasks) >= 20 and len({t.id for t in tasks}) == len(tasks)
    eval_q = set(questions(DATA / "gsm8k-eval.jsonl"))
    reasoning = [t for t in tasks if t.category == "reasoning"]
    assert reasoning and all(t.reference is not None and t.prompt.endswith(GSM8K_INSTRUCTION) for t in reasoning)
    assert all(t.prompt.removesuffix(GSM8K_INSTRUCTION).strip() in eval_q for t in reasoning)


# --- answers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, answer", [
    ("#### 1,234", "1234"),
    ("$5.00", "5"),
    ("the answer is 18.", "18"),
    ("-3", "-3"),
    ("so 7 + 8 = 15\n#### 15", "15"),
    ("She has 3 apples and 4 pears.\n#### 7\nI hope that helps with 2 things.", "7"),
    ("#### 10\nwait, recount\n#### 12", "12"),
    ("10 - 3 = 7, and 10-3", "3"),
    ("It costs $2,500.50 in total", "2500.5"),
    ("+42", "42"),
    ("18.0", "18"),
    ("####", None),
    ("no digits at all", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_is_correct_normalises_both_sides():
    assert is_correct("... so she pays $1,200.00.", "1200")
    assert is_correct("#### 1200", "1,200")
    assert not is_correct("#### 12", "1200")
    assert not is_correct("I don't know", "5")


def test_accuracy_counts_only_tasks_with_a_reference():
    tasks = [Task("a", "p", None, "5"), Task("b", "p", None, "7"), Task("c", "p", "chat", None)]
    assert accuracy(["#### 5", "#### 8", "anything"], tasks) == 0.5
    assert accuracy(["x"], [Task("c", "p", None, None)]) is None
    with pytest.raises(ValueError):
        accuracy(["#### 5"], tasks)

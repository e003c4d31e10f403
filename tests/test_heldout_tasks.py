"""The shipped held-out set: 40 prompts, 8 in each of five non-GSM8K categories, distinct ids."""

from __future__ import annotations

from collections import Counter

from specdec.bench.tasks import load_tasks

CATEGORIES = ("chat", "qa", "rag", "summarisation", "translation")


def test_heldout_has_eight_nonempty_prompts_per_category_and_unique_ids():
    tasks = load_tasks("heldout")
    assert len(tasks) == 40
    assert Counter(t.category for t in tasks) == {c: 8 for c in CATEGORIES}
    assert all(t.prompt.strip() for t in tasks)
    assert len({t.id for t in tasks}) == 40
    assert all(t.reference is None for t in tasks)

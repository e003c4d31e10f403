"""Same seed, same output (docs/design.md, "Random numbers"); different seeds, different samples."""

from __future__ import annotations

import pytest

import specdec
from specdec import SamplingParams

PROMPTS = [[5, 17, 3, 5, 17], [9, 1, 77], [40, 41, 42, 40, 41, 42, 40]]  # a batch of 3, different lengths
MAX_NEW = 12


def sample_ids(target, draft, drafter: str, seed: int) -> list[list[int]]:
    out = specdec.generate(
        PROMPTS,
        model=target,
        drafter=drafter,
        gamma=3,
        sampling=SamplingParams(temperature=1.0, seed=seed),
        max_new_tokens=MAX_NEW,
        draft_model=draft,
    )
    return [row.token_ids for row in out.rows]


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model"])
def test_same_seed_same_output(tiny, tiny_draft, drafter):
    first = sample_ids(tiny, tiny_draft, drafter, seed=123)
    assert [len(ids) for ids in first] == [MAX_NEW] * len(PROMPTS)
    assert sample_ids(tiny, tiny_draft, drafter, seed=123) == first


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model"])
def test_different_seeds_give_different_outputs(tiny, tiny_draft, drafter):
    outputs = [sample_ids(tiny, tiny_draft, drafter, seed) for seed in (1, 2, 3)]
    assert outputs[0] != outputs[1] and outputs[1] != outputs[2] and outputs[0] != outputs[2]

"""Tree proposals through the engine: one target forward over all nodes with the tree mask and depth
positions, verification, and compaction of the accepted path in the KV cache.

A test drafter proposes a fixed-shape tree per row. Deterministic mode: the main branch is prompt
lookup's continuation (so deep paths get accepted), side branches are random tokens; greedy output
must equal plain greedy decoding exactly (batch 1 and 3). Sampled mode: every node is drawn from a
uniform q (siblings i.i.d.), and sampled output must match plain sampling's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec
from conftest import DEVICE, tiny_pair
from specdec import SamplingParams
from specdec.drafters.base import DraftShape, Proposal, Stateless
from specdec.drafters.ngram import find_continuations
from specdec.verify import TreeSpec
from test_engine import MAX_NEW, PROMPTS, models, plain  # noqa: F401  (fixtures)
from test_sampling_e2e import ALPHA, PROMPT, ROWS, VOCAB, distribution_pvalues, tokens_of

# Breadth-first, so "nodes up to depth k" is a prefix. Main branch 0 -> 2 -> 5 -> 7; side nodes 1, 3, 4, 6.
PARENTS = [-1, -1, 0, 0, 1, 2, 2, 5]
DEPTHS = [1, 1, 2, 2, 2, 3, 3, 4]
MAIN = [0, 2, 5, 7]


class TreeDrafter(Stateless):
    name = "test_tree"
    graphable = False  # its random side branches come from numpy

    def __init__(self, vocab: int, sampled: bool, seed: int = 0) -> None:
        self.vocab, self.sampled = vocab, sampled
        self.rng = np.random.default_rng(seed)

    def shape(self, gamma: int) -> DraftShape:
        return DraftShape(width=len(PARENTS), depth=min(gamma, max(DEPTHS)), tree=True)

    def propose(self, batch, gamma: int, u) -> Proposal:
        B, N = batch.capacity, len(PARENTS)
        tokens = torch.tensor(self.rng.integers(0, self.vocab, size=(B, N)), device=DEVICE)
        if not self.sampled:  # deterministic nodes may be anything; sampled ones must really come from q
            lookup, found = find_continuations(batch.tokens, batch.length, len(MAIN), 3, 1)
            tokens[:, MAIN] = torch.where(found[:, None], lookup, tokens[:, MAIN])
        depth = self.shape(gamma).depth
        num_nodes = sum(d <= depth for d in DEPTHS)  # never deeper than the step allows
        tree = TreeSpec(torch.tensor([PARENTS] * B, device=DEVICE), torch.full((B,), num_nodes, device=DEVICE), depth, 2)
        q = torch.full((B, N, self.vocab), 1.0 / self.vocab, device=DEVICE) if self.sampled else None
        return Proposal(tokens=tokens, q=q, tree=tree)


@pytest.mark.parametrize("batch", [1, 3])
def test_tree_greedy_equals_plain(models, plain, batch):  # noqa: F811
    target, _, _ = models
    prompts, expected = (PROMPTS, plain) if batch == 3 else (PROMPTS[2:], plain[2:])
    engine = specdec.SpecEngine(target, TreeDrafter(target.config.vocab_size, sampled=False))
    out = engine.generate(prompts, specdec.SpecConfig(gamma=4, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == expected
    assert out.stats.accepted_per_position[1] > 0  # paths of depth >= 2 were accepted
    assert out.stats.draft_nodes > out.stats.drafted  # nodes counted beside depth


def test_tree_cache_compaction_keeps_the_cache_consistent(models, plain):  # noqa: F811
    """After a long tree-decoded run, the cache must equal one built by feeding the output plainly."""
    target, _, _ = models
    engine = specdec.SpecEngine(target, TreeDrafter(target.config.vocab_size, sampled=False))
    out = engine.generate(PROMPTS[:1], specdec.SpecConfig(gamma=4, max_new_tokens=MAX_NEW))
    ids = PROMPTS[0] + out.rows[0].token_ids
    fresh = target.new_cache(1, len(ids) + 8)
    logits = target(torch.tensor([ids], device=DEVICE), torch.arange(len(ids), device=DEVICE)[None], fresh).logits
    assert logits[0, len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist() == out.rows[0].token_ids


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tree-e2e")
    return tiny_pair(folder, "llama", seed=0, logit_scale=4.0, vocab_size=VOCAB)[0]


def sample_rows(target, drafter, seed: int):
    engine = specdec.SpecEngine(target, drafter)
    config = specdec.SpecConfig(gamma=3, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=seed))
    return engine.generate([PROMPT] * ROWS, config)


def test_tree_sampling_matches_plain_sampling(small):
    plain_tokens = tokens_of(sample_rows(small, "none", seed=1))
    out = sample_rows(small, TreeDrafter(VOCAB, sampled=True, seed=5), seed=2)
    assert 0 < out.stats.accepted < out.stats.drafted
    pvalues = distribution_pvalues(tokens_of(out), plain_tokens)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues

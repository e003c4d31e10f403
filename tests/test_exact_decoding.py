"""Greedy speculative decoding equals plain greedy decoding token for token on the exact kernel path,
in float32 and bfloat16, for every drafter, batch 1 and 3, on a tiny random model whose logits are NOT
sharpened: its next-token distributions are nearly flat, so near-ties are everywhere and any rounding
difference between a verify block and a single-token forward would change a token.

(tests/test_cpu_exact.py and tests/test_triton_ops.py show, per forward, that the library kernels do
differ between block sizes on such models: the power of these checks.)
"""

from __future__ import annotations

import pytest
import torch

import specdec
from conftest import DEVICE, build_hf, save_hf
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.drafters.medusa import DEFAULT_TREE, MedusaDrafter, MedusaTree
from specdec.models import load_model
from specdec.models.kernels import kernel_path
from test_eagle import random_head
from test_medusa import random_heads

PROMPTS = [[5, 17, 3, 9, 44, 2, 71], [12, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 30, 31]]
MAX_NEW = 32
DRAFTERS = ["ngram", "draft_model", "eagle", "medusa", "lookahead", "layer_skip", "suffix",
            pytest.param("quantized", marks=pytest.mark.skipif(DEVICE != "cpu", reason="int8 drafts run on the CPU"))]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def flat(request, tmp_path_factory):
    """(target, draft, plain greedy outputs) of unsharpened tiny models in this dtype, exact kernels."""
    tmp = tmp_path_factory.mktemp(f"flat-{request.param}")
    target = load_model(str(save_hf(build_hf("llama", seed=0, num_hidden_layers=3), tmp / "t")),
                        dtype=request.param, device=DEVICE, kernels="exact")
    draft = load_model(str(save_hf(build_hf("llama", seed=1, num_hidden_layers=1), tmp / "d")),
                       dtype=request.param, device=DEVICE, kernels="exact")
    assert kernel_path(target).exact
    plain = specdec.SpecEngine(target, "none").generate(PROMPTS, specdec.SpecConfig(max_new_tokens=MAX_NEW))
    return target, draft, [r.token_ids for r in plain.rows]


def make(name: str, target, draft):
    if name == "draft_model":
        return DraftModelDrafter(target, draft)
    if name == "eagle":
        return EagleDrafter(target, random_head(target, draft_vocab=64).to(next(target.parameters()).dtype),
                            EagleTreeConfig(depth=4, branch=3, frontier=3, total_tokens=12))
    if name == "medusa":
        return MedusaDrafter(target, random_heads(target), MedusaTree.of(DEFAULT_TREE, 4))
    return name


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_speculation_equals_plain_with_near_ties(flat, name, gamma):
    target, draft, plain = flat
    engine = specdec.SpecEngine(target, make(name, target, draft))
    config = specdec.SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW)
    for batch in ([PROMPTS[2]], PROMPTS):
        out = engine.generate(batch, config)
        expected = plain[2:] if len(batch) == 1 else plain
        assert [r.token_ids for r in out.rows] == expected, (name, gamma, len(batch))
    assert out.stats.drafted > 0


def test_near_ties_are_there(flat):
    """The model's top two logits are close at most steps (else this file would test little)."""
    target, _, plain = flat
    ids = torch.tensor([PROMPTS[0] + plain[0]], device=DEVICE)
    cache = target.new_cache(1, ids.shape[1])
    logits = target(ids, torch.arange(ids.shape[1], device=DEVICE)[None], cache).logits[0].float()  # [T, V]
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) < 0.05).float().mean() > 0.1


def test_the_check_catches_a_block_dependent_target(flat, monkeypatch):
    """Power: a target whose logits move by a hair (about 1e-2, token by token) when computed in a block of
    more than one token, as library kernels' rounding does, must make speculative output differ here."""
    target, _, plain = flat
    forward = target.forward
    hair = 1e-2 * torch.randn(target.config.vocab_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)  # [V]

    def block_dependent(tokens, positions, cache, mask=None, logits_at=None):
        out = forward(tokens, positions, cache, mask, logits_at)
        out.logits = out.logits + hair * (tokens.shape[1] > 1)
        return out

    monkeypatch.setattr(target, "forward", block_dependent)
    out = specdec.SpecEngine(target, "ngram").generate(PROMPTS, specdec.SpecConfig(gamma=4, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] != plain

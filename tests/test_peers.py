"""The transformers peer samples from specdec's distribution: every filter passed as specdec means it
(0 / 1 = off), and nothing the model folder's generation_config.json ships leaks into `generate`."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import DEVICE, TINY, build_hf, save_hf
from specdec.bench.peers import HFPeer, hf_generate_kwargs
from specdec.config import SamplingParams


@pytest.mark.parametrize("sampling, expected", [
    (SamplingParams(), {"do_sample": False}),
    (SamplingParams(temperature=0.8), {"top_k": 0, "top_p": 1.0, "min_p": None}),
    (SamplingParams(temperature=0.8, top_k=20), {"top_k": 20, "top_p": 1.0, "min_p": None}),
    (SamplingParams(temperature=0.8, min_p=0.05), {"top_k": 0, "top_p": 1.0, "min_p": 0.05}),
])
def test_hf_generate_kwargs(sampling, expected):
    if not sampling.greedy:
        expected = {"do_sample": True, "temperature": 0.8, **expected}
    assert hf_generate_kwargs(sampling) == expected


@pytest.fixture
def peer(tmp_path):
    """An HFPeer on a tiny Llama whose folder ships sampling defaults that differ from every test's."""
    from transformers import GenerationConfig

    folder = save_hf(build_hf("llama", seed=0), tmp_path / "llama")
    shipped = GenerationConfig(do_sample=True, temperature=0.3, top_k=5, top_p=0.5, min_p=0.2, repetition_penalty=1.5)
    shipped.save_pretrained(folder)
    return HFPeer(str(folder), torch.float32, torch.device(DEVICE))


def scores_and_logits(peer: HFPeer, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """[steps, V] scores the peer draws from (after every processor) and the raw logits, from the same
    `generate` kwargs HFPeer.generate passes."""
    ids = torch.tensor([[3, 1, 4, 1, 5]], device=DEVICE)
    torch.manual_seed(0)
    out = peer.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, output_scores=True,
                              output_logits=True, return_dict_in_generate=True, **hf_generate_kwargs(sampling))
    return torch.cat(out.scores), torch.cat(out.logits)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "top_k_0"])
def test_peer_applies_temperature_only_when_every_filter_is_off(peer, sampling):
    scores, logits = scores_and_logits(peer, sampling)
    assert torch.allclose(scores, logits / (sampling.temperature or 1.0))


def test_peer_applies_the_top_k_asked_for(peer):
    scores, _ = scores_and_logits(peer, SamplingParams(temperature=0.8, top_k=20))
    assert (scores.isfinite().sum(-1) == 20).all() and TINY["vocab_size"] > 20


def test_peer_generates_with_top_k_off(peer):
    out = peer.generate([3, 1, 4, 1, 5], 6, SamplingParams(temperature=0.8, seed=0), "hf")
    assert 1 <= len(out.token_ids) <= 6 and all(0 <= t < TINY["vocab_size"] for t in out.token_ids)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is an optional extra")
def test_llamacpp_draft_peer_speculates_with_a_draft_gguf(tmp_path):
    """The target as its own draft GGUF: llama.cpp's speculative loop runs and starts with its plain greedy
    tokens. (Not all of them: llama.cpp's verify blocks are not batch-invariant, and on this prompt its
    speculative greedy output left its plain output at token 17.)"""
    from specdec.bench.peers import LlamaCppPeer
    from specdec.config import SamplingParams
    from specdec.models.loading import default_gguf_path

    peer = LlamaCppPeer(default_gguf_path(), threads=2, context=512, draft=default_gguf_path())
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 2]
    plain = peer.generate(prompt, 24, SamplingParams(), "llamacpp")
    drafted = peer.generate(prompt, 24, SamplingParams(), "llamacpp-draft", gamma=3)
    assert len(drafted.token_ids) == len(plain.token_ids) == 24
    assert drafted.token_ids[:8] == plain.token_ids[:8]

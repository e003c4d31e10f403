"""Logits -> probabilities (temperature, top-k, top-p, min-p) and seeded sampling.

Lossless speculative sampling reproduces whatever distribution `logits_to_probs` gives for the
target; the drafter's q may be anything with q(x) > 0 wherever it proposes x.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.config import SamplingParams


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> probs [..., V] (float32). Greedy params give a one-hot at the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = keep_top_p(probs, params.top_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def keep_top_p(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """probs [..., V] -> token ids [...], one draw per row."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator

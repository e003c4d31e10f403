"""`ngram`: prompt lookup decoding (Saxena 2023), on the device. Match each row's last n tokens (n from
max_ngram down to min_ngram) against its earlier tokens (prompt and output), most recent match first,
and propose the tokens that followed it; a match near the end is copied on past the end, so a
repeating pattern is proposed for the full gamma. Deterministic (q is one-hot).

The search compares every earlier position of every row at once (a few elementwise passes over the
token history): no host work, so the step around it can be captured in a CUDA graph. On CUDA it runs
compiled (fused.run_compiled): as its own kernels, about fifty of them, it took 0.14 ms of an H200's
0.8-0.9 ms step (the default model), whatever the gamma, so on prompts it rarely matched (tau 1.13) it
made decoding 0.93x plain.
"""

from __future__ import annotations

from array import array

import torch
from torch import Tensor

from specdec.config import NgramConfig
from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Stateless, register
from specdec.models import fused


def latest_match(tokens: Tensor, length: Tensor, n: int) -> Tensor:
    """[B] start of the most recent earlier n-gram equal to each row's last n tokens (the n-gram must
    end before the row's last token), or -1. tokens [B, S], length [B]."""
    B, S = tokens.shape
    if n >= S:
        return torch.full_like(length, -1)
    suffix = tokens.gather(1, (length[:, None] - n + torch.arange(n, device=tokens.device)).clamp(min=0))  # [B, n]
    match = torch.ones(B, S - n + 1, dtype=torch.bool, device=tokens.device)  # [B, J] window j = tokens[j : j+n]
    for i in range(n):
        match &= tokens[:, i : S - n + 1 + i] == suffix[:, i : i + 1]
    j = torch.arange(S - n + 1, device=tokens.device)  # [J]
    match &= j + n <= (length - 1)[:, None]
    return torch.where(match, j, -1).amax(-1)


def copy_forward(tokens: Tensor, length: Tensor, start: Tensor, k: int) -> Tensor:
    """[B, k] tokens from each row's `start` on; past the row's end the copy repeats its own output
    (with tokens a b a b and start 2 it gives a b a b ...)."""
    period = (length - start).clamp(min=1)  # [B]
    index = start[:, None] + torch.arange(k, device=tokens.device) % period[:, None]  # [B, k]
    return tokens.gather(1, index.clamp(0, tokens.shape[1] - 1))


def find_continuations(tokens: Tensor, length: Tensor, k: int, max_ngram: int, min_ngram: int) -> tuple[Tensor, Tensor]:
    """(drafts [B, k], found [B]): the continuation of the longest matching suffix, per row."""
    start = torch.zeros_like(length)
    found = torch.zeros_like(length, dtype=torch.bool)
    for n in range(max_ngram, min_ngram - 1, -1):  # longest first: keep the first n that matches
        j = latest_match(tokens, length, n)
        hit = (j >= 0) & ~found
        start = torch.where(hit, j + n, start)
        found |= hit
    return copy_forward(tokens, length, start, k), found


def look_up(text: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """find_continuations for one row held on the host: the same draft (k tokens), or [] where no n-gram
    matched. The search runs over the tokens' bytes (bytes.rfind), so a long text costs little."""
    L = len(text)
    data = array("q", text).tobytes()  # 8 bytes a token
    for n in range(max_ngram, min_ngram - 1, -1):
        if L <= n:
            continue
        pattern, end = data[(L - n) * 8 :], (L - 1) * 8  # the last n tokens; windows ending before the last token
        at = data.rfind(pattern, 0, end)
        while at >= 0 and at % 8:  # a match across token boundaries: look further back
            at = data.rfind(pattern, 0, at + len(pattern) - 1)
        if at >= 0:
            start = at // 8 + n
            return [text[start + i % (L - start)] for i in range(k)]
    return []


class NgramDrafter(Stateless):
    name = "ngram"

    def __init__(self, config: NgramConfig) -> None:
        self.config = config

    def shape(self, gamma: int) -> DraftShape:
        return DraftShape(width=gamma, depth=gamma)

    def propose(self, batch, gamma: int, u: Tensor) -> Proposal:
        drafts, num = fused.run_compiled(draft_chains, batch.tokens, batch.length, gamma, self.config.max_ngram,
                                         self.config.min_ngram)
        return Proposal(tokens=drafts, num_drafted=num)


def draft_chains(tokens: Tensor, length: Tensor, gamma: int, max_ngram: int, min_ngram: int) -> tuple[Tensor, Tensor]:
    """(drafts [B, gamma], num_drafted [B]): each row's continuation, gamma tokens where an n-gram matched, else none."""
    drafts, found = find_continuations(tokens, length, gamma, max_ngram, min_ngram)
    return drafts, torch.where(found, gamma, 0)


def ngram_config(options: DrafterOptions) -> NgramConfig:
    """The n-gram sizes a prompt lookup matches (ngram's, suffix's fallback, eagle's --tree-lookup)."""
    return NgramConfig(max_ngram=options.ngram_max, min_ngram=options.ngram_min)


@register("ngram")
def build(target, options: DrafterOptions) -> NgramDrafter:
    return NgramDrafter(ngram_config(options))

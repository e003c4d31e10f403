"""`ngram`: prompt lookup decoding (Saxena 2023). Match the sequence's last n tokens (n from max_ngram
down to min_ngram) against earlier text (prompt and output), most recent match first, and propose
the tokens that followed it; a match near the end is copied on past the end, so a repeating pattern
is proposed for the full gamma. Deterministic (q is one-hot), costs microseconds, runs on the host.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specdec.config import NgramConfig
from specdec.drafters.base import DecodeState, DrafterOptions, Proposal, register
from specdec.verify import VerifyResult


def find_continuation(seq: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = sliding_window_view(seq[: L - 1], n)  # [L-n, n]: every n-gram that ends before the last token
        hits = np.flatnonzero((windows == seq[L - n :]).all(axis=1))
        if hits.size:
            return copy_forward(seq, hits[-1] + n, k)
    return seq[:0]


def copy_forward(seq: np.ndarray, start: int, k: int) -> np.ndarray:
    """k tokens from seq[start:]; past the end the copy continues from its own output (a repeating
    pattern keeps repeating: with seq = a b a b and start = 2 it gives a b a b ...)."""
    out = list(seq[start : start + k])
    while len(out) < k:
        out.append(out[len(out) - (len(seq) - start)] if len(seq) > start else seq[-1])
    return np.asarray(out[:k], dtype=seq.dtype)


class NgramDrafter:
    name = "ngram"

    def __init__(self, config: NgramConfig) -> None:
        self.config = config

    def max_tokens(self, gamma: int) -> int:
        return gamma

    def prefill(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState, k: int) -> Proposal:
        tokens = np.zeros((state.batch_size, k), dtype=np.int64)  # [B, k]
        num_drafted = np.zeros(state.batch_size, dtype=np.int64)  # [B]
        for b, row in enumerate(state.tokens):
            if state.active[b]:
                found = find_continuation(np.asarray(row), k, self.config.max_ngram, self.config.min_ngram)
                tokens[b, : len(found)] = found
                num_drafted[b] = len(found)
        return Proposal(
            tokens=torch.from_numpy(tokens).to(state.device), num_drafted=torch.from_numpy(num_drafted).to(state.device)
        )

    def commit(self, state: DecodeState, result: VerifyResult) -> None:
        pass


@register("ngram")
def build(target, options: DrafterOptions) -> NgramDrafter:
    return NgramDrafter(NgramConfig(max_ngram=options.ngram_max, min_ngram=options.ngram_min))

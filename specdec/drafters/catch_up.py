"""Lazy drafter state: a trained drafter is fed only when a row drafts, then catches up in one go.

EAGLE's head and a draft model keep a KV cache that follows the row's tokens. Fed eagerly, that costs
a forward at every step and over every prompt, even where the policy drafts nothing (gamma 0: a step
has no `propose`). On the CPU (`catches_up(batch)`: an eager stepper on the CPU) such a drafter defers
instead: `join` and `commit` only note what is left to feed (a
cache length that stays behind, and for EAGLE the target's features), and `propose`, which runs only
when the step drafts, first feeds every running row the positions it skipped (`feed_gaps`): the same
inputs at the same positions as if it had been fed all along, in fewer and wider forwards. The exact
kernels give each entry the bits of any block it is computed in, so the drafts are those of eager
feeding (tests/test_lazy_drafters.py).

A captured step has fixed shapes, and a gap's width is data: on a graphed stepper (batch.static) each
drafter keeps its eager-every-step behaviour (see its module docstring). So does an eager stepper on a
GPU (an observed run: `specdec analyze`, the server's row-by-row retry), so that it drafts what the
graphed steps draft: there a wider block's head forward need not give each entry the bits of a narrower
one (on an H200 the caught-up EAGLE drafts differed from eagerly fed ones in one token of a near-tie).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from specdec.kv_cache import KVCache
from specdec.transfer import to_device

# The widest gap fed to every slot in one forward, padded to the widest row's gap: a drafting step's
# (EAGLE: the accepted drafts and one more; a draft model: one or two tokens), or a few gamma-0 steps.
# A row further behind (a prompt just read, or a long stretch at gamma 0) is fed alone, over a one-row
# view of the cache, so it costs its own tokens only and never pads the others. A cache that catches up
# holds SHORT_GAP spare slots past max_len for the padding of rows that are not behind.
SHORT_GAP = 8

# feed(cache, rows, positions [n, w], last [n]) -> [n, X]: run the drafter over rows `rows` (a slice of
# the batch; `cache` is theirs) at `positions`, writing its cache, and return its output at each row's
# entry `last` (the last one it really feeds).
Feed = Callable[[KVCache, slice, Tensor, Tensor], Tensor]


def catches_up(batch) -> bool:
    """Whether this batch's drafter state is lazy: its steps run eagerly on the CPU."""
    return not batch.static and batch.device.type == "cpu"


def feed_gaps(cache: KVCache, gap: Tensor, feed: Feed) -> Tensor | None:
    """Feed each row b the gap[b] [B] entries after its cache length (rows with gap 0 keep their cache as
    it is): a row more than SHORT_GAP behind in a forward of its own, then every other row in one forward
    padded to the widest remaining gap (entries past a row's gap are scratch, past its new length).
    Returns [B, X], each fed row's output at its last entry (zeros for rows fed nothing); None when no
    row was fed."""
    gaps = gap.tolist()
    out: Tensor | None = None
    for b, g in enumerate(gaps):
        if g > SHORT_GAP:
            row = row_of(cache, b)
            positions = row.lengths[:, None] + torch.arange(g, device=gap.device)  # [1, g]
            last = feed(row, slice(b, b + 1), positions, positions.new_tensor([g - 1]))  # [1, X]
            out = last.new_zeros(len(gaps), last.shape[-1]) if out is None else out
            out[b] = last[0]
            gaps[b] = 0
    width = max(gaps)
    if width:
        short = to_device(gaps, gap.device)  # [B]
        start = cache.lengths.clone()  # [B]
        positions = start[:, None] + torch.arange(width, device=gap.device)  # [B, w]
        last = feed(cache, slice(None), positions, (short - 1).clamp(min=0))  # [B, X]
        cache.lengths.copy_(start + short)
        out = torch.where((short > 0)[:, None], last, 0 if out is None else out)
    return out


def row_of(cache: KVCache, b: int) -> KVCache:
    """Row b as a cache of its own (views: writes land in `cache`)."""
    view = KVCache.__new__(KVCache)
    view.k, view.v, view.lengths = cache.k[:, b : b + 1], cache.v[:, b : b + 1], cache.lengths[b : b + 1]
    view.max_len, view.static = cache.max_len, cache.static
    return view

"""Lazy drafter state: a trained drafter is fed only when a row drafts, then catches up in one go.

EAGLE's head and a draft model keep a KV cache that follows the row's tokens. Fed eagerly, that costs
a forward at every step and over every prompt, even where the policy drafts nothing (gamma 0: a step
has no `propose`). Such a drafter defers instead: `commit` only notes what is left to feed (a cache
length that stays behind, and for EAGLE the target's features), and `propose`, which runs only when
the step drafts, first feeds every running row the positions it skipped: the same inputs at the same
positions as if it had been fed all along, in fewer and wider forwards. Two ways, by stepper:

- in gaps (`catches_up(batch)`: an eager stepper on the CPU; EAGLE and the draft model): each row
  exactly its gap (`feed_gaps`), a row far behind in a forward of its own. `join` feeds nothing: the
  prompt is a row's first gap. The exact kernels give each entry the bits of any block it is computed
  in, so the drafts are those of eager feeding (tests/test_lazy_drafters.py).
- in chunks (every other stepper: graphed ones, whose captured shapes are fixed while a gap's width is
  data, and eager ones on a GPU, so that they draft what graphed steps draft): one forward of a
  fixed `Lag.width` positions per row feeds each row up to that many (`feed_chunk`), and the host,
  which knows from the steps it launched how far behind a row can be (`Lag`), runs as many chunks
  before a drafting step's propose as the propose's own one does not cover (Stepper.launch). `join`
  feeds the prompt, a block of its own (captured with the prefill: step.JoinGraph). Chunks and gaps
  need not give the same bits on a GPU (a wider block's forward there need not give each entry a
  narrower one's bits): drafts may differ in a near-tie, verification keeps the output lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """Whether this batch's drafter state catches up in gaps (`feed_gaps`): its steps run eagerly on the CPU."""
    return not batch.static and batch.device.type == "cpu"


def chunk_width(depth: int) -> int:
    """Positions a chunk feeds per row (Lag.width) for drafts up to `depth` deep: at least what a drafting
    step keeps (depth + 1), so that consecutive drafting steps need no chunk beyond the propose's own, and
    SHORT_GAP, so that a few gamma-0 steps between them need none either."""
    return max(SHORT_GAP, depth + 1)


@dataclass
class Lag:
    """The host's bound on how far a chunked drafter state lags (module docstring): at most `most` positions
    behind in any row, known from the steps launched, without reading the device. One per batch, shared by
    its views (`head`: RowBatch.head)."""

    width: int  # positions per row one chunk feeds (chunk_width); a drafting step's propose runs one first
    most: int = 0
    behind: int | None = None  # how far a row can lag right after a drafting step, where that does not grow
    # with the draft's depth (a draft model, fed its drafts: 2); None: depth + 1, all that a step keeps

    def head(self, n: int) -> "Lag":
        return self

    def chunks_before(self) -> int:
        """Chunks to feed before a drafting step's propose, whose own chunk feeds the rest."""
        return max(0, -(-self.most // self.width) - 1)

    def stepped(self, depth: int) -> None:
        """A step was launched at draft depth `depth` (0: a plain step). A drafting step caught every row up
        first and keeps at most depth + 1 tokens a row (`behind`: of which the drafter was fed all but
        that many); a plain step keeps at most one."""
        self.most = (self.behind or depth + 1) if depth else self.most + 1


def lag_of(batch) -> Lag | None:
    """The batch's drafter's Lag, if its state catches up in chunks."""
    return getattr(batch.draft, "lag", None)


def defers(batch) -> bool:
    """Whether the batch's drafter is fed only when rows draft, in gaps or in chunks."""
    return catches_up(batch) or lag_of(batch) is not None


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
        last = feed_chunk(cache, short, feed, width)  # [B, X]
        out = last if out is None else torch.where((short > 0)[:, None], last, out)
    return out


def feed_chunk(cache: KVCache, gap: Tensor, feed: Feed, width: int) -> Tensor:
    """Feed each row b min(gap[b], width) entries after its cache length, in one forward of `width` entries
    a row (past a row's share, scratch past its new length: the cache holds `width` spare slots). Graph-safe.
    Returns [B, X], each fed row's output at its last entry fed (zeros for rows fed nothing)."""
    short = gap.clamp(max=width)  # [B]
    start = cache.lengths.clone()  # [B]
    positions = start[:, None] + torch.arange(width, device=gap.device)  # [B, w]
    last = feed(cache, slice(None), positions, (short - 1).clamp(min=0))  # [B, X]
    cache.lengths.copy_(start + short)
    return torch.where((short > 0)[:, None], last, 0)


def row_of(cache: KVCache, b: int) -> KVCache:
    """Row b as a cache of its own (views: writes land in `cache`)."""
    return KVCache.over(cache.k[:, b : b + 1], cache.v[:, b : b + 1], cache.lengths[b : b + 1], cache.max_len, cache.static)

"""Measured costs: the timings the engine, the gamma policies, the server and the bench all use.

- `Stopwatch` times regions of device work: CUDA events on a GPU (read later, without stalling the
  stream), a host clock after the work on a CPU (where work is synchronous anyway);
- `measure_forward_times` gives t(k), the median seconds of one target forward over k new tokens
  at a fixed context; the verify ratio is r(k) = t(k) / t(1);
- the cost coefficient c is draft seconds per drafted token in units of t(1);
- `weight_bytes_per_forward` and `copy_bandwidth` give the memory-bandwidth floor of a decode step.

The speedup formulas built on these live in analysis/speedup.py (upper layer); this module imports
only torch and the models' graphs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Stopwatch:
    """Marks between pieces of device work; `seconds(a, b)` is the time from mark a to mark b.

    On CUDA a mark records an event on the current stream (no host stall); reading a duration
    synchronises only on the later event, so read durations of a step once its results are
    being read anyway. On a CPU a mark reads the host clock (CPU work has already finished)."""

    device: torch.device
    marks: dict[str, object] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            event = self.marks.get(name)
            if not isinstance(event, torch.cuda.Event):
                event = self.marks[name] = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        a, b = self.marks[start], self.marks[end]
        if isinstance(b, torch.cuda.Event):
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def interpolate(points: dict[int, float], k: float) -> float:
    """f(k) for fractional k, linear between measured points (clamped to the measured range)."""
    ks = sorted(points)
    if k <= ks[0]:
        return points[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if k <= hi:
            w = (k - lo) / (hi - lo)
            return points[lo] * (1 - w) + points[hi] * w
    return points[ks[-1]]


def measure_forward_times(target, context: list[int], ks: list[int], repeats: int = 7, graphs: bool = False) -> dict[int, float]:
    """Median seconds of one target forward over k new tokens after `context`, for each k.

    The ks are interleaved within each repeat so that drift hits them alike. graphs: time CUDA-graph
    replays (as the GPU step runs them, see specdec/graphs.py) instead of eager forwards."""
    from specdec.graphs import GraphedModel, bucket

    device = next(target.parameters()).device
    if graphs:
        cache = target.new_cache(1, bucket(len(context) + max(ks) + 1), static=True)
        target = GraphedModel(target, cache)
    else:
        cache = target.new_cache(1, len(context) + max(ks) + 1)
    ids = torch.tensor([context], device=device)
    target(ids, torch.arange(len(context), device=device)[None], cache)
    start = torch.tensor([len(context)], device=device)
    repeats_needed = -(-max(ks) // len(context))
    block = torch.tensor([(context * repeats_needed)[: max(ks)]], device=device)  # real tokens: representative work
    samples: dict[int, list[float]] = {k: [] for k in ks}
    watch = Stopwatch(device)
    for rep in range(repeats + 1):
        for k in ks:
            cache.trim(start)
            positions = start[:, None] + torch.arange(k, device=device)
            watch.mark("start")
            target(block[:, :k], positions, cache)
            watch.mark("end")
            if rep > 0:  # the first round warms up
                samples[k].append(watch.seconds("start", "end"))
    return {k: statistics.median(v) for k, v in samples.items()}


def verify_ratios(times: dict[int, float]) -> dict[int, float]:
    return {k: t / times[1] for k, t in times.items()}


def cost_coefficient(draft_s: float, steps: int, gamma: float, t1: float) -> float | None:
    """Draft seconds per drafted-token slot, in units of one target decode step."""
    if steps == 0 or gamma == 0 or t1 <= 0:
        return None
    return draft_s / steps / gamma / t1


def weight_bytes_per_forward(model) -> int:
    """Bytes of weights one decode forward reads: every parameter and quantised panel once (a tied LM
    head counted once), except an untied float embedding table, of which a forward reads only the rows
    of its tokens."""
    from specdec.models.cpu_quant import packed_bytes

    params = {id(p): p for p in model.parameters()}
    embed = getattr(model, "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    if isinstance(embed, torch.nn.Embedding) and lm_head is not None and embed.weight is not lm_head.weight:
        params.pop(id(embed.weight), None)
    return sum(p.numel() * p.element_size() for p in params.values()) + packed_bytes(model)


def copy_bandwidth(device: torch.device, gigabytes: float = 1.0, repeats: int = 10) -> float:
    """Bytes per second one device-to-device copy moves, reads and writes counted (so the read
    bandwidth of a weight-streaming forward is about this figure)."""
    n = int(gigabytes * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    t = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    return 2 * src.numel() * 4 * repeats / (time.perf_counter() - t)

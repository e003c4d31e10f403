"""Speedup arithmetic and the timings it needs.

- verify ratio r(k) = time of a target forward over k new tokens / time over 1 token, measured at a
  fixed context length;
- cost coefficient c = time of one draft step / time of one target decode step (a "draft step" is
  one drafted token: c = draft seconds per step / gamma / t(1));
- estimated speedup of a chain with i.i.d. acceptance alpha (Leviathan et al. 2023, r made explicit):
      (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + r(gamma+1)))
- a second estimate from the measured mean accepted length tau, draft time and tokens verified per
  step, which drops the i.i.d. assumption (prompt lookup drafts in bursts, and drafts nothing when no
  n-gram matches; trees verify many nodes): tau / (draft time per step / t(1) + r(verified + 1)),
  r interpolated.
Both are labelled "estimated" wherever they are shown.
"""

from __future__ import annotations

import statistics
import time

import torch


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[emitted tokens per step] = (1 - alpha^(gamma+1)) / (1 - alpha) for i.i.d. acceptance."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def estimated_speedup(alpha: float, gamma: int, c: float, r_next: float) -> float:
    """The chain formula; r_next = r(gamma + 1)."""
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + r_next)


def estimated_speedup_from_tau(tau: float, draft_cost: float, verified_per_step: float, ratios: dict[int, float]) -> float:
    """tau / (cost of the average step in plain target steps): draft_cost = draft time per step / t(1);
    the verify forward covers the pending token and verified_per_step drafts (tree nodes for a tree)."""
    return tau / (draft_cost + interpolate(ratios, verified_per_step + 1))


def interpolate(ratios: dict[int, float], k: float) -> float:
    """r(k) for fractional k, linear between measured points (clamped to the measured range)."""
    ks = sorted(ratios)
    if k <= ks[0]:
        return ratios[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if k <= hi:
            w = (k - lo) / (hi - lo)
            return ratios[lo] * (1 - w) + ratios[hi] * w
    return ratios[ks[-1]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_forward_times(target, context: list[int], ks: list[int], repeats: int = 7, graphs: bool = False) -> dict[int, float]:
    """Median seconds of one target forward over k new tokens after `context`, for each k.

    The ks are interleaved within each repeat so that drift hits them alike. graphs: time the CUDA-graph
    replays the engine uses on a GPU (see specdec/graphs.py) instead of eager forwards."""
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
    for rep in range(repeats + 1):
        for k in ks:
            cache.trim(start)
            positions = start[:, None] + torch.arange(k, device=device)
            synchronize(device)
            t = time.perf_counter()
            target(block[:, :k], positions, cache)
            synchronize(device)
            if rep > 0:  # the first round warms up
                samples[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in samples.items()}


def verify_ratios(times: dict[int, float]) -> dict[int, float]:
    return {k: t / times[1] for k, t in times.items()}


def cost_coefficient(draft_s: float, steps: int, gamma: float, t1: float) -> float | None:
    """Draft seconds per drafted-token slot, in units of one target decode step."""
    if steps == 0 or gamma == 0 or t1 <= 0:
        return None
    return draft_s / steps / gamma / t1


def weight_bytes_per_forward(model) -> int:
    """Bytes of weights one decode forward reads: every parameter once (a tied LM head counted once),
    except an untied embedding table, of which a forward reads only the rows of its tokens."""
    params = {id(p): p for p in model.parameters()}
    embed = getattr(model, "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    if embed is not None and lm_head is not None and embed.weight is not lm_head.weight:
        params.pop(id(embed.weight), None)
    return sum(p.numel() * p.element_size() for p in params.values())


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

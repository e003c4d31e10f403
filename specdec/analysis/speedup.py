"""Speedup arithmetic (the timings it needs are measured by specdec/costs.py).

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

from specdec.costs import interpolate


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



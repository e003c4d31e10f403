"""Load-aware speculation: how many draft tokens the running batch verifies in the next step.

Speculation spends spare compute on one user's latency. At batch size 1 a decode forward is bound by
reading the weights, so verifying k tokens costs little more than one; as the batch fills the forward
becomes compute-bound and every rejected draft token is work taken from other requests. Policies:

- `off`: gamma 0 (plain decoding of the batch);
- `on`: the configured gamma at every batch size;
- `batch-threshold`: gamma while at most `threshold` requests run, 0 above (vLLM's
  `speculative_disable_by_batch_size`);
- `cost`: each step, the gamma in 0..gamma_max that maximises expected tokens per second of the batch,
      sum_b E_b(g) / S(B, g),
  where E_b(g) = 1 + sum_{i<=g} prod_{j<=i} alpha_bj is row b's expected emitted tokens (adaptive.py)
  and S(B, g) the seconds of a whole step over B slots (the scheduler's bucket: a captured step
  computes every slot of it) drafting g tokens each. S is measured: the median of the last steps of
  that shape, once there are STEP_SAMPLES of them. Until then it is predicted
  from the forward times measured at start, T(B, w(g) + 1) (interpolated between measured batch sizes
  and k; w(g) the draft tokens a row verifies: g for a chain, a tree's nodes down to depth g), plus
  B * d for g > 0 (d: measured draft seconds per row-step), scaled by how much the
  steps measured so far at this batch size exceeded their prediction (host work, bookkeeping).
  alpha_bj blends the row's own acceptance with a server-wide running estimate. Gamma 0 wins when
  speculation no longer pays. A position the drafter left empty (no n-gram match) counts as rejected,
  so E_b reflects what the drafter really delivers. At gamma 0 the gammas are priced again only when the
  rows' counts change or every REPRICE_EVERY steps (pricing is most of the policy's host work per step).

  It explores: after EXPLORE_EVERY steps in a row at one gamma, STEP_SAMPLES steps run at the best other
  gamma, whose earlier measurements they replace, so estimates that a prediction, a slow first step
  (graph capture), a cold start or a passing stall made too pessimistic are measured again instead of
  locking the server at gamma 0, or at a gamma below the best (a measured shape is otherwise only
  measured again when chosen, and a predicted one never if its prediction loses). Each exploration
  that leaves the choice where it was doubles the wait before the next (up to EXPLORE_MOST steps), so
  where drafting never pays (a full batch on a CPU) exploring costs next to nothing; a change of
  choice on its own resets the wait. Choices, runs and waits are kept per bucket (`Exploration`): a
  batch that drains between bursts steps through the small buckets, where drafting pays, and with one
  shared record each such pass restarted the full bucket's wait (docs/design.md, "Pricing a step"). It
  never explores a drafting shape whose verify forward or measured steps cost g + 1 plain ones or more
  (`could_pay`): not even perfect acceptance would pay there; nor one that loses to the choice on the
  forward times measured at start and the rows' acceptance (`worth_exploring`): exploring re-measures
  steps, not acceptance, so a shape that loses even without host work and drafting costs (4 rows of
  ngram on a 2-core CPU: a gamma-2 step verifies 3 tokens a row at 2.1 plain forwards, for about 1.1
  tokens a row) only costs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from specdec.adaptive import (EXPLORE_EVERY, EXPLORE_MOST, REPRICE_EVERY, STEP_SAMPLES, Acceptance, StepSeconds, batch_expected_tokens,
                              blended_rates, forward_sizes)
from specdec.costs import interpolate, synchronize
from specdec.errors import UserError

SPEC_POLICIES = ("off", "on", "batch-threshold", "cost")
MEASURED_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# `cost` leaves its choice only for a gamma estimated this much faster. A shape's step time is the median
# of its last 5-20 steps, and a level's steps vary by 10 % or more, so without a margin one probe's lucky
# median can move the choice to a gamma no better, where it stays until that gamma's own steps say so.
# Such moves would explain steps seen at a losing gamma beyond what probes run (3 probes of 5 steps a
# level): an H200 at 64 clients ran 41-54 of ~354 steps at gamma 0 where gamma 4 gave 1.1-1.3x plain, a
# 2-core CPU with EAGLE at 16 clients 56 of 488 at gamma 1 (counts of steps, not traced choices).
# Between gammas within the margin, staying costs at most the margin, as estimated. Plain decoding (gamma
# 0) is taken back without a margin: drafting has to keep paying. With the margin both ways, a 2-core CPU
# with EAGLE at 16 clients stayed at gamma 1, 3.5 % slower there than gamma 0 (step medians 130.9 and
# 74.3 ms at acceptance 0.70), for 178-335 of ~570-680 steps a level once noise had moved it there.
SWITCH_MARGIN = 0.05


@dataclass
class BatchCosts:
    """Seconds of one target forward over k new tokens per row at batch size B (measured grid)."""

    seconds: dict[int, dict[int, float]]  # B -> k -> seconds
    known: dict[tuple[int, int], float] = field(default_factory=dict, repr=False, compare=False)  # forward_s's answers

    def forward_s(self, batch: int, k: int) -> float:
        """Interpolated between the measured sizes (asked for every gamma at every step: remembered)."""
        if (batch, k) not in self.known:
            self.known[batch, k] = self.interpolate(batch, k)
        return self.known[batch, k]

    def interpolate(self, batch: int, k: int) -> float:
        sizes = sorted(self.seconds)
        if batch <= sizes[0]:
            return interpolate(self.seconds[sizes[0]], k)
        for lo, hi in zip(sizes, sizes[1:]):
            if batch <= hi:
                w = (batch - lo) / (hi - lo)
                return interpolate(self.seconds[lo], k) * (1 - w) + interpolate(self.seconds[hi], k) * w
        top = sizes[-1]  # beyond the grid: time grows with the rows
        return interpolate(self.seconds[top], k) * batch / top

    def to_dict(self) -> dict:
        return {str(b): {str(k): t for k, t in ks.items()} for b, ks in self.seconds.items()}


def measure_batch_costs(target, batch_sizes: list[int], ks: list[int], context: int = 128, repeats: int = 3) -> BatchCosts:
    """Median forward seconds over k tokens per row after a `context`-token prefix, per batch size.
    The prefix is prefilled once and copied to every row; ks interleave within each repeat."""
    device = next(target.parameters()).device
    vocab = target.config.vocab_size
    prefix = (torch.arange(context, device=device) * 7919 + 11) % vocab  # [S] arbitrary real token ids
    one = target.new_cache(1, context + max(ks) + 1)
    target(prefix[None], torch.arange(context, device=device)[None], one)
    seconds: dict[int, dict[int, float]] = {}
    for B in batch_sizes:
        cache = target.new_cache(B, context + max(ks) + 1)
        cache.k[:, :, :, :context] = one.k[:, :1, :, :context]
        cache.v[:, :, :, :context] = one.v[:, :1, :, :context]
        start = torch.full((B,), context, device=device)
        samples: dict[int, list[float]] = {k: [] for k in ks}
        for rep in range(repeats + 1):
            for k in ks:
                cache.lengths.copy_(start)
                block = prefix[:k].expand(B, k)  # [B, k]
                synchronize(device)
                t = time.perf_counter()
                target(block, start[:, None] + torch.arange(k, device=device), cache)
                synchronize(device)
                if rep > 0:  # the first round warms up
                    samples[k].append(time.perf_counter() - t)
        seconds[B] = {k: statistics.median(v) for k, v in samples.items()}
    return BatchCosts(seconds)


def cost_grid(max_batch: int, widths: dict[int, int]) -> tuple[list[int], list[int]]:
    """(batch sizes, tokens per row) to measure: powers of two up to max_batch, k from 1 to the widest
    step's tokens (widths: gamma -> draft tokens verified per row)."""
    sizes = sorted({b for b in MEASURED_BATCH_SIZES if b <= max_batch} | {max_batch})
    return sizes, forward_sizes(widths)


@dataclass
class Exploration:
    """`cost`'s choices at one bucket of slots: the last one (explorations aside), how many steps in a row
    made it, how many more before the next exploration, and that exploration's gamma and steps left."""

    chosen: int = 0
    same_steps: int = 0
    explore_after: int = EXPLORE_EVERY
    probe_gamma: int = 0
    probe_left: int = 0
    priced: Acceptance | None = None  # the rows' counts when the gammas were last priced at gamma 0
    unpriced: int = 0  # steps at gamma 0 since then
    left: tuple[int, int] | None = None  # (choice, its wait) that the last switch left

    def switch(self, gamma: int) -> None:
        """Make gamma the choice. A switch back to the choice just left, within EXPLORE_EVERY steps, undoes
        a move that did not hold (a probe's lucky steps, or a joining row priced at the pooled estimate):
        that choice's wait is restored, so the move counts as an exploration that changed nothing, not a
        fresh start at EXPLORE_EVERY (ngram at 4 clients on a 2-core CPU switched to gamma 1 and back 16
        times in 1900 steps)."""
        undone = self.left is not None and self.left[0] == gamma and self.same_steps < EXPLORE_EVERY
        wait = self.left[1] if undone else EXPLORE_EVERY
        self.left = (self.chosen, self.explore_after)
        self.chosen, self.same_steps, self.explore_after = gamma, 1, wait

    def keeps_plain(self, rows: Acceptance) -> bool:
        """Whether gamma 0 stands without pricing the gammas again (REPRICE_EVERY); counts the step if so."""
        if self.chosen or self.priced is None or self.unpriced >= REPRICE_EVERY or not self.priced.same_counts(rows):
            self.priced, self.unpriced = rows, 0
            return False
        self.unpriced += 1
        return True


@dataclass
class SpecPolicy:
    name: str
    gamma: int  # drafts per step for `on` / `batch-threshold`; the most `cost` tries
    threshold: int = 4  # `batch-threshold`: speculate while running requests <= threshold
    costs: BatchCosts | None = None  # `cost`
    widths: dict[int, int] = field(default_factory=dict)  # gamma -> draft tokens a row verifies (default gamma)
    overall: Acceptance = field(init=False)  # the server-wide estimate (adaptive.blended_rates)
    draft_s_per_row: float = 0.0  # running mean of drafter seconds per row-step
    draft_samples: int = 0
    steps: StepSeconds = field(default_factory=StepSeconds)  # whole steps measured, by (B, g)
    explorations: dict[int, Exploration] = field(default_factory=dict)  # `cost`: per bucket of slots
    moved: str | None = None  # `cost`: what the last `choose` did beyond keeping its choice ("switch", "probe")

    def __post_init__(self) -> None:
        check_policy(self.name, self.gamma, self.threshold)
        if self.name == "cost" and self.costs is None:
            raise UserError("the cost policy needs measured forward times (BatchCosts)")
        self.overall = Acceptance.empty(1, self.gamma)

    def choose(self, rows: Acceptance, slots: int | None = None) -> int:
        """Gamma for the next step of a batch whose rows have these acceptance counts; `slots`: the rows
        the step computes (the scheduler's bucket, holding rows that left or opt out too; default: the
        rows). `cost` prices steps by it: a captured step of a bucket costs the same whoever is in it, so
        its few bucket sizes are measured sooner than every count of rows would be."""
        if self.name == "off":
            return 0
        if self.name == "on" or (self.name == "batch-threshold" and len(rows) <= self.threshold):
            return self.gamma
        if self.name == "batch-threshold":
            return 0
        B = slots or len(rows)
        state = self.explorations.setdefault(B, Exploration())
        self.moved = None
        if state.probe_left:  # an exploration's steps: measured afresh
            state.probe_left -= 1
            return state.probe_gamma
        priced = None if state.keeps_plain(rows) else self.price(rows, B)
        if priced is not None:
            rate = priced[1]
            best = max(rate, key=rate.get)
            margin = SWITCH_MARGIN if best else 0.0  # back to plain as soon as drafting stops paying
            if best != state.chosen and rate[best] > (1 + margin) * rate[state.chosen]:
                state.switch(best)
                self.moved = "switch"
                return best
        best = state.chosen
        state.same_steps += 1
        if state.same_steps < state.explore_after:
            return best
        state.same_steps, state.explore_after = 0, min(2 * state.explore_after, EXPLORE_MOST)
        alphas, rate = priced or self.price(rows, B)
        others = [g for g in range(self.gamma + 1)
                  if g != best and (g == 0 or self.could_pay(B, g) and self.worth_exploring(alphas, B, g, best))]
        if not others:
            return best
        explored = max(others, key=rate.get)
        self.steps.forget(B, explored, self.predicted_step_s)
        state.probe_gamma, state.probe_left = explored, STEP_SAMPLES - 1
        state.priced = None  # priced again once the probe has measured its steps
        self.moved = "probe"
        return explored

    def price(self, rows: Acceptance, B: int) -> tuple[np.ndarray, dict[int, float]]:
        """(alpha [rows, gamma], expected tokens per second of a step of B slots at each gamma 0..gamma)."""
        alphas = blended_rates(rows, self.overall)
        tokens = batch_expected_tokens(alphas, self.gamma)  # [g]: the batch's expected tokens at gamma g
        return alphas, {g: float(tokens[g]) / self.step_seconds(B, g) for g in range(self.gamma + 1)}

    def could_pay(self, B: int, g: int) -> bool:
        """Whether a step of B rows drafting g could beat a plain one were every draft accepted: not if its
        verify forward alone costs g + 1 plain forwards or more (compute-bound: a full batch on a CPU; the
        forward times are measured at start, which a cold start does not distort), nor if its measured
        steps cost g + 1 plain steps or more. Exploring such a shape only stalls every row."""
        if self.verify_forward_s(B, g) >= (g + 1) * self.verify_forward_s(B, 0):
            return False
        measured = self.steps.measured(B, g)
        return measured is None or measured < (g + 1) * self.step_seconds(B, 0)

    def worth_exploring(self, alphas: np.ndarray, B: int, g: int, best: int) -> bool:
        """Whether drafting g could beat `best` were steps to cost their verify forwards alone (as measured at
        start: no host work, no drafting), at the rows' acceptance estimates."""
        return self.tokens_per_s(alphas, g, B, self.verify_forward_s) > self.tokens_per_s(alphas, best, B, self.verify_forward_s)

    def gammas(self) -> list[int]:
        """Every gamma `choose` may return (a step whose rows all opted out runs at 0 too)."""
        if self.name == "off":
            return [0]
        return list(range(self.gamma + 1)) if self.name == "cost" else [0, self.gamma]

    def tokens_per_s(self, alphas: np.ndarray, g: int, B: int, seconds: Callable[[int, int], float] | None = None) -> float:
        """Expected tokens per second of a step of B slots whose drafting rows have these rates, priced by
        `seconds(B, g)` (default: step_seconds)."""
        return float(batch_expected_tokens(alphas, g)[g]) / (seconds or self.step_seconds)(B, g)

    def verify_forward_s(self, B: int, g: int) -> float:
        """T(B, w(g) + 1): the forward measured at start over the tokens a row verifies at gamma g."""
        return self.costs.forward_s(B, self.widths.get(g, g) + 1)

    def predicted_step_s(self, B: int, g: int) -> float:
        return self.verify_forward_s(B, g) + (B * self.draft_s_per_row if g else 0.0)

    def step_seconds(self, B: int, g: int) -> float:
        """S(B, g): measured where STEP_SAMPLES steps of this shape ran, else predicted (module docstring)."""
        return self.steps.seconds(B, g, self.predicted_step_s)

    def observe_step_time(self, B: int, g: int, seconds: float) -> None:
        """The wall time of a step of B slots (as `choose`'s) that drafted g tokens each (cost only: it
        needs predictions)."""
        if self.costs is None:
            return
        self.steps.observe(B, g, seconds, self.predicted_step_s)

    def observe_step(self, budgets: list[int], accepted: list[int], draft_s: float | None) -> None:
        """A step's acceptance, and its drafting time (None: not to be learnt from, StepReport.compiled)."""
        self.overall.pool(budgets, accepted)
        if any(budgets) and draft_s is not None:
            self.draft_samples += 1
            self.draft_s_per_row += (draft_s / len(budgets) - self.draft_s_per_row) / min(self.draft_samples, 100)

    def describe(self) -> dict:
        out = {"policy": self.name, "gamma": self.gamma, "threshold": self.threshold}
        if self.costs is not None:
            out["forward_seconds"] = self.costs.to_dict()
        return out


def check_policy(name: str, gamma: int, threshold: int) -> None:
    if name not in SPEC_POLICIES:
        raise UserError(f"unknown speculation policy {name!r}; choose from {', '.join(SPEC_POLICIES)}")
    if gamma < 1:
        raise UserError(f"gamma must be >= 1, got {gamma}")
    if threshold < 0:
        raise UserError(f"the batch threshold must be >= 0, got {threshold}")

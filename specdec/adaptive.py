"""Adaptive draft length (`--gamma auto`): how many tokens each row drafts in the next step.

Policies (per row of a batch):
- `heuristic`: +2 after a fully accepted step, -1 otherwise (what transformers does);
- `confidence`: draft up to gamma_max, but a drafter with probabilities stops a row at the first
  draft token whose top-1 draft probability is below the threshold (ngram has none: it drafts what
  it matched);
- `cost`: choose gamma to maximise expected tokens per unit time, E(gamma) / cost(gamma), with
  E(gamma) = 1 + sum_{i<=gamma} prod_{j<=i} alpha_j from a running per-position acceptance
  estimate (conditional: alpha_j = P(draft j accepted | drafts before it were); the row's own steps
  blended with the engine's recent ones, `blended_rates`, shared with the server's policy), and
  cost(gamma) = gamma * c + r(w(gamma) + 1) from the measured verify ratio r, draft cost c per level
  and w(gamma) the draft tokens verified per row (gamma for a chain; a tree's nodes down to depth
  gamma, which a compute-bound target pays for one by one), until the engine has measured whole
  steps of that gamma (StepSeconds, shared with the server's policy): a tree's verification on a CPU
  costs more than its forward, and predicting from forwards alone kept Medusa drafting out of domain.
  The engine's `cost` probes depth now and then (CostModel.probe): a few steps at gamma_max, so that
  depths it stopped drafting are counted again; and a row it has kept at gamma 0 drafts once now and
  then (`retry`), priced afresh from that step, so that a row whose first drafts failed is not kept
  plain for the rest of its request.
A fixed gamma is the `fixed` policy.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specdec.costs import interpolate
from specdec.errors import UserError

POLICIES = ("fixed", "heuristic", "confidence", "cost")
STEP_SAMPLES = 5  # steps of one shape before its measured time replaces the prediction
# Exploration, in both cost policies: a choice left alone for EXPLORE_EVERY steps is questioned (the server
# probes another gamma; the engine drops the measurements of a shape it has not run since, so its
# prediction prices it again), and each time that changes nothing the wait doubles, up to EXPLORE_MOST.
EXPLORE_EVERY = 64
EXPLORE_MOST = 1024


PRIOR_WEIGHT = 4.0  # pseudo-observations of the pooled rate in a row's estimate (blended_rates)
POOL_DECAY = 0.98  # per step: a pooled estimate follows the recent traffic
FRESH_RATE, FRESH_WEIGHT = 0.5, 2.0  # a pooled estimate's own prior: before, and long after, any draft
REACHED = 1.0  # decayed drafts that make a position one the pooled estimate has seen (pooled_prior)
DRAFT_SAMPLES = 64  # drafting steps whose median seconds per draft token is the engine's c
# At gamma 0 the cost policies price the gammas again only every REPRICE_EVERY steps (the server's sooner when
# its rows' counts change): pricing is most of a policy's host work per step (the engine's 25 of 32 us a
# step on a 2-core CPU, the server's about 0.1 ms of a 15 ms plain step there, which left `cost` 1 % behind
# `off` where both run plain steps only), while between plain steps only the pooled estimate's decay and
# the step medians move, slowly.
REPRICE_EVERY = 8
# A row the engine's `cost` keeps at gamma 0 gets no new counts, and its first drafts' failures price it plain
# for the rest of its request: on an H200 (bf16, out of domain) six of eight translation prompts drafted 2-8
# steps at their start, kept nothing, and ran plain for 120 steps at 0.96-0.99x, where gamma 4 gave 1.04-1.87x
# (tau 1.84-3.34): the opening of a translation is hard to guess, the rest is not. So after a run of plain
# steps it drafts once at RETRY_GAMMA, its earlier counts dropped (`retry`). The run is long enough that failed
# retries cost at most RETRY_SHARE of its plain steps (a retry's extra cost over a plain step, over that share),
# and at least RETRY_MIN_WAIT steps; it doubles after each retry, until the row chooses to draft again. At 2 %
# `layer_skip` on the 2-core CPU (a retry: about 1.9 plain steps more than a plain one) retried once in each
# 128-token request out of domain (0.04 tokens drafted a step against 0.02); at 1 % it waits about 190 steps.
RETRY_GAMMA = 2
RETRY_SHARE = 0.01
RETRY_MIN_WAIT = 16


@dataclass
class Acceptance:
    """Per-position conditional acceptance counts of some rows (the server scheduler's: one per slot; the
    engine's: one per row of a call; a pooled estimate: one): offered[r, j] = steps where row r's draft
    slot j was reached (every earlier draft accepted), accepted[r, j] = those where draft j was accepted
    too. Arrays, so that pricing a batch and counting its step cost tens of microseconds at 64 rows (a
    Python object a row took 0.4 ms a step on a 2-core CPU: `choose`, and counting the rows and the
    server-wide estimate)."""

    offered: np.ndarray  # [rows, positions]
    accepted: np.ndarray  # [rows, positions]

    @classmethod
    def empty(cls, rows: int, positions: int) -> "Acceptance":
        return cls(np.zeros((rows, positions)), np.zeros((rows, positions)))

    def __len__(self) -> int:
        return len(self.offered)

    def take(self, rows: list[int]) -> "Acceptance":
        """A copy of these rows' counts."""
        return Acceptance(self.offered[rows], self.accepted[rows])

    def clear(self, row: int) -> None:
        self.offered[row] = 0.0
        self.accepted[row] = 0.0

    def observe(self, rows: list[int], budgets: list[int], num_accepted: list[int]) -> None:
        """A step that allowed row rows[i] (distinct rows) budgets[i] drafts, of which it kept num_accepted[i]."""
        if not any(budgets):  # a plain step: nothing to count (the policy's host work runs every step)
            return
        reached, kept = draft_outcomes(self.offered.shape[1], budgets, num_accepted)
        self.offered[rows] += reached
        self.accepted[rows] += kept

    def pool(self, budgets: list[int], num_accepted: list[int]) -> None:
        """A pooled estimate's step (one row: every row of the step counted into it), after its earlier
        counts decayed by POOL_DECAY, so that it follows the recent traffic."""
        self.offered *= POOL_DECAY
        self.accepted *= POOL_DECAY
        if not any(budgets):
            return
        reached, kept = draft_outcomes(self.offered.shape[1], budgets, num_accepted)
        self.offered[0] += reached.sum(axis=0)
        self.accepted[0] += kept.sum(axis=0)

    def same_counts(self, other: "Acceptance") -> bool:
        return np.array_equal(self.offered, other.offered) and np.array_equal(self.accepted, other.accepted)

    def widened(self, positions: int) -> "Acceptance":
        """These counts with at least `positions` positions (the new ones never observed); itself if it has
        them (np.pad took most of the server's `choose`, which asks at every step)."""
        extra = positions - self.offered.shape[1]
        if extra <= 0:
            return self
        zeros = np.zeros((len(self.offered), extra))
        return Acceptance(np.hstack((self.offered, zeros)), np.hstack((self.accepted, zeros)))

    def rates(self, prior: np.ndarray, weight: float) -> np.ndarray:
        """alpha [rows, positions]: these counts with `weight` pseudo-observations at the prior's rates [positions]."""
        return (self.accepted + weight * prior) / (self.offered + weight)


def draft_outcomes(positions: int, budgets: list[int], num_accepted: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """[rows, positions] each: whether a row's draft slot j was reached (within its budget, every earlier
    draft accepted; a slot within the budget that the drafter left empty counts as a rejection) and
    whether it was accepted too."""
    j = np.arange(positions)
    kept = np.asarray(num_accepted)[:, None]  # [rows, 1]
    reached = j < np.minimum(np.asarray(budgets)[:, None], kept + 1)
    return reached, reached & (j < kept)


def pooled_prior(pooled: Acceptance, positions: int) -> np.ndarray:
    """The pooled rate at each of `positions` [positions]: recent steps' counts with FRESH_WEIGHT
    pseudo-observations at FRESH_RATE, except past the deepest position recent steps reached (at least
    REACHED drafts, decayed), where the pseudo-observations are at that position's rate when it beat
    FRESH_RATE. A depth no recent step drafted is expected to keep up with the deepest one drafted: drafts
    that got that far tend to go on (a copied span, an easy stretch), and at FRESH_RATE for every depth
    not drafted yet, a policy whose shallow drafts do not pay for a step's fixed drafting cost never
    finds that deep ones do. On an H200 (bf16, 64 mixed and held-out prompts, 3 passes) the engine's
    `cost` with `suffix` stopped drafting after 18 prompts and ran at 1.00x plain; priced so, it ran at
    1.50x, as gamma 4 did; every other drafter within 0.01x (docs/design.md, "Pricing a step"). Below
    FRESH_RATE the deepest rate is not extrapolated: a drafter out of its domain keeps FRESH_RATE's
    chance to try a depth again."""
    counts = pooled.widened(positions)
    width = counts.offered.shape[1]
    fresh = np.full(width, FRESH_RATE)
    rates = counts.rates(fresh, FRESH_WEIGHT)[0]  # [width]
    reached = np.flatnonzero(counts.offered[0] >= REACHED)
    if len(reached) and reached[-1] + 1 < width and rates[reached[-1]] > FRESH_RATE:
        fresh[reached[-1] + 1 :] = rates[reached[-1]]
        rates = counts.rates(fresh, FRESH_WEIGHT)[0]
    return rates[:positions]


def blended_rates(rows: Acceptance, pooled: Acceptance) -> np.ndarray:
    """alpha [rows, positions] of the cost policies (the engine's and the server's): each row's own counts
    with PRIOR_WEIGHT pseudo-observations at the pooled rate of recent steps of every row (pooled_prior),
    itself FRESH_WEIGHT pseudo-observations at FRESH_RATE, or past the deepest position recent steps
    drafted at that position's rate where it is higher. A new request starts from what recent requests
    accepted, and a pooled estimate that no draft has fed for a while returns to FRESH_RATE.

    Below the first position, a row that beat the pooled rate one position up (where it drafted that far)
    has the pooled rate scaled up by that much as its prior (at most 1): past its deepest drafts, a row
    better than recent ones is expected to stay better, while the pooled rates keep their fall with depth.
    Without that, a row repeating earlier text climbed one position every several steps: `suffix` on a
    repeated GSM8K prompt (CPU, engine) drafted 2 tokens a step for all 42 steps of its answer, every one
    accepted. (A prior no lower than the row's own rate one position up did as well there, but cost the
    server's EAGLE 4 % at one client: EAGLE's deeper positions are accepted less.)"""
    positions = rows.offered.shape[1]
    prior = pooled_prior(pooled, positions)
    rates = rows.rates(prior, PRIOR_WEIGHT)  # [rows, positions]
    lift = np.where(rows.offered[:, :-1] > 0, rates[:, :-1] / prior[:-1], 1.0)  # [rows, positions - 1]
    deeper = np.minimum(1.0, prior[1:] * np.maximum(lift, 1.0))
    rates[:, 1:] = (rows.accepted[:, 1:] + PRIOR_WEIGHT * deeper) / (rows.offered[:, 1:] + PRIOR_WEIGHT)
    return rates


@dataclass
class StepSeconds:
    """What whole steps cost, as measured, for the cost policies of the engine and the server: by shape
    (B rows, gamma), the median of a shape's last steps once STEP_SAMPLES of them ran, else `predict`'s
    seconds scaled by how far this batch size's measured shapes exceeded their predictions (host work,
    tree masks and verification bookkeeping, which timing forwards alone misses).

    Both time whole steps by the host's clock (StepReport.wall_s). `plain_alike`: whether a plain step
    (gamma 0) not measured yet is scaled like the others: yes for the server, whose policy probes plain
    steps too; no for the engine, which only lets measurements expire (CostModel.expire). Scaled by its
    drafting steps' excess (a tree's bookkeeping), a plain step looked dearer than it was, and a policy
    that keeps drafting never measures one to correct it (the engine drafted Medusa out of domain in 76 %
    of its steps); one priced too low is chosen, so measured."""

    plain_alike: bool = True
    seen: dict[tuple[int, int], deque] = field(default_factory=dict)  # (B, gamma) -> last step seconds
    median: dict[tuple[int, int], float] = field(default_factory=dict)  # (B, gamma) -> median of seen
    overhead: dict[int, float] = field(default_factory=dict)  # B -> measured / predicted step seconds
    plain_overhead: dict[int, float] = field(default_factory=dict)  # B -> the same over plain steps

    def observe(self, B: int, gamma: int, seconds: float, predict: Callable[[int, int], float]) -> None:
        """Once per step; `seconds` is asked once per row and gamma, so the medians are kept, not recomputed."""
        seen = self.seen.setdefault((B, gamma), deque(maxlen=4 * STEP_SAMPLES))
        seen.append(seconds)
        self.median[B, gamma] = statistics.median(seen)
        self.scale(B, predict)

    def forget(self, B: int, gamma: int, predict: Callable[[int, int], float]) -> None:
        """Drop a shape's measurements: it is predicted again (scaled by the other shapes of B) until
        STEP_SAMPLES new steps of it ran."""
        self.seen.pop((B, gamma), None)
        self.median.pop((B, gamma), None)
        self.scale(B, predict)

    def scale(self, B: int, predict: Callable[[int, int], float]) -> None:
        """How far B's measured shapes exceed their predictions (the median ratio; plain steps' own)."""
        ratios = {g: m / predict(b, g) for (b, g), m in self.median.items() if b == B}
        self.overhead.pop(B, None)
        self.plain_overhead.pop(B, None)
        if ratios:
            self.overhead[B] = statistics.median(ratios.values())
        if 0 in ratios:
            self.plain_overhead[B] = ratios[0]

    def measured(self, B: int, gamma: int) -> float | None:
        """The median of this shape's last steps, once STEP_SAMPLES of them ran; else None."""
        return self.median[B, gamma] if len(self.seen.get((B, gamma), ())) >= STEP_SAMPLES else None

    def seconds(self, B: int, gamma: int, predict: Callable[[int, int], float]) -> float:
        measured = self.measured(B, gamma)
        if measured is not None:
            return measured
        scale = self.overhead if gamma or self.plain_alike else self.plain_overhead
        return predict(B, gamma) * scale.get(B, 1.0)


@dataclass
class CostModel:
    """An engine's step costs in units of one plain target step: predicted from r(k) for a k-token forward
    and c per draft token, then measured (`steps`, whole steps by batch size and gamma), and its pooled
    acceptance (`pooled`, blended_rates): both kept across the engine's calls.

    A shape not run for a while is measured again (`expire`): its steps were timed under whatever shared
    the machine then, and a policy that never chooses it again never corrects them. On the 2-core CPU a
    test suite running beside the first minutes of a `suffix` bench priced drafting out for the rest of it
    (0.07 tokens drafted a step, 0.98x plain, where the run left alone gave 1.88x).

    c, what a draft token costs, is the median of the last DRAFT_SAMPLES drafting steps. Once expiry leaves
    no drafting shape measured, those samples are dropped, so that the next drafting step's replaces it at
    once: a cumulative mean kept a stretch of slow drafts (the `suffix` drafter's steps took 10x their usual
    host time for a few prompts on an H200) in every later prediction, where no drafting step came to
    dilute it. c itself is kept until then. Forgotten (0), it priced drafting as free after every expiry,
    and on the 2-core CPU `layer_skip`, which drafts nothing out of domain, drafted a token or two in most
    requests, each first draft catching the row up over its whole history (docs/design.md, "A row kept
    plain by its first drafts retries"); a row whose drafts would now pay finds its way back by retrying
    (GammaPolicy.retry)."""

    verify_ratio: dict[int, float]  # k -> r(k)
    t1: float  # seconds of a 1-token target forward
    widths: dict[int, int] = field(default_factory=dict)  # gamma -> draft tokens verified per row (default gamma)
    draft_seen: deque = field(default_factory=lambda: deque(maxlen=DRAFT_SAMPLES))  # seconds a draft token, a step
    steps: StepSeconds = field(default_factory=lambda: StepSeconds(plain_alike=False))  # the engine probes no step time (CostModel.probe is for depth)
    rows: int = 1  # the batch size the next steps run at
    pooled: Acceptance = field(default_factory=lambda: Acceptance.empty(1, 1))  # recent steps' acceptance, every row
    observed: int = 0  # whole steps observed
    last_run: dict[tuple[int, int], int] = field(default_factory=dict)  # (B, gamma) -> `observed` when it last ran
    expire_after: dict[tuple[int, int], int] = field(default_factory=dict)  # (B, gamma) -> steps without it (EXPLORE_*)
    c: float = 0.0  # seconds of a draft token / t1: draft_seen's median, kept (asked at every gamma of every step)
    probe_left: int = 0  # steps left of a deep probe (`probe`): every row drafts gamma_max
    since_deep: int = 0  # drafting steps since one at gamma_max
    probe_after: int = EXPLORE_EVERY  # drafting steps below gamma_max before the next probe (EXPLORE_*)

    def observe_draft(self, seconds: float, tokens: int) -> None:
        if tokens:
            self.draft_seen.append(seconds / tokens)
            self.c = statistics.median(self.draft_seen) / self.t1

    def predicted_cost(self, B: int, gamma: int) -> float:
        """A step's cost from the timed forwards (of one row, whatever B: `steps` scales it per B)."""
        return gamma * self.c + interpolate(self.verify_ratio, self.widths.get(gamma, gamma) + 1)

    def step_cost(self, gamma: int) -> float:
        return self.steps.seconds(self.rows, gamma, self.predicted_cost)

    def observe_step(self, gamma: int, seconds: float) -> None:
        """A whole step of `rows` rows at `gamma` took `seconds` by the host's clock (StepReport.wall_s)."""
        self.steps.observe(self.rows, gamma, seconds / self.t1, self.predicted_cost)
        self.observed += 1
        self.last_run[self.rows, gamma] = self.observed
        self.expire()
        self.probe(gamma)

    def probe(self, gamma: int) -> None:
        """After `probe_after` drafting steps below gamma_max, the next STEP_SAMPLES steps draft gamma_max
        (`probing`), so that the depths the policy stopped drafting are counted again: expiry re-measures a
        shape's step time, never acceptance, and a depth not drafted is priced at the pooled prior
        (pooled_prior), which out of domain can sit below what the depth really keeps. Each probe doubles
        the wait (up to EXPLORE_MOST); a step the policy itself runs at gamma_max resets it. Plain steps do
        not count: where the policy does not draft at all, a probe asks a question it has answered, and
        costs (`layer_skip` on the 2-core CPU, `mixed`: 0.91x plain with plain steps counted, 0.95x without
        probes). Only where a gamma_max step could pay were every draft kept: it costs less than gamma_max
        + 1 plain steps, drafting included (`layer_skip` drafts a token at 0.9 of a plain step there)."""
        deepest = max(self.widths, default=0)
        if self.probe_left:
            self.probe_left -= 1
            return
        if gamma >= deepest:
            self.since_deep, self.probe_after = 0, EXPLORE_EVERY
            return
        self.since_deep += gamma > 0
        if self.since_deep >= self.probe_after and self.step_cost(deepest) < deepest + 1:
            self.probe_left, self.since_deep = STEP_SAMPLES, 0
            self.probe_after = min(2 * self.probe_after, EXPLORE_MOST)

    @property
    def probing(self) -> bool:
        return self.probe_left > 0

    def expire(self) -> None:
        """Drop the measurements of each shape of this batch size not run for its wait (EXPLORE_EVERY at
        first, doubling each time up to EXPLORE_MOST): it is predicted again, scaled by the shapes measured
        since, and measured again if chosen; with no drafting shape measured any more, c's samples are
        dropped too (c stands until the next drafting step's)."""
        for B, gamma in [key for key in self.steps.median if key[0] == self.rows]:
            wait = self.expire_after.get((B, gamma), EXPLORE_EVERY)
            if self.observed - self.last_run.get((B, gamma), self.observed) >= wait:
                self.steps.forget(B, gamma, self.predicted_cost)
                self.expire_after[B, gamma] = min(2 * wait, EXPLORE_MOST)
                if self.draft_seen and not any(g for _, g in self.steps.median):
                    self.draft_seen.clear()


def verify_widths(drafter, gamma_max: int) -> dict[int, int]:
    """gamma -> the draft tokens a row verifies at that gamma: gamma for a chain, a tree's nodes down to
    depth gamma (what a cost policy must price: a compute-bound target pays for every verified token)."""
    return {g: drafter.shape(g).width if g else 0 for g in range(gamma_max + 1)}


def forward_sizes(widths: dict[int, int]) -> list[int]:
    """Tokens per row k to time target forwards at, from 1 up to the widest step's (its drafts and the
    pending token)."""
    top = max(widths.values()) + 1
    return sorted({k for k in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32) if k <= top} | {top})


@dataclass
class GammaPolicy:
    name: str
    gamma: int  # fixed gamma, or the starting gamma of `heuristic`
    gamma_max: int
    threshold: float = 0.4  # `confidence`
    cost: CostModel | None = None  # `cost`
    rows: list[int] = field(default_factory=list)  # current gamma per row (heuristic)
    unpriced: list[int | None] = field(default_factory=list)  # `cost`: plain steps a row chose unpriced since gamma 0 won
    plain_run: list[int] = field(default_factory=list)  # `cost`: plain steps chosen for a row in a row (retry)
    retries: list[int] = field(default_factory=list)  # `cost`: a row's retries since it last chose to draft
    retry_after: list[int] = field(default_factory=list)  # `cost`: retry_wait, as of the row's last pricing
    counts: Acceptance = field(default_factory=lambda: Acceptance.empty(0, 1))  # per row of the call
    rates: np.ndarray | None = None  # [rows, gamma_max] acceptance() of every row, until the next observe

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise UserError(f"unknown gamma policy {self.name!r}; choose from {', '.join(POLICIES)}")

    @property
    def largest(self) -> int:
        """The most tokens a row may draft in one step under this policy."""
        return self.gamma if self.name == "fixed" else max(self.gamma, self.gamma_max)

    def gammas(self) -> list[int]:
        """Every gamma a step may run at under this policy (the largest of its rows' choices)."""
        if self.name == "fixed":
            return [self.gamma]
        if self.name == "confidence":
            return [self.gamma_max]
        return list(range(0 if self.name == "cost" else 1, self.largest + 1))

    def start(self, batch_size: int) -> None:
        self.rows = [self.gamma] * batch_size
        self.unpriced = [None] * batch_size
        self.plain_run, self.retries = [0] * batch_size, [0] * batch_size
        self.retry_after = [RETRY_MIN_WAIT] * batch_size
        self.counts = Acceptance.empty(batch_size, self.gamma_max)
        self.rates = None
        if self.cost is not None:
            self.cost.pooled = self.cost.pooled.widened(self.gamma_max)

    def choose(self, b: int) -> int:
        """Draft tokens row b may propose next step."""
        if self.name == "fixed":
            return self.gamma
        if self.name == "heuristic":
            return self.rows[b]
        if self.name == "confidence":
            return self.gamma_max
        if self.cost.probing:  # CostModel.probe
            self.plain_run[b] = 0
            return self.gamma_max
        if self.plain_run[b] >= self.retry_after[b]:
            return self.retry(b)
        gamma = self.price(b)
        self.plain_run[b] = 0 if gamma else self.plain_run[b] + 1
        return gamma

    def price(self, b: int) -> int:
        """`cost`'s choice for row b: the best gamma for its acceptance, or 0 unpriced (REPRICE_EVERY)."""
        if self.unpriced[b] is not None and self.unpriced[b] < REPRICE_EVERY:  # gamma 0 stands (REPRICE_EVERY)
            self.unpriced[b] += 1
            return 0
        gamma = best_gamma(self.acceptance(b), self.cost)
        self.unpriced[b] = None if gamma else 0
        if gamma:
            self.retries[b] = 0
        else:  # priced with the gammas, not at every step (a few microseconds a row)
            self.retry_after[b] = retry_wait(self.cost, min(RETRY_GAMMA, self.gamma_max), self.retries[b])
        return gamma

    def retry(self, b: int) -> int:
        """Row b drafts once at RETRY_GAMMA after a run of plain steps, its own counts dropped: the step's
        outcome prices it afresh (with the pooled rate as its prior, as a new request)."""
        self.counts.clear(b)
        self.rates = None
        self.retries[b] += 1
        self.plain_run[b], self.unpriced[b] = 0, None
        return min(RETRY_GAMMA, self.gamma_max)

    def acceptance(self, b: int) -> list[float]:
        """alpha_j for j = 1..gamma_max: row b's steps blended with the engine's recent ones (blended_rates;
        without a cost model, a Beta(1, 1) prior)."""
        if self.rates is None:  # every row at once: choose asks for each row at every step
            if self.cost is None:
                self.rates = self.counts.rates(np.full(self.gamma_max, FRESH_RATE), FRESH_WEIGHT)
            else:
                self.rates = blended_rates(self.counts, self.cost.pooled)
        return self.rates[b].tolist()

    def observe(self, slots: list[int], drafted: list[int], accepted: list[int]) -> None:
        """One step: row slots[i] drafted drafted[i] tokens (what it proposed: a position it left empty is
        not counted, an engine step on a CPU running only as wide as drafted) and kept accepted[i]."""
        self.counts.observe(slots, drafted, accepted)
        self.rates = None
        if self.cost is not None:
            self.cost.pooled.pool(drafted, accepted)
        if self.name == "heuristic":
            for b, d, a in zip(slots, drafted, accepted):
                if d:
                    self.rows[b] = min(self.gamma_max, self.rows[b] + 2) if a == d else max(1, self.rows[b] - 1)


def retry_wait(cost: CostModel, gamma: int, retries: int) -> int:
    """Plain steps a row runs before its next retry at `gamma` (RETRY_*): failed retries cost at most
    RETRY_SHARE of them, doubling with each retry already made."""
    # a retry's cost over a plain step's, in plain steps: as measured, or predicted where that is dearer
    extra = max(0.0, cost.step_cost(gamma) - 1.0, cost.predicted_cost(cost.rows, gamma) - 1.0)
    return round(max(RETRY_MIN_WAIT, extra / RETRY_SHARE) * 2**retries)


def expected_tokens(alphas: list[float], gamma: int) -> float:
    """1 + sum_{i<=gamma} prod_{j<=i} alpha_j."""
    total, reach = 1.0, 1.0
    for a in alphas[:gamma]:
        reach *= a
        total += reach
    return total


def batch_expected_tokens(alphas: np.ndarray, gamma: int) -> np.ndarray:
    """[sum_b E_b(g) for g = 0..gamma]: `expected_tokens` summed over a batch's rows, every gamma at once (a
    server prices each gamma for every row at every step). alphas: [rows, >= gamma] per-position rates."""
    reach = np.cumprod(alphas[:, :gamma], axis=1).sum(axis=0)  # [gamma]: sum over rows of prod_{j<=i} alpha_bj
    return np.concatenate(([float(len(alphas))], len(alphas) + np.cumsum(reach)))


def best_gamma(alphas: list[float], cost: CostModel) -> int:
    """argmax over gamma in 0..len(alphas) of expected tokens per unit cost (0 = a plain step)."""
    return max(range(len(alphas) + 1), key=lambda g: expected_tokens(alphas, g) / cost.step_cost(g))

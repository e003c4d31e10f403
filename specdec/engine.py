"""The decode loop for a batch of prompts: prefill, then steps until every row has stopped.

The step itself (propose -> verify -> commit, stops, the device state) is specdec/step.py, shared
with the server. The engine adds the gamma policy (adaptive.py) and keeps one Stepper per
(batch size, cache length bucket), so repeated calls reuse its caches and captured CUDA graphs.
On a GPU the loop keeps one step in flight: it launches step n+1 before reading step n's outcome,
so the host's bookkeeping overlaps the device's work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from specdec.adaptive import CostModel, GammaPolicy, forward_sizes, verify_widths
from specdec.batch import Request, Row, eos_ids, sampling_mode
from specdec.config import SamplingParams, SpecConfig
from specdec.costs import measure_forward_times, verify_ratios
from specdec.drafters import Drafter, DrafterOptions, build_drafter
from specdec.drafters.catch_up import SHORT_GAP, defers
from specdec.errors import UserError
from specdec.graphs import bucket
from specdec.metrics import SpecStats
from specdec.models.llama import LlamaModel
from specdec.models.tensor_parallel import SINGLE
from specdec.step import Observer, StepRecord, Stepper, StepTimes, new_stepper
from specdec.transfer import to_device

__all__ = ["GenerateOutput", "RowOutput", "SpecEngine", "StepRecord"]


@dataclass
class RowOutput:
    token_ids: list[int]  # generated tokens; the EOS token is included when it ended the row
    text: str | None  # decoded output (None without a tokenizer), cut before a stop string
    finish_reason: str  # "eos" | "stop" | "length"
    stats: SpecStats


@dataclass
class GenerateOutput:
    rows: list[RowOutput]
    stats: SpecStats  # every row's counters summed; wall_s is the batch's
    times: StepTimes  # the steps' device and host time


class SpecEngine:
    def __init__(
        self, target, drafter: Drafter | str = "none", options: DrafterOptions | None = None, graphs: bool | None = None
    ) -> None:
        """graphs: capture steps in CUDA graphs (default: on a CUDA device, for a native target)."""
        self.target = target
        self.drafter = build_drafter(drafter, target, options) if isinstance(drafter, str) else drafter
        self.tokenizer = getattr(target, "tokenizer", None)
        self.device = next(target.parameters()).device
        self.cost_model: CostModel | None = None  # measured once, for the `cost` gamma policy
        if graphs is None:
            graphs = self.device.type == "cuda" and isinstance(target, LlamaModel)
        self.graphs = graphs
        self.steppers: dict[tuple[int, int], Stepper] = {}

    def stepper_for(self, batch_size: int, max_len: int) -> Stepper:
        """A Stepper for this many rows, its cache length bucketed so that calls share caches and graphs."""
        key = (batch_size, bucket(max_len))
        if key not in self.steppers:
            decode = self.decode if self.tokenizer is not None else None
            self.steppers[key] = new_stepper(self.target, self.drafter, batch_size, key[1], list(eos_ids(self.target)),
                                             decode, self.graphs)
        return self.steppers[key]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def measure_costs(self, context: list[int], gamma_max: int) -> CostModel:
        """Time target forwards over 1 up to the widest step's tokens once (a few dozen forwards)."""
        if self.cost_model is None:
            widths = verify_widths(self.drafter, gamma_max)
            times = measure_forward_times(self.target, context[-256:], forward_sizes(widths), repeats=3, graphs=self.graphs)
            self.cost_model = CostModel(verify_ratios(times), times[1], widths)
        return self.cost_model

    def generate(self, prompts: list[list[int]], config: SpecConfig, observer: Observer | None = None) -> GenerateOutput:
        """Decode a batch of token-id prompts. `observer`, if given, sees every verification step."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        if longest >= self.target.max_context:
            raise UserError(f"prompt of {longest} tokens does not fit the model's context of {self.target.max_context}")
        max_new = min(config.max_new_tokens, self.target.max_context - longest)
        cost = None  # only `cost` calls feed the cost model: a fixed gamma's steps reset its probe wait (CostModel.probe)
        if config.gamma_policy == "cost":
            cost = self.measure_costs(prompts[0], config.gamma_max)
            cost.rows = len(prompts)
        policy = GammaPolicy(config.gamma_policy, config.gamma, config.gamma_max, config.confidence_threshold, cost)
        policy.start(len(prompts))
        width = self.drafter.shape(policy.largest).width
        stepper = self.stepper_for(len(prompts), longest + max_new + width + 2)
        requests = [Request(list(p), max_new, row_sampling(config.sampling, b), config.stop, config.stop_at_eos)
                    for b, p in enumerate(prompts)]
        # the prompts' read and every step shape the policy may choose, captured before the clock: captured
        # when first met, each stalled the call that met it (1-6 s on an H200) inside a request's time
        # (docs/design.md, "Captured before the clock")
        stepper.capture_prefill_for(len(prompts), longest)
        if observer is None:  # an observed call steps eagerly
            stepper.capture_shapes(policy.gammas(), modes=(sampling_mode([r.sampling for r in requests]),))
        t0 = time.perf_counter()
        with torch.inference_mode():
            rows, times = decode_rows(stepper, requests, policy, config, observer)
        wall = time.perf_counter() - t0
        outputs = []
        total = SpecStats()
        for row in rows:
            row.stats.wall_s, row.stats.draft_s, row.stats.target_s = wall, times.draft_s, times.verify_s
            total.merge(row.stats)
            text = row.text if row.text is not None else (self.decode(row.generated) if self.tokenizer else None)
            outputs.append(RowOutput(row.generated, text, row.finish_reason or "length", row.stats))
        total.wall_s, total.draft_s, total.target_s = wall, times.draft_s, times.verify_s
        return GenerateOutput(rows=outputs, stats=total, times=times)


def row_sampling(sampling: SamplingParams, b: int) -> SamplingParams:
    """Row b's parameters: the batch's, with seed + b (so rows of one call draw different numbers, and the
    same seed repeats the same outputs)."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + b)


def decode_rows(stepper: Stepper, requests: list[Request], policy: GammaPolicy, config: SpecConfig,
                observer: Observer | None) -> tuple[list[Row], StepTimes]:
    """Prefill every request into slots 0..n-1 and step until all have stopped: the rows, in order, and
    the time the steps took. The stepper is left empty for the next call."""
    batch = stepper.batch
    batch.confidence = config.confidence_threshold if config.gamma_policy == "confidence" else None
    gammas: list[int] | None = None
    shard = getattr(stepper.target, "shard", SINGLE)
    agree = shard.parallel and policy.cost is not None  # timed choices differ per rank: rank 0's are taken
    stepper.reset()
    try:
        rows = stepper.prefill(list(range(len(requests))), requests)
        # steps since each row last drafted, where a lazy drafter catches rows up (catch_up.py): a row's
        # first draft feeds it its prompt (in gaps), and one after a stretch at gamma 0 that stretch
        idle = [SHORT_GAP] * len(rows) if defers(batch) else None
        while batch.busy:
            chosen = [0 if row.finished else policy.choose(row.slot) for row in rows]
            if agree:
                chosen = shard.agree(chosen)
            keep = 1 if stepper.pipelines(max(chosen)) and observer is None else 0  # steps in flight at a launch
            if len(stepper.in_flight) > keep:  # a host drafter proposes from the last step's tokens
                observe(policy, stepper.read(), idle)
                continue  # choose again for the rows that step left
            if chosen != gammas:
                gammas = chosen
                batch.gamma[: len(gammas)].copy_(to_device(gammas, batch.device))  # a step may be in flight: no wait
            stepper.launch(max(gammas), observer)
            if len(stepper.in_flight) > keep:
                observe(policy, stepper.read(), idle)
        while stepper.in_flight:
            observe(policy, stepper.read(), idle)
        return rows, stepper.times
    finally:
        stepper.reset()


def observe(policy: GammaPolicy, report, idle: list[int] | None) -> None:
    """Tell the gamma policy what each row of a step drafted and kept, and what drafting and the whole step
    (at the gamma it ran) cost; not the costs of a step in which a lazy drafter fed a row far behind
    (`idle`, decode_rows): that feed is the drafter's deferred prefill, which the request pays once if it
    drafts at all, not a cost of each draft. Counted, the first draft of a request (an EAGLE step of 2.88
    plain ones, 2-core CPU, native default model) made c 0.532 where drafting steps measure 0.13-0.15,
    and the cost policy never drafted again in that engine (docs/design.md, "Pricing a step"). Nor the
    costs of a step timed across a compile (StepReport.compiled), for the same reason: `suffix`'s first
    drafts on an H200 compiled its device part, and under `cost` it then drafted nothing on `mixed`."""
    drafted = [step.drafted for step in report.rows]
    policy.observe([step.row.slot for step in report.rows], drafted, [step.accepted for step in report.rows])
    caught_up = False
    if idle is not None:
        for step in report.rows:
            caught_up |= step.drafted > 0 and idle[step.row.slot] >= SHORT_GAP
            idle[step.row.slot] = 0 if step.drafted else idle[step.row.slot] + 1
    if policy.cost is not None and not caught_up and not report.compiled:
        policy.cost.observe_draft(report.draft_s, sum(drafted))
        policy.cost.observe_step(report.gamma, report.wall_s)

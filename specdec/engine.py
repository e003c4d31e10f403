"""The decode loop: prefill -> (propose -> verify -> commit)* for a batch of requests.

Each step runs one target forward over [pending token, d1..dk] per row, verifies the drafts
(greedy or exact rejection sampling), rolls the target cache back to what was kept and tells the
drafter. Rows accept different numbers of tokens in the same step and stop on their own (EOS,
stop strings, max_new_tokens); finished rows stay in the batch but draft nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from specdec.adaptive import CostModel, GammaPolicy
from specdec.costs import measure_forward_times, verify_ratios
from specdec.config import SpecConfig
from specdec.drafters import DecodeState, Drafter, DrafterOptions, build_drafter
from specdec.drafters.base import empty_proposal
from specdec.errors import UserError
from specdec.graphs import GraphedModel, bucket
from specdec.models.llama import LlamaModel
from specdec.metrics import SpecStats
from specdec.sampling import logits_to_probs, make_generator, sample
from specdec.drafters.base import Proposal
from specdec.verify import (
    TreeSpec,
    VerifyResult,
    greedy_verify,
    rejection_sample,
    tree_greedy_verify,
    tree_rejection_sample,
)


@dataclass
class RowOutput:
    token_ids: list[int]  # generated tokens; the EOS token is included when it ended the row
    text: str | None  # decoded output (None without a tokenizer), cut before a stop string
    finish_reason: str  # "eos" | "stop" | "length"
    stats: SpecStats


@dataclass
class StepRecord:
    """What one verification step saw, for observers (rejection analysis). Tensors are the step's own."""

    draft_tokens: Tensor  # [B, k]
    q: Tensor | None  # [B, k, V] draft distribution (None = deterministic draft)
    num_drafted: Tensor  # [B]
    target_logits: Tensor  # [B, k+1, V] float32
    result: VerifyResult
    num_generated: list[int]  # per row: tokens generated before this step
    active: list[bool]  # rows that took part in the step
    tree: TreeSpec | None = None  # the tree of a tree proposal (draft_tokens are then its nodes)


Observer = Callable[[StepRecord], None]


@dataclass
class GenerateOutput:
    rows: list[RowOutput]
    stats: SpecStats  # every row's counters summed; wall_s is the batch's


class SpecEngine:
    def __init__(
        self, target, drafter: Drafter | str = "none", options: DrafterOptions | None = None, graphs: bool | None = None
    ) -> None:
        """graphs: replay decode/verify forwards from CUDA graphs (default: on a CUDA device, native model)."""
        self.target = target
        self.drafter = build_drafter(drafter, target, options) if isinstance(drafter, str) else drafter
        self.tokenizer = getattr(target, "tokenizer", None)
        self.device = next(target.parameters()).device
        self.cost_model: CostModel | None = None  # measured once, for the `cost` gamma policy
        if graphs is None:
            graphs = self.device.type == "cuda" and isinstance(target, LlamaModel)
        self.graphed: dict[tuple[int, int], GraphedModel] | None = {} if graphs else None

    def target_for(self, batch_size: int, max_len: int):
        """(forward, cache) for a run: the model and a fresh cache, or a graphed model over a reused
        static cache (cache lengths bucketed so that runs share captured graphs)."""
        if self.graphed is None:
            return self.target, self.target.new_cache(batch_size, max_len)
        key = (batch_size, bucket(max_len))
        if key not in self.graphed:
            self.graphed[key] = GraphedModel(self.target, self.target.new_cache(batch_size, key[1], static=True))
        graphed = self.graphed[key]
        graphed.cache.lengths.zero_()
        return graphed, graphed.cache

    def measure_costs(self, context: list[int], gamma_max: int) -> CostModel:
        """Time target forwards over 1..gamma_max+1 tokens once (a few dozen forwards)."""
        if self.cost_model is None:
            ks = sorted({k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if k <= gamma_max + 1} | {gamma_max + 1})
            times = measure_forward_times(self.target, context[-256:], ks, repeats=3, graphs=self.graphed is not None)
            self.cost_model = CostModel(verify_ratios(times), times[1])
        return self.cost_model

    def eos_ids(self, config: SpecConfig) -> set[int]:
        if not config.stop_at_eos:
            return set()
        ids = set(self.target.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def generate(self, prompts: list[list[int]], config: SpecConfig, observer: Observer | None = None) -> GenerateOutput:
        """Decode a batch of token-id prompts. `observer`, if given, sees every verification step."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        if longest >= self.target.max_context:
            raise UserError(f"prompt of {longest} tokens does not fit the model's context of {self.target.max_context}")
        max_new = min(config.max_new_tokens, self.target.max_context - longest)
        if config.gamma_policy == "cost":
            self.measure_costs(prompts[0], config.gamma_max)
        t0 = time.perf_counter()
        run = Run(self, prompts, config, max_new, observer)
        run.prefill()
        while any(run.state.active):
            run.step()
        wall = time.perf_counter() - t0
        return run.finish(wall)


class Run:
    """One generate call: the decode state, the target cache and the per-row bookkeeping."""

    def __init__(
        self, engine: SpecEngine, prompts: list[list[int]], config: SpecConfig, max_new: int, observer: Observer | None
    ) -> None:
        self.engine, self.config, self.max_new, self.observer = engine, config, max_new, observer
        self.eos = engine.eos_ids(config)
        B = len(prompts)
        self.policy = GammaPolicy(config.gamma_policy, config.gamma, config.gamma_max, config.confidence_threshold,
                                  engine.cost_model)
        self.policy.start(B)
        max_len = max(len(p) for p in prompts) + max_new + engine.drafter.max_tokens(self.policy.largest) + 2
        self.state = DecodeState(
            tokens=[list(p) for p in prompts],
            prompt_lengths=[len(p) for p in prompts],
            active=[True] * B,
            sampling=config.sampling,
            generator=make_generator(config.sampling.seed, engine.device),
            device=engine.device,
            max_len=max_len,
            draft_threshold=config.confidence_threshold if config.gamma_policy == "confidence" else None,
        )
        self.forward, self.cache = engine.target_for(B, max_len)
        self.row_stats = [SpecStats() for _ in range(B)]
        self.finish_reasons = ["length"] * B
        self.texts: list[str | None] = [None] * B
        self.draft_s = self.target_s = 0.0

    def prefill(self) -> None:
        s, dev = self.state, self.state.device
        lengths = torch.tensor(s.prompt_lengths, device=dev)  # [B]
        T = int(lengths.max())
        block = torch.tensor([p + [p[-1]] * (T - len(p)) for p in s.tokens], device=dev)  # [B, T] right-padded
        positions = torch.arange(T, device=dev).expand(s.batch_size, T)
        t = time.perf_counter()
        out = self.forward(block, positions, self.cache, logits_at=lengths - 1)
        self.target_s += time.perf_counter() - t
        self.cache.trim(lengths)
        s.target_hidden = out.hidden
        logits = out.logits[:, 0]  # [B, V]
        first = logits.argmax(-1) if s.sampling.greedy else sample(logits_to_probs(logits, s.sampling), s.generator)
        self.commit_rows(first[:, None].tolist(), [0] * s.batch_size, [0] * s.batch_size)
        self.engine.drafter.prefill(s)

    def step(self) -> None:
        s, dev = self.state, self.state.device
        # per row: the policy's gamma, never drafting past max_new_tokens
        budget = [min(self.policy.choose(b), self.max_new - self.num_generated(b) - 1) if s.active[b] else 0
                  for b in range(s.batch_size)]
        k = max(0, max(budget))
        t = time.perf_counter()
        proposal = self.engine.drafter.propose(s, k) if k > 0 else empty_proposal(s)
        draft_time = time.perf_counter() - t
        self.draft_s += draft_time
        cap = torch.tensor(budget, device=dev).clamp(min=0)  # [B]
        pending = torch.tensor([row[-1] for row in s.tokens], device=dev)  # [B]
        block = torch.cat([pending[:, None], proposal.tokens], dim=1)  # [B, T]
        start = self.cache.lengths.clone()  # [B]
        active = torch.tensor(s.active, device=dev)  # [B]
        t = time.perf_counter()
        if proposal.tree is None:
            num_drafted = cap.clamp(max=proposal.tokens.shape[1])
            if proposal.num_drafted is not None:
                num_drafted = torch.minimum(proposal.num_drafted, num_drafted)
            out = self.forward(block, start[:, None] + torch.arange(block.shape[1], device=dev), self.cache)
            result = self.verify(proposal, out.logits, num_drafted)
            self.cache.trim(torch.where(active, start + result.num_accepted + 1, start))
            s.target_hidden, s.target_logits = out.hidden, out.logits
        else:
            depths = proposal.tree.depths()  # [B, N+1]
            num_drafted = torch.where(active, depths.amax(-1), 0)  # a tree drafts its depth per row
            out = self.forward(block, start[:, None] + depths, self.cache, mask=proposal.tree.ancestor_mask())
            result = self.verify(proposal, out.logits, num_drafted)
            self.cache.compact(start, result.path, torch.where(active, result.num_accepted + 1, 0))
            s.target_hidden = out.hidden.gather(1, result.path[..., None].expand(-1, -1, out.hidden.shape[-1]))
            s.target_logits = out.logits
        tokens, accepted, drafted = result.tokens.tolist(), result.num_accepted.tolist(), num_drafted.tolist()
        self.target_s += time.perf_counter() - t
        if self.observer is not None:
            generated = [self.num_generated(b) for b in range(s.batch_size)]
            self.observer(StepRecord(proposal.tokens, proposal.probs, num_drafted, out.logits, result, generated,
                                     list(s.active), proposal.tree))
        nodes = proposal.tree.valid().sum(-1).tolist() if proposal.tree is not None else None  # tree nodes verified
        for b in range(s.batch_size):
            if s.active[b]:
                self.policy.observe(b, drafted[b], accepted[b])
        if self.policy.cost is not None:
            self.policy.cost.observe_draft(draft_time, sum(drafted))
        self.commit_rows([row[: n + 1] for row, n in zip(tokens, accepted)], drafted, accepted, nodes)
        self.engine.drafter.commit(s, result)

    def verify(self, proposal: Proposal, logits: Tensor, num_drafted: Tensor) -> VerifyResult:
        """Greedy or sampling verification of a chain or a tree; logits [B, T, V]."""
        sampling, tree = self.state.sampling, proposal.tree
        if sampling.greedy:
            if tree is not None:
                return tree_greedy_verify(proposal.tokens, tree, logits)
            return greedy_verify(proposal.tokens, logits, num_drafted)
        p = logits_to_probs(logits, sampling)
        if tree is not None:
            return tree_rejection_sample(proposal.tokens, proposal.probs, tree, p, self.state.generator)
        return rejection_sample(proposal.tokens, proposal.probs, p, self.state.generator, num_drafted)

    def commit_rows(self, emitted: list[list[int]], drafted: list[int], accepted: list[int], nodes: list[int] | None = None) -> None:
        """Append each active row's emitted tokens, cut at a stop condition, and count the step."""
        s = self.state
        for b, new in enumerate(emitted):
            if not s.active[b]:
                continue
            kept = self.cut_at_stop(b, new)
            s.tokens[b].extend(kept)
            self.row_stats[b].record_step(drafted[b], accepted[b], len(kept), None if nodes is None else nodes[b])
            if self.finish_reasons[b] != "length" or self.num_generated(b) >= self.max_new:
                s.active[b] = False

    def cut_at_stop(self, b: int, new: list[int]) -> list[int]:
        """The prefix of `new` up to the first stop condition (EOS kept, stop string cut from the text)."""
        room = self.max_new - self.num_generated(b)
        for i, token in enumerate(new[:room]):
            if token in self.eos:
                self.finish_reasons[b] = "eos"
                return new[: i + 1]
            if self.config.stop and self.engine.tokenizer is not None:
                text = self.decode(self.generated(b) + new[: i + 1])
                hit = min((text.find(x) for x in self.config.stop if x in text), default=-1)
                if hit >= 0:
                    self.finish_reasons[b] = "stop"
                    self.texts[b] = text[:hit]
                    return new[: i + 1]
        return new[:room]

    def num_generated(self, b: int) -> int:
        return len(self.state.tokens[b]) - self.state.prompt_lengths[b]

    def generated(self, b: int) -> list[int]:
        return self.state.tokens[b][self.state.prompt_lengths[b] :]

    def decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def finish(self, wall: float) -> GenerateOutput:
        total = SpecStats()
        rows = []
        for b, stats in enumerate(self.row_stats):
            stats.wall_s, stats.draft_s, stats.target_s = wall, self.draft_s, self.target_s  # rows share the clock
            total.merge(stats)
            ids = self.generated(b)
            text = self.texts[b]
            if text is None and self.engine.tokenizer is not None:
                text = self.decode(ids)
            rows.append(RowOutput(token_ids=ids, text=text, finish_reason=self.finish_reasons[b], stats=stats))
        total.wall_s, total.draft_s, total.target_s = wall, self.draft_s, self.target_s
        return GenerateOutput(rows=rows, stats=total)

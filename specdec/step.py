"""One speculative step over a RowBatch, shared by the engine and the server.

A step has three phases, each pure device work over every slot of the batch (rows that stopped flow
through masked; they never change):

1. propose: the drafter drafts a chain of gamma tokens or a tree per row;
2. verify: one target forward over [pending token, drafts] per row, greedy or rejection-sampling
   verification (per row: its own parameters and seed), each row's budget applied (the policy's gamma,
   never past max_new_tokens), the emitted tokens appended to the rows with EOS and length stops, and
   the target's KV cache rolled back (chain) or compacted (tree) to what was kept;
3. commit: the drafter updates its own state from what was kept.

What a drafter reads of the target's forwards (`Verified.hidden`, `join`'s hidden) is its
`target_features`: the final hidden states, or the concatenated inputs of the target layers it names
(EAGLE-3), which every target forward of the step and of prefill then returns (`aux_layers`,
ModelOutput.aux) at the same static shapes.

`Stepper` runs steps. On CUDA it captures each phase once per step shape (gamma, and whether any
row samples) in a CUDA graph and replays it; elsewhere (or for a drafter that is not graph-safe, or
with an observer) it runs the phases eagerly. Either way the host learns a step's outcome from one
asynchronous copy of a small packed tensor (emitted tokens and counters) into a pinned buffer, so it
can launch the next step before reading the last one (`launch`, then `read`). Phase boundaries are
marked with CUDA events (or the host clock on a CPU), which give the draft and verify times of every
step without stalling the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from specdec.batch import (FINISH_CODES, TOP_K_BOUND, Request, Row, RowBatch, append, budgets, cut_at_stop_string,
                           first_token_outcome, top_k_bound)
from specdec.costs import Stopwatch
from specdec.drafters.base import DraftShape, Drafter, Proposal, Verified, pending_tokens, target_features
from specdec.drafters.catch_up import lag_of
from specdec.graphs import PREFILL_LANE, PrefillGraphs, capturing, prefill_graph_tokens, warming_up
from specdec.kv_cache import KVCache
from specdec.models import cpu_gemm, fused
from specdec.models.kernels import counter_lane, kernel_path
from specdec.models.llama import ModelOutput, aux_args
from specdec.sampling import RowSampling, greedy_tokens, logits_to_probs, sample, uniforms
from specdec.transfer import fill_slot, to_device
from specdec.verify import TreeSpec, VerifyResult, tree_uniforms_needed, verify_chain, verify_tree

# What the host reads back per slot, after the D+1 emitted tokens.
KEPT, ACCEPTED, DRAFTED, NODES, FINISH = range(5)


def entry_point(method: Callable) -> Callable:
    """A Stepper entry point: no autograd (grad mode is per thread, and on in the server's decode
    thread), PyTorch's own operations on one thread while the CPU kernels keep theirs
    (cpu_gemm.kernels_own_threads; it changes nothing on a GPU), and on a GPU the batch's device current
    (streams, graph captures and Triton launches go to the current device, which a new thread sets to
    cuda:0)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), cpu_gemm.kernels_own_threads(), device:
            return method(self, *args, **kwargs)

    return run


@dataclass
class StepRecord:
    """What one verification step saw, for observers (rejection analysis). Tensors are the step's own."""

    draft_tokens: Tensor  # [B, k]
    q: Tensor | None  # [B, k, V] draft distribution (None = deterministic draft)
    num_drafted: Tensor  # [B]
    target_logits: Tensor  # [B, k+1, V] float32
    result: VerifyResult  # num_accepted after the rows' budgets
    num_generated: list[int]  # per row: tokens generated before this step
    active: list[bool]  # rows that took part in the step
    tree: TreeSpec | None = None  # the tree of a tree proposal (draft_tokens are then its nodes)


Observer = Callable[[StepRecord], None]


@dataclass
class StepOutput:
    verified: Verified
    packed: Tensor  # [B, D+1+5] emitted tokens, then KEPT, ACCEPTED, DRAFTED, NODES, FINISH
    record: StepRecord | None = None


def draw_uniforms(batch: RowBatch, offset: int, n: int, any_sampled: bool) -> Tensor | None:
    """[B, n] uniforms for the rows' lanes offset .. offset+n-1 of this step (None when no row samples)."""
    if not any_sampled or n == 0:
        return None
    return uniforms(batch.seed, batch.draws + offset, n)


def propose(drafter: Drafter, batch: RowBatch, gamma: int, shape: DraftShape, any_sampled: bool) -> Proposal:
    return drafter.propose(batch, gamma, draw_uniforms(batch, 0, shape.lanes, any_sampled))


@dataclass
class Checked:
    """What verifying one block decided per row (rows' budgets applied)."""

    result: VerifyResult  # emitted tokens [B, D+1] (path [B, D+1] for a tree)
    accepted: Tensor  # [B] accepted drafts, at most the row's budget
    num_drafted: Tensor  # [B] drafts counted as proposed (a tree: its depth)
    nodes: Tensor  # [B] draft tokens the target verified
    hidden: Tensor  # [B, D+1, Dm] the target's features (drafter_features) at the kept entries, pending token first
    logits: Tensor  # [B, T, V]
    lanes: int  # uniforms the step consumed per row


def drafter_features(out: ModelOutput) -> Tensor:
    """[B, T, Dm] what the drafter reads of a target forward: the layers it asked for (out.aux, when a
    forward was given aux_layers), else the final hidden states."""
    return out.hidden if out.aux is None else out.aux


def check_chain(target, cache: KVCache, batch: RowBatch, block: Tensor, proposal: Proposal | None, budget: Tensor,
                shape: DraftShape, any_sampled: bool, aux_layers: tuple[int, ...] | None = None) -> Checked:
    """block [B, k+1] = [pending, d1..dk]: one forward at the next positions, chain verification."""
    start, width = cache.lengths, block.shape[1] - 1
    out = target(block, start[:, None] + torch.arange(width + 1, device=block.device), cache, **aux_args(aux_layers))
    num_drafted = budget.clamp(max=width)
    if proposal is not None and proposal.num_drafted is not None:
        num_drafted = torch.minimum(num_drafted, proposal.num_drafted)
    u = draw_uniforms(batch, shape.lanes, width + 1, any_sampled)
    q = proposal.q if proposal is not None else None
    result = fused.run_compiled(verify_chain, block[:, 1:], q, out.logits, batch.sampling, u, num_drafted, any_sampled)
    return Checked(result, result.num_accepted, num_drafted, num_drafted, drafter_features(out), out.logits,
                   shape.lanes + width + 1)


def check_tree(target, cache: KVCache, batch: RowBatch, block: Tensor, proposal: Proposal, budget: Tensor,
               shape: DraftShape, any_sampled: bool, aux_layers: tuple[int, ...] | None = None) -> Checked:
    """block [B, N+1] = [pending, nodes]: one forward with the ancestor mask at depth positions, tree verification;
    the accepted path is cut at the row's budget (a prefix of a verified path is verified too)."""
    tree = proposal.tree
    positions, mask = fused.run_compiled(tree_layout, cache.lengths, tree)
    out = target(block, positions, cache, mask=mask, **aux_args(aux_layers))
    u = draw_uniforms(batch, shape.lanes, tree_uniforms_needed(tree), any_sampled)
    result = fused.run_compiled(verify_tree, block[:, 1:], proposal.q, tree, out.logits, batch.sampling, u, any_sampled)
    features = drafter_features(out)  # [B, N+1, Dm]
    hidden = features.gather(1, result.path[..., None].expand(-1, -1, features.shape[-1]))  # [B, D+1, Dm]
    return Checked(result, torch.minimum(result.num_accepted, budget), budget.clamp(max=shape.depth),
                   tree.valid().sum(-1), hidden, out.logits, shape.lanes + tree_uniforms_needed(tree))


def clone_proposal(proposal: Proposal) -> Proposal:
    """A proposal in buffers of its own on the device (what a captured verify reads)."""
    tree = proposal.tree
    if tree is not None:
        tree = TreeSpec(clone_or_none(tree.parents), clone_or_none(tree.num_nodes), tree.max_depth, tree.max_children)
    return Proposal(clone_or_none(proposal.tokens), clone_or_none(proposal.q), clone_or_none(proposal.num_drafted), tree)


def clone_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.clone()


def fill_proposal(static: Proposal, proposal: Proposal) -> None:
    """Copy a host drafter's proposal into the buffers a captured verify reads (same shapes: one step shape)."""
    pairs = [(static.tokens, proposal.tokens), (static.q, proposal.q), (static.num_drafted, proposal.num_drafted)]
    if static.tree is not None:
        pairs += [(static.tree.parents, proposal.tree.parents), (static.tree.num_nodes, proposal.tree.num_nodes)]
    for mine, theirs in pairs:
        if (mine is None) != (theirs is None):
            raise RuntimeError("a host drafter's proposal changed its form within one step shape")
        if mine is not None:
            mine.copy_(theirs, non_blocking=True)


def tree_layout(start: Tensor, tree: TreeSpec) -> tuple[Tensor, Tensor]:
    """A tree block's RoPE positions [B, N+1] (the pending token's, plus each entry's depth) and attention
    mask [B, N+1, N+1] (each entry sees its ancestors)."""
    return start[:, None] + tree.depths(), tree.ancestor_mask()


def verify(target, cache: KVCache, batch: RowBatch, proposal: Proposal | None, shape: DraftShape, any_sampled: bool,
           observe: bool = False, aux_layers: tuple[int, ...] | None = None) -> StepOutput:
    """Phase 2: the target's verify forward and verification, then the kept tokens appended to the rows
    (EOS and length stops) and the target's cache rolled back (chain) or compacted (tree) to them.
    aux_layers: the drafter's target_features."""
    took_part = batch.active.clone()  # [B]
    budget = budgets(batch)  # [B]
    start = cache.lengths.clone()  # [B] every token but the pending one is in the cache
    generated = (batch.length - batch.prompt_length).tolist() if observe else None
    pending = pending_tokens(batch)[:, None]  # [B, 1]
    drafts = proposal.tokens if proposal is not None else pending[:, :0]  # [B, N]
    block = torch.cat([pending, drafts], dim=1)  # [B, T]
    tree = proposal.tree if proposal is not None else None
    check = check_tree if tree is not None else check_chain
    c = check(target, cache, batch, block, proposal, budget, shape, any_sampled, aux_layers)
    if tree is not None:  # lay the kept path out as a chain in the cache (lengths are set by settle)
        cache.compact(start, c.result.path, torch.where(took_part, c.accepted + 1, 0))
    packed = fused.run_compiled(settle, c.result.tokens, c.accepted, c.num_drafted, c.nodes, took_part, start, c.lanes, batch, cache)
    counts = packed[:, -5:]  # [B, 5]
    accepted, kept = counts[:, ACCEPTED], counts[:, KEPT]
    verified = Verified(proposal or Proposal(drafts), accepted, kept, c.hidden, c.logits)
    record = None
    if observe:
        capped = dataclasses.replace(c.result, num_accepted=accepted)
        record = StepRecord(drafts, verified.proposal.q, counts[:, DRAFTED], c.logits, capped, generated,
                            took_part.tolist(), tree)
    return StepOutput(verified, packed, record)


def settle(tokens: Tensor, accepted: Tensor, num_drafted: Tensor, nodes: Tensor, took_part: Tensor, start: Tensor,
           lanes: int, batch: RowBatch, cache: KVCache) -> Tensor:
    """After verification: each row that took part keeps its accepted drafts and one more token (tokens [B, D+1]),
    appended with EOS and length stops; the target cache keeps them (start [B] + kept entries); the rows' draw
    counters advance by `lanes`. Returns the packed outcome [B, D+1+5] the host reads. On CUDA this runs
    compiled (fused.run_compiled): as separate kernels its few dozen tiny operations cost more than a decode forward's tail."""
    accepted = torch.where(took_part, accepted, 0)
    kept, finish = append(batch, tokens, accepted + 1)
    cache.lengths.copy_(torch.where(kept > 0, start + accepted + 1, start))
    batch.draws += torch.where(took_part, lanes, 0)
    emitted = torch.where(torch.arange(tokens.shape[1], device=tokens.device) < kept[:, None], tokens, 0)
    counts = [kept, accepted, torch.where(took_part, num_drafted, 0), torch.where(took_part, nodes, 0), finish]
    return torch.cat([emitted, torch.stack(counts, dim=1)], dim=1)


@dataclass
class Captured:
    """One step shape's phases as CUDA graphs, and the output buffers they write. A host drafter's
    propose and commit run eagerly (propose None, commit None): its proposal is copied into `proposal`,
    the buffers the captured verify reads."""

    propose: torch.cuda.CUDAGraph | None
    verify: torch.cuda.CUDAGraph
    commit: torch.cuda.CUDAGraph | None
    out: StepOutput
    proposal: Proposal | None = None


@dataclass
class JoinGraph:
    """A whole-prompt prefill shape's join (join_rows over its R rows, `span` positions) as a CUDA graph.
    An eager join is a hundred or so small launches (the cache copies, `append`, EAGLE's or a draft model's
    pass over the prompts): 3-5 ms of host work per group with EAGLE on the default model on an H200, at
    the head of every first token. Its inputs are static buffers. Rows past a group's copy its first
    row, as the prefill's padded rows read its first prompt (PrefillGraphs.forward): a slot written more
    than once gets its own bits every time."""

    graph: torch.cuda.CUDAGraph
    index: Tensor  # [R] slots
    first: Tensor  # [R] first tokens
    sampled: Tensor  # [R] 1 where a row samples

    def replay(self, index: Tensor, first: Tensor, sampled: Tensor) -> None:
        """Join the rows in slots index [k] (k <= R; first and sampled [k] as join_rows takes them)."""
        k = len(index)
        for buffer, t in ((self.index, index), (self.first, first), (self.sampled, sampled)):
            buffer[:k].copy_(t)
            buffer[k:].copy_(t[:1].expand(len(buffer) - k))
        self.graph.replay()


@dataclass
class Launched:
    """A step on its way: its packed outcome on the way to the host and the events that time it."""

    outcome: HostCopy  # [B, D+1+5] (pinned on CUDA)
    watch: Stopwatch
    record: StepRecord | None
    gamma: int  # what the step ran at (0 where the drafter proposed nothing at the gamma asked)
    rows: dict[int, Row] = field(default_factory=dict)  # the rows at launch: a slot freed and taken again
    # before the step is read (a server admits rows while a step is in flight) holds a row it did not run
    start: float = 0.0  # time.perf_counter() when its launch began
    serial: int = 0  # unique over every stepper (LAUNCHES)
    compiles: int = 0  # fused.graphs_compiled() when its launch began


LAUNCHES = itertools.count(1)  # launch serials: a host drafter tells its own steps in flight by them (RowBatch.in_flight)
# the sampling modes (RowBatch.sampling_mode) a server captures steps in before it serves: greedy rows, and
# sampled ones with no row's top_k above TOP_K_BOUND
USUAL_MODES = ((False, 0), (True, 0), (True, TOP_K_BOUND))


def steps_in_flight(in_flight: deque[Launched], rows: dict[int, Row]) -> dict[int, int]:
    """{slot: serial of the latest step in flight over the row there} for the rows still in their slots."""
    return {slot: launched.serial for launched in in_flight for slot, row in launched.rows.items() if rows.get(slot) is row}


@dataclass
class RowStep:
    """One row's part in one step, as the host learns it."""

    row: Row
    new: list[int]  # tokens appended to the row (after stop strings)
    drafted: int
    accepted: int


@dataclass
class StepReport:
    rows: list[RowStep]
    draft_s: float  # this step's propose + commit time
    verify_s: float
    gamma: int  # what the step ran at (Launched.gamma)
    wait_s: float = 0.0  # the host's wait for this outcome (read)
    wall_s: float = 0.0  # the step's whole time as the host sees it (Stepper.read): what the cost policies price
    # torch compiled a graph between this step's launch and its read (a host drafter's device part meeting a
    # new shape, say): its times include the compiler, so no cost policy learns from them
    compiled: bool = False


@dataclass
class StepTimes:
    """Seconds per phase on the device and on the host, summed over the steps read so far."""

    draft_s: float = 0.0  # propose + commit (device)
    verify_s: float = 0.0  # (device)
    host_s: float = 0.0  # the host's own work: launching steps and handing their outcomes to the rows
    wait_s: float = 0.0  # the host waiting for the device
    steps: int = 0


@dataclass
class Prefill:
    """Rows joining together, whose prompts the target reads a chunk at a time (`Stepper.prefill_chunk`)
    into a scratch cache, copied into their slots when a row's prompt is read.

    The rows are ordered longest prompt first, so the rows still reading are always the first `left`:
    a chunk's forward runs over a prefix of the scratch cache (a view), and a row whose prompt is read
    drops out of later forwards. Every row still reading has read the same `done` positions. The target's
    hidden states over every chunk are kept: drafters that read the prompt's features (EAGLE) get what
    one forward over the whole prompts gives."""

    rows: list[Row]  # longest prompt first
    index: Tensor  # [n] their slots, in that order
    lengths: list[int]  # their prompt lengths, non-increasing
    chunk: int | None  # the most tokens (rows x positions) one forward reads; None: whole prompts at once
    scratch: KVCache  # n rows of lengths[0] slots (or more: a captured shape's, see `graph`)
    graph: tuple[int, int] | None  # the PrefillGraphs shape that reads the whole prompts in one replay, if any
    hidden: Tensor | None = None  # [n, lengths[0], Dm] the drafter's features (allocated by the first chunk, in the target's dtype)
    done: int = 0  # prompt positions read by every row still reading
    written: bool = False  # the rows' prompts and settings are in the batch (RowBatch.write, by the first chunk)
    left: int = field(init=False)  # rows still reading: rows[:left]

    def __post_init__(self) -> None:
        self.left = len(self.rows)

    @property
    def finished(self) -> bool:
        return self.left == 0


def sample_first(rows: list[Row], logits: Tensor) -> Tensor:
    """[k] the first token of `rows` (joining) from their last prompt position's logits [k, V]: the argmax
    when every one of them is greedy, else each row's own seeded draw, its first (draw counter 0: the join
    advances it). Reads only the rows' host-side settings, not the batch's device state, which the step in
    flight may still be using (prefill_stream)."""
    if all(r.request.sampling.greedy for r in rows):
        return greedy_tokens(logits)
    params = [r.request.sampling for r in rows]
    sampling = RowSampling.of(params, logits.device)
    sampling.max_top_k = top_k_bound([p for p in params if not p.greedy])
    seeds = to_device([r.seed for r in rows], logits.device)  # [k]
    return sample(logits_to_probs(logits, sampling), uniforms(seeds, torch.zeros_like(seeds), 1)[:, 0])


def join_rows(batch: RowBatch, cache: KVCache, drafter: Drafter, index: Tensor, first: Tensor, sampled: Tensor,
              keys: Tensor, values: Tensor, hidden: Tensor, span: int) -> None:
    """The device side of rows joining: the rows in slots index [k] have read their prompts (keys and values
    [L, k, H, >= span, Dh], drafter features hidden [k, >= span, Dm]; past a prompt, padding) and
    sampled their first tokens first [k] (sampled [k]: 1 where a row samples, that token's draw). Their keys
    and values go into their slots, the first tokens are appended (EOS and length stops, as a step's), and a
    graph-safe drafter (`graphable`) is told. Graph-safe: shapes are fixed by k and span. A slot may appear
    more than once in `index` where its duplicates carry its own bits (a captured join pads so: JoinGraph)."""
    cache.k[:, index, :, :span] = keys[:, :, :, :span]
    cache.v[:, index, :, :span] = values[:, :, :, :span]
    cache.lengths[index] = batch.prompt_length[index]
    batch.active.index_fill_(0, index, True)
    batch.draws[index] += sampled
    emitted = torch.zeros(batch.capacity, 1, dtype=torch.long, device=batch.device)
    emitted[index, 0] = first
    joining = torch.zeros(batch.capacity, dtype=torch.long, device=batch.device)
    joining.index_fill_(0, index, 1)
    append(batch, emitted, joining)
    if drafter.graphable:
        drafter.join(batch, index, hidden[:, :span])


def prefill_stream(target, device: torch.device) -> torch.cuda.Stream | None:
    """The stream joining prompts are read on: on CUDA, a stream of their own at a higher priority, so a
    prompt read does not queue behind the step in flight on the current stream, and its first tokens go out
    while that step runs (the join itself, which changes the rows' state, stays on the current stream,
    after the step: Stepper.join_read). None on the CPU, and for a tensor-parallel target: there every
    rank's all-reduces must run in one order, which two streams would not keep."""
    shard = getattr(target, "shard", None)
    if device.type != "cuda" or (shard is not None and shard.parallel):
        return None
    return torch.cuda.Stream(device, priority=-1)  # lower is higher; the default stream's is 0


def graphs_prefill(target) -> bool:
    """Whether the target's whole-prompt prefills run as CUDA graphs (PrefillGraphs): a native model (with
    a shard), on the exact kernels (the padding would change a library kernel's bits), unsharded (a
    tensor-parallel prefill stays eager), whose keys and values for MIN_SPAN tokens fit the budget."""
    shard = getattr(target, "shard", None)
    if shard is None or shard.parallel or not kernel_path(target).exact:
        return False
    return prefill_graph_tokens(target) > 0


def step_shape(drafter: Drafter, gamma: int) -> tuple[int, DraftShape]:
    """(the gamma a step really runs, its draft shape): 0 and an empty shape where the drafter proposes
    nothing at this gamma."""
    shape = drafter.shape(gamma) if gamma else DraftShape(0, 0)
    return (gamma, shape) if shape.width else (0, DraftShape(0, 0))


def run_shapes(drafter: Drafter, gamma: int, any_sampled: bool) -> list[tuple[int, DraftShape]]:
    """(gamma, shape) of every step a step asked at `gamma` may run as: itself, and for a host drafter's
    greedy chain (`narrow`) each narrower gamma it may be cut to, 0 included."""
    shape = drafter.shape(gamma) if gamma else DraftShape(0, 0)
    if drafter.graphable or not gamma or shape.tree or any_sampled:
        return [(gamma, shape)]
    return [step_shape(drafter, g) for g in [0, *narrow_gammas(gamma)]]


def narrow_gammas(gamma: int) -> list[int]:
    """The gammas a host drafter's chain step at `gamma` may be cut to: the powers of two below it, and
    gamma (a handful of step shapes to capture, none more than twice as wide as what was drafted)."""
    return [g for g in (1 << i for i in range(gamma.bit_length())) if g < gamma] + [gamma]


def narrow(drafter: Drafter, gamma: int, shape: DraftShape, proposal: Proposal,
           any_sampled: bool) -> tuple[int, DraftShape, Proposal | None]:
    """A deterministic chain of a greedy batch cut to the narrowest step gamma that holds its longest row,
    where the host knows it without a device sync (`longest_row`): a step verifies no wider than what was
    drafted, and where no row drafted it is a plain step (gamma 0, no proposal). A host drafter's proposal
    length follows its matches (suffix: the pattern's length), so a large gamma costs nothing where the
    matches are short; on a CPU an n-gram step where no row found a match runs as a plain step.
    A greedy tree on a CPU is cut after its widest row's nodes (`narrow_tree`); on a GPU a tree keeps its
    shape, and so does a batch where a row samples: a sampled row's draws advance by the step's width,
    which would then follow its neighbours' drafts, and its seeded output with them."""
    if shape.tree and not any_sampled:
        return gamma, *narrow_tree(shape, proposal)
    longest = longest_row(proposal)
    if any_sampled or shape.tree or shape.lanes or proposal.q is not None or longest is None:
        return gamma, shape, proposal
    g = next((g for g in narrow_gammas(gamma) if g >= longest), gamma) if longest else 0
    if g == gamma:
        return gamma, shape, proposal
    if g == 0:
        return 0, DraftShape(0, 0), None
    return g, drafter.shape(g), Proposal(proposal.tokens[:, :g], None, proposal.num_drafted, longest=longest)


def narrow_tree(shape: DraftShape, proposal: Proposal) -> tuple[DraftShape, Proposal]:
    """A tree whose rows hold fewer nodes than its width (TreeSpec.num_nodes: an EAGLE tree with a grafted
    lookup that found little, a host drafter's tree), cut after the widest row's nodes, where the host knows
    it without a device sync (on a CPU): the verify forward's cost there grows with its width."""
    tree = proposal.tree
    if tree is None or tree.num_nodes is None or tree.num_nodes.device.type != "cpu":
        return shape, proposal
    width = max(int(tree.num_nodes.max()), 1)
    if width >= shape.width:
        return shape, proposal
    cut = TreeSpec(tree.parents[:, :width], tree.num_nodes, tree.max_depth, tree.max_children)
    return replace(shape, width=width), replace(proposal, tokens=proposal.tokens[:, :width], tree=cut)


def longest_row(proposal: Proposal) -> int | None:
    """The most tokens any row of a chain drafted, if the host knows it: a host drafter says so
    (Proposal.longest); on a CPU it is read off num_drafted; else None (reading it would stall a GPU)."""
    if proposal.longest is not None:
        return proposal.longest
    drafted = proposal.num_drafted
    return int(drafted.max()) if drafted is not None and drafted.device.type == "cpu" else None


def drafts_ahead(drafter: Drafter) -> bool:
    """Whether a host drafter can propose while a step is in flight, from the rows' tokens as the host last
    read them and its own drafts in that step (suffix's chains: drafters.suffix, align_guesses), so that its
    drafting steps overlap the host's work on a GPU as plain ones do."""
    return getattr(drafter, "drafts_ahead", False)


def overlaps(drafter: Drafter, gamma: int) -> bool:
    """Whether a step at gamma may be launched before the step in flight is read, where steps are graphed
    (Stepper.pipelines): always for a graph-safe drafter; for a host drafter (suffix, lookahead) at gamma 0,
    and where it drafts only if it `drafts_ahead` (suffix's chains): else it proposes from the rows' tokens
    on the host, which reading the last step brings (and it is not told of steps it did not draft in: `tell`)."""
    return drafter.graphable or gamma == 0 or drafts_ahead(drafter)


def tell(drafter: Drafter, gamma: int) -> bool:
    """Whether the drafter's commit hears of a step at gamma: a graph-safe drafter's always (its device state
    follows every token); a host drafter's only where it drafted. At gamma 0 it would only read the kept
    tokens back, a synchronisation that would stop a GPU's steps from overlapping the host's work (the
    `suffix` drafter's plain steps under the cost policy ran at 0.53-0.66x plain on an H200); it reads
    them from the host's rows when it next proposes instead (drafters.base: host drafters)."""
    return drafter.graphable or gamma > 0


class Stepper:
    """Runs prefills and steps over one RowBatch and its target cache. Rows join with `prefill` (whole
    prompts), or with `start_prefill` and then `prefill_chunk` between steps (a long prompt read while
    other rows decode), and leave with `batch.release`; `launch` enqueues a step and `read` hands its
    outcome to the rows. The entry points that run the models run under inference mode whatever the
    caller's grad mode: it is per thread, on in a server's decode thread, and a drafter's state updated
    with grad on (EAGLE's root feature) would chain every step's autograd graph onto the last."""

    def __init__(self, target, drafter: Drafter, batch: RowBatch, cache: KVCache, graphs: bool,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.target, self.drafter, self.batch, self.cache, self.decode = target, drafter, batch, cache, decode
        self.aux_layers = target_features(drafter)  # asked of every target forward (None: the final hidden states)
        self.graphs = graphs
        self.captured: dict[tuple[int, bool, int], Captured] = {}  # (gamma, any sampled, top-k bound) -> graphs
        self.catch_up_graph: torch.cuda.CUDAGraph | None = None  # one chunk of a lagging drafter's catch-up (catch_up_rows)
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.prefill_graphs = (PrefillGraphs(target, aux_layers=self.aux_layers, max_rows=batch.capacity, max_span=cache.max_len)
                               if graphs and graphs_prefill(target) else None)
        self.times = StepTimes()
        self.last_read = 0.0  # time.perf_counter() when a step was last read
        self.in_flight: deque[Launched] = deque()
        self.spare_host: dict[tuple[int, ...], list[Tensor]] = {}  # pinned outcome buffers already read, by shape
        self.joined: torch.cuda.Event | None = None  # recorded after the last join: its scratch cache is read
        self.join_graphs: dict[tuple[int, int], JoinGraph] = {}  # by prefill shape (capture_prefills)
        # a pool of their own: a join leaves nothing in it, and a step graph captured later must not place
        # its outputs where a join's scratch goes
        self.join_pool = torch.cuda.graph_pool_handle() if self.prefill_graphs is not None else None

    @property
    def device(self) -> torch.device:
        return self.batch.device

    def pipelines(self, gamma: int) -> bool:
        """Whether a step at gamma may be launched before the step in flight is read: only with graphs, and
        then as `overlaps` says."""
        return self.graphs and overlaps(self.drafter, gamma)

    @functools.cached_property
    def prefill_stream(self) -> torch.cuda.Stream | None:
        """Made when first asked for: of a server's steppers (one per bucket) only the full batch's reads prompts."""
        return prefill_stream(self.target, self.device)

    # ---- rows joining --------------------------------------------------------------------------

    def prefill(self, slots: list[int], requests: list[Request]) -> list[Row]:
        """Occupy `slots` with `requests` and read their whole prompts: a prefill with no chunk bound, whose
        one chunk is one forward over them all. The rows, in the order of `slots`."""
        self.prefill_chunk(self.start_prefill(slots, requests, None))
        return [self.batch.rows[slot] for slot in slots]

    @entry_point
    def start_prefill(self, slots: list[int], requests: list[Request], chunk: int | None) -> Prefill:
        """Take `slots` for `requests`, kept out of steps (inactive) until their prompts are read by
        `prefill_chunk`, whose first chunk writes them into the batch: the slots are taken, and steps
        meanwhile leave them alone."""
        if chunk is not None and chunk < len(slots):
            raise ValueError(f"a prefill chunk of {chunk} tokens cannot read a token of each of {len(slots)} rows")
        order = sorted(range(len(slots)), key=lambda i: -len(requests[i].prompt))  # longest prompt first
        slots, requests = [slots[i] for i in order], [requests[i] for i in order]
        lengths = [len(r.prompt) for r in requests]
        graph = self.capture_prefill_for(len(slots), lengths[0], chunk)
        rows = self.batch.take(slots, requests)
        with self.reading_prompts():  # the scratch is written there
            scratch = self.prefill_graphs.scratch(graph) if graph else self.target.new_cache(len(rows), lengths[0])
        return Prefill(rows, to_device(slots, self.device), lengths, chunk, scratch, graph)

    @entry_point
    def capture_prefill_for(self, rows: int, longest: int, chunk: int | None = None) -> tuple[int, int] | None:
        """The whole-prompt prefill shape that reads `rows` prompts of at most `longest` tokens (prefill_graph),
        captured now if it is not yet and the batch is idle (an engine's call: its slots are all free)."""
        graph = self.prefill_graph(rows, longest, chunk)
        if graph is not None and graph not in self.join_graphs and not self.batch.rows:
            self.capture_prefill(graph)
        return graph

    @contextlib.contextmanager
    def reading_prompts(self):
        """Where a prompt read's device work runs: on the prefill stream (see prefill_stream), once the last
        join has copied its scratch cache out (a read overwrites it), in the prefill's counter lane; without
        one, on the current stream."""
        if self.prefill_stream is None:
            yield
            return
        if self.joined is not None:
            self.prefill_stream.wait_event(self.joined)
        with torch.cuda.stream(self.prefill_stream), counter_lane(PREFILL_LANE):
            yield

    def prefill_graph(self, rows: int, longest: int, chunk: int | None) -> tuple[int, int] | None:
        """The PrefillGraphs shape that reads `rows` whole prompts of at most `longest` tokens in one replay:
        one forward must read them all (within `chunk`) and a captured shape must hold them; else None."""
        whole = chunk is None or longest * rows <= chunk
        return self.prefill_graphs.shape(rows, longest) if self.prefill_graphs and whole else None

    @entry_point
    def prefill_chunk(self, prefill: Prefill) -> list[Row]:
        """Read the next positions of the prompts still being read, in one forward of at most prefill.chunk
        tokens (rows x positions). The rows whose prompt this chunk ends join the batch (see join_read) and
        are returned. Runs between steps: a replay where one captured forward reads the whole prompts
        (PrefillGraphs), else eagerly; on the prefill stream where there is one (reading_prompts). The
        tokens come from the host's prompts, not the batch, whose device copy is written on the current
        stream."""
        p, dev = prefill, self.device
        m, start = p.left, p.done
        width = p.lengths[0] - start if p.chunk is None else min(p.lengths[0] - start, p.chunk // m)
        with self.reading_prompts():
            block = to_device([r.request.prompt[start : start + width] + [0] * (start + width - len(r.request.prompt))
                               for r in p.rows[:m]], dev)  # [m, w] right-padded with 0
            last = (to_device(p.lengths[:m], dev) - 1 - start).clamp(0, width - 1)  # [m] a prompt's end, if here
            if p.graph is not None:  # the whole prompts, in one replay
                out = self.prefill_graphs.forward(p.graph, block, last)
            else:
                positions = torch.arange(start, start + width, device=dev).expand_as(block)  # [m, w]
                out = self.target(block, positions, p.scratch.head(m), logits_at=last, **aux_args(self.aux_layers))
            features = drafter_features(out)  # [m, w, Dm]
            if p.hidden is None:
                p.hidden = features.new_empty(len(p.rows), p.lengths[0], features.shape[-1])  # [n, T, Dm]
            p.hidden[:m, start : start + width] = features
            p.done = start + width
            p.left = sum(n > p.done for n in p.lengths)
            if p.left < m:  # rows whose prompt this chunk ends
                first = sample_first(p.rows[p.left : m], out.logits[p.left : m, 0])  # [k]
                tokens = to_host(first)
        if not p.written:  # the rows into their slots, on the current stream, while the device reads the prompts
            self.batch.write(p.rows, active=False)
            p.written = True
        if p.left == m:
            return []
        return self.join_read(p, p.left, m, first, tokens)

    def join_read(self, prefill: Prefill, lo: int, hi: int, first: Tensor, tokens: HostCopy) -> list[Row]:
        """Rows lo..hi-1 of a prefill have read their prompts and sampled their first tokens (`first` [hi-lo]
        on the device, `tokens` on their way to the host). On the device, after the step in flight, their
        keys and values go into their slots of the target cache, the first tokens are appended (and counted
        as draws where a row samples), and the drafter is told, with the target's hidden states over their
        right-padded prompts, exactly as when the whole prompts are read in one forward (join_rows; one
        replay of the prefill shape's JoinGraph where a whole group was read by a captured prefill; a host
        drafter's join runs after it, eagerly). Then the host
        reads the tokens (waiting for the prompt read only, which ran on the device while the host queued
        this: with EAGLE on the default model on an H200, 3-3.6 ms of host work at one client, after which
        the first tokens were there) and hands them to the rows."""
        batch, p = self.batch, prefill
        if self.prefill_stream is not None:  # the read's tensors, made on the prefill stream, are used here too
            torch.cuda.current_stream().wait_stream(self.prefill_stream)
            for t in (first, p.hidden, p.scratch.k, p.scratch.v):
                t.record_stream(torch.cuda.current_stream())
        rows = p.rows[lo:hi]
        sampled = to_device([int(not r.request.sampling.greedy) for r in rows], self.device)  # [k]
        index, T = p.index[lo:hi], p.lengths[lo]  # [k]; the longest of these prompts
        graph = self.join_graphs.get(p.graph) if lo == 0 and hi == len(p.rows) else None
        if graph is not None:
            graph.replay(index, first, sampled)
        else:
            join_rows(batch, self.cache, self.drafter, index, first, sampled, p.scratch.k[:, lo:hi], p.scratch.v[:, lo:hi],
                      p.hidden[lo:hi], T)
        if not self.drafter.graphable:  # the slots from the host: reading `index` would wait for the step in flight
            self.drafter.join(batch, torch.tensor([r.slot for r in rows]), p.hidden[lo:hi, :T])
        if self.prefill_stream is not None:
            self.joined = torch.cuda.Event()
            self.joined.record()
        packed = [[0] * 6 for _ in range(batch.capacity)]  # as a step's outcome: emitted token, then the counts
        for row, token in zip(rows, tokens.values()):
            kept, finish = first_token_outcome(row.request, token, batch.eos_ids)
            packed[row.slot] = [token, kept, 0, 0, 0, finish]
        self.absorb(packed, {r.slot: r for r in rows})
        return rows

    def reset(self) -> None:
        """Forget every row and step in flight (after a run, or after an error)."""
        for slot in list(self.batch.rows):
            self.batch.release(slot)
        self.in_flight.clear()
        self.times = StepTimes()
        lag = lag_of(self.batch)
        if lag is not None:  # no row is left behind
            lag.most = 0

    # ---- steps ---------------------------------------------------------------------------------

    @entry_point
    def launch(self, gamma: int, observer: Observer | None = None, eager: bool = False) -> Launched:
        """Enqueue one step in which each row drafts up to min(gamma, batch.gamma[row]) tokens (eagerly
        with an observer, or when asked). A greedy batch's chain whose longest row the host knows (a host
        drafter's; any on a CPU) runs at the narrowest gamma that holds it (`narrow`)."""
        t, compiles = time.perf_counter(), fused.graphs_compiled()
        batch, drafter = self.batch, self.drafter
        gamma, shape = step_shape(drafter, gamma)
        any_sampled, max_top_k = batch.sampling_mode()
        batch.sampling.max_top_k = max_top_k
        graphed = self.graphs and observer is None and not eager
        if graphed:  # every shape this step may run at, before its clock starts
            for g, s in run_shapes(drafter, gamma, any_sampled):
                if (g, any_sampled, max_top_k) not in self.captured:
                    self.capture((g, any_sampled, max_top_k), s)
        watch = Stopwatch(self.device)
        watch.mark("start")
        lag = lag_of(batch)
        if gamma and lag is not None:
            self.catch_up_rows(lag.chunks_before(), graphed)
        proposal = None
        serial = next(LAUNCHES)
        if gamma and drafts_ahead(drafter):  # what it drafts ahead from: its rows' steps not yet read
            batch.serial, batch.in_flight = serial, steps_in_flight(self.in_flight, batch.rows)
        if gamma and not (graphed and drafter.graphable):  # proposed first: what was drafted may settle the step's shape
            gamma, shape, proposal = narrow(drafter, gamma, shape, propose(drafter, batch, gamma, shape, any_sampled), any_sampled)
        if graphed:
            captured = self.captured[(gamma, any_sampled, max_top_k)]
            if captured.propose is not None:
                captured.propose.replay()
            elif proposal is not None:
                fill_proposal(captured.proposal, proposal)
            watch.mark("drafted")
            captured.verify.replay()
            watch.mark("verified")
            if captured.commit is not None:
                captured.commit.replay()
            elif tell(drafter, gamma):
                drafter.commit(batch, captured.out.verified)
            watch.mark("committed")
            out = captured.out
        else:
            out = self.run_phases(gamma, shape, any_sampled, watch, observe=observer is not None, proposal=proposal)
        if lag is not None:
            lag.stepped(shape.depth if gamma else 0)
        launched = self.copy_out(out, watch, gamma)
        launched.rows, launched.start, launched.serial, launched.compiles = dict(batch.rows), t, serial, compiles
        if observer is not None:
            observer(out.record)
        self.in_flight.append(launched)
        self.times.host_s += time.perf_counter() - t
        return launched

    def catch_up_rows(self, chunks: int, graphed: bool) -> None:
        """Feed a lagging drafter's rows `chunks` chunks of what they skipped (catch_up.py, Lag), before a
        drafting step whose propose feeds the last chunk: a replay each where steps are graphed."""
        for _ in range(chunks):
            if graphed:
                self.catch_up_graph.replay()
            else:
                self.drafter.catch_up(self.batch)

    def missing_shapes(self, gammas: list[int], modes: tuple[tuple[bool, int], ...] = USUAL_MODES
                       ) -> dict[tuple[int, bool, int], DraftShape]:
        """The step shapes at these gammas not captured yet (keys as in `captured`), in these sampling modes
        (RowBatch.sampling_mode; by default greedy batches and sampled ones with no row's top_k above
        TOP_K_BOUND); none without graphs."""
        if not self.graphs:
            return {}
        missing = {}
        for any_sampled, top_k in modes:
            for gamma, shape in {run for g in gammas for run in run_shapes(self.drafter, step_shape(self.drafter, g)[0], any_sampled)}:
                if (gamma, any_sampled, top_k) not in self.captured:
                    missing[(gamma, any_sampled, top_k)] = shape
        return missing

    @entry_point
    def capture_shapes(self, gammas: list[int], done: Callable[[], object] = lambda: None,
                       modes: tuple[tuple[bool, int], ...] = USUAL_MODES) -> int:
        """Capture now the missing step shapes at these gammas and sampling modes (missing_shapes), so that
        neither a policy changing gamma from step to step nor a request's usual sampling parameters stall a
        running batch on a capture (an eager warm-up and three captures; a shape not asked for here, such
        as a larger top_k, is still captured when first met). Calls `done` after each (a progress bar's
        update); returns how many were new."""
        missing = self.missing_shapes(gammas, modes)
        for key, shape in missing.items():
            self.capture(key, shape)
            done()
        return len(missing)

    def missing_prefills(self, max_rows: int) -> list[tuple[int, int]]:
        """The whole-prompt prefill shapes of up to max_rows rows (PrefillGraphs.shapes) not captured yet."""
        if self.prefill_graphs is None:
            return []
        return [shape for shape in self.prefill_graphs.shapes(max_rows) if shape not in self.prefill_graphs.graphs]

    @entry_point
    def capture_prefills(self, max_rows: int, done: Callable[[], object] = lambda: None) -> int:
        """Capture now the missing whole-prompt prefills of up to max_rows rows, so that no request waits for
        a capture; calls `done` after each, returns how many were new."""
        missing = self.missing_prefills(max_rows)
        for shape in missing:
            self.capture_prefill(shape)
            done()
        return len(missing)

    def capture_prefill(self, key: tuple[int, int]) -> None:
        """Capture whole-prompt prefill shape `key` (PrefillGraphs), if it is not yet, and its join (JoinGraph):
        the server captures every shape at start (capture_prefills), an engine each before the clock of the
        first call that reads it (capture_prefill_for). With the prefill alone captured, an engine joined its
        rows eagerly at every call, a draft model's or EAGLE's pass over the prompt included: `layer_skip`,
        which never drafted, ran 0.93x plain on qa prompts on an H200, and 0.99x with the joins captured
        (docs/design.md, "Out of domain")."""
        if key not in self.prefill_graphs.graphs:
            self.prefill_graphs.capture(key)
        self.capture_join(key)

    def capture_join(self, key: tuple[int, int]) -> None:
        """Capture the join of prefill shape `key` (JoinGraph). Its warm-up and capture write into a free
        slot, left inactive after; with none free (a capture in the middle of serving a full batch) that
        shape's groups join eagerly."""
        free = self.batch.free_slots()
        if not free:
            return
        R, S = key
        prefill, dev = self.prefill_graphs.graphs[key], self.device
        span = min(S, self.cache.max_len, self.batch.max_len - 1)  # EAGLE reads the tokens after each position
        fill_slot(self.batch.prompt_length, free[0], 1)  # a one-token prompt: the reads at its last position stay in bounds
        index = torch.full((R,), free[0], dtype=torch.long, device=dev)
        first, sampled = torch.zeros(R, dtype=torch.long, device=dev), torch.zeros(R, dtype=torch.long, device=dev)
        args = (self.batch, self.cache, self.drafter, index, first, sampled, prefill.scratch.k, prefill.scratch.v,
                drafter_features(prefill.out), span)
        with warming_up():
            for _ in range(2):
                join_rows(*args)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.join_pool):
            join_rows(*args)
        fill_slot(self.batch.active, free[0], False)
        self.join_graphs[key] = JoinGraph(graph, index, first, sampled)

    def run_phases(self, gamma: int, shape: DraftShape, any_sampled: bool, watch: Stopwatch, observe: bool = False,
                   proposal: Proposal | None = None) -> StepOutput:
        """The three phases, eagerly, after the caller's "start" mark (a host drafter's proposal may come made)."""
        if gamma and proposal is None:
            proposal = propose(self.drafter, self.batch, gamma, shape, any_sampled)
        watch.mark("drafted")
        out = verify(self.target, self.cache, self.batch, proposal, shape, any_sampled, observe, self.aux_layers)
        watch.mark("verified")
        if tell(self.drafter, gamma):
            self.drafter.commit(self.batch, out.verified)
        watch.mark("committed")
        return out

    def capture(self, key: tuple[int, bool, int], shape: DraftShape) -> Captured:
        """Warm up (compile kernels, pick algorithms) with every row inactive, which leaves the rows as they
        are, then capture the three phases in graphs sharing one memory pool. A phase with no device work
        (a stateless drafter's commit) gives an empty graph: torch warns about it, needlessly. A host
        drafter (not `graphable`: suffix, lookahead) keeps its propose and commit eager, and only the
        verify forward is captured, reading a copy of each proposal: on a GPU the eager forward costs
        ~17x the graphed one (22.8 against 1.38 ms for the default model on an H200)."""
        gamma, any_sampled, top_k = key
        batch, host = self.batch, not self.drafter.graphable
        active, bound = batch.active.clone(), batch.sampling.max_top_k
        batch.active.zero_()
        batch.sampling.max_top_k = top_k  # the promise the graphs bake in (RowSampling.max_top_k)
        with fused.fusing(), warming_up():
            for _ in range(2):
                self.run_phases(gamma, shape, any_sampled, Stopwatch(self.device))
            static = clone_proposal(propose(self.drafter, batch, gamma, shape, any_sampled)) if host and gamma else None
        graphs = [torch.cuda.CUDAGraph() for _ in range(3)]
        with fused.fusing(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            proposal = static
            if gamma and not host:
                with capturing(graphs[0], self.pool):
                    proposal = propose(self.drafter, batch, gamma, shape, any_sampled)
            with capturing(graphs[1], self.pool):
                out = verify(self.target, self.cache, batch, proposal, shape, any_sampled, aux_layers=self.aux_layers)
            if not host:
                with capturing(graphs[2], self.pool):
                    self.drafter.commit(batch, out.verified)
        if self.catch_up_graph is None and lag_of(batch) is not None:  # with every row still inactive
            self.catch_up_graph = self.capture_catch_up()
        batch.active.copy_(active)
        batch.sampling.max_top_k = bound
        self.captured[key] = Captured(graphs[0] if gamma and not host else None, graphs[1], None if host else graphs[2], out, static)
        return self.captured[key]

    def capture_catch_up(self) -> torch.cuda.CUDAGraph:
        """One chunk of a lagging drafter's catch-up as a CUDA graph, warmed up and captured with every row
        inactive (a chunk then feeds nothing: its entries are scratch past the rows' lengths)."""
        with fused.fusing(), warming_up():
            for _ in range(2):
                self.drafter.catch_up(self.batch)
        graph = torch.cuda.CUDAGraph()
        with fused.fusing(), capturing(graph, self.pool):
            self.drafter.catch_up(self.batch)
        return graph

    def copy_out(self, out: StepOutput, watch: Stopwatch, gamma: int) -> Launched:
        if self.device.type != "cuda":
            return Launched(HostCopy(out.packed.clone()), watch, out.record, gamma)  # the next step reuses packed
        spare = self.spare_host.get(tuple(out.packed.shape))
        host = spare.pop() if spare else torch.empty(out.packed.shape, dtype=out.packed.dtype, pin_memory=True)
        return Launched(to_host(out.packed, host), watch, out.record, gamma)

    def read(self) -> StepReport:
        """Wait for the oldest launched step and hand its outcome to the rows. Its wall time runs from its
        launch, or from the last read where that came later (a pipelined step: the device ran it while the
        host read the one before), to the end of this read: host work and device time as they overlap, and a
        host drafter's bubble (the device idle while it drafts), which events around the phases miss."""
        launched = self.in_flight.popleft()
        t = time.perf_counter()
        launched.outcome.wait()
        waited = time.perf_counter()
        w = launched.watch
        draft_s = w.seconds("start", "drafted") + w.seconds("verified", "committed")
        verify_s = w.seconds("drafted", "verified")
        self.times.draft_s += draft_s
        self.times.verify_s += verify_s
        self.times.steps += 1
        host = launched.outcome.host
        report = StepReport(self.absorb(host.tolist(), launched.rows), draft_s, verify_s, launched.gamma, waited - t)
        if launched.outcome.done is not None:  # read: its pinned buffer can take a later step's outcome
            self.spare_host.setdefault(tuple(host.shape), []).append(host)
        self.times.wait_s += waited - t
        now = time.perf_counter()
        self.times.host_s += now - waited
        report.wall_s, self.last_read = now - max(launched.start, self.last_read), now
        report.compiled = fused.graphs_compiled() != launched.compiles
        return report

    def absorb(self, packed: list[list[int]], rows: dict[int, Row]) -> list[RowStep]:
        """Append the emitted tokens of each of `rows` (by slot) still in the batch and running, apply stop
        strings, count the step, note finishes. `packed` covers this stepper's slots; rows beyond them (a
        view of the first slots, while a row further on is being prefilled) took no part."""
        steps = []
        for slot, row in self.batch.rows.items():
            if row.finished or slot >= len(packed) or rows.get(slot) is not row:
                continue
            values = packed[slot]
            D = len(values) - 5
            kept, accepted, drafted, nodes, finish = values[D:]
            if kept == 0:
                continue
            new = values[:kept]
            if row.request.stop and self.decode is not None:
                new, text = cut_at_stop_string(self.decode, row.generated, new, row.request.stop)
                if text is not None:
                    row.text = text
                    self.batch.finish(row, "stop")
            row.generated += new
            row.stats.record_step(drafted, accepted, len(new), nodes, prefill=row.stats.steps == 0)  # a row's first step is its prefill
            if not row.finished and FINISH_CODES[finish] is not None:
                row.finish_reason = FINISH_CODES[finish]
            steps.append(RowStep(row, new, drafted, accepted))
        return steps


@dataclass
class HostCopy:
    """A device tensor's values on their way to the host (`to_host`)."""

    host: Tensor
    done: torch.cuda.Event | None = None  # recorded behind the copy, on the stream it was queued on

    def wait(self) -> None:
        """Until the copy and the work queued before it on its stream have run: a deliberate wait, through an
        event, not for work on other streams."""
        if self.done is not None:
            self.done.synchronize()

    def values(self) -> list:
        self.wait()
        return self.host.tolist()


def to_host(t: Tensor, into: Tensor | None = None) -> HostCopy:
    """Start copying t to the host (into `into`, a pinned buffer of its shape, where given), behind the work
    queued on the current stream: a step's outcome (Stepper.copy_out), a joining row's first token."""
    if t.device.type != "cuda":
        return HostCopy(t)
    host = t.to("cpu", non_blocking=True) if into is None else into.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(host, done)


def new_stepper(target, drafter: Drafter, capacity: int, max_len: int, eos_ids: list[int],
                decode: Callable[[list[int]], str] | None = None, graphs: bool | None = None) -> Stepper:
    """A Stepper over a fresh batch of `capacity` slots of `max_len` tokens. graphs: capture steps in
    CUDA graphs (default: on a CUDA device)."""
    device = next(target.parameters()).device
    graphs = device.type == "cuda" if graphs is None else graphs
    batch = RowBatch(capacity, max_len, eos_ids, device, static=graphs)
    cache = batch.target_cache = target.new_cache(capacity, max_len, static=graphs)
    drafter.attach(batch)
    return Stepper(target, drafter, batch, cache, graphs, decode)

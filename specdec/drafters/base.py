"""The drafter protocol and the registry that builds drafters by name.

A drafter proposes draft tokens for every slot of a RowBatch and is told what the target kept. It
never touches the target model or its cache; its own state (a draft model's cache, an EAGLE head's
cache and pending features, an n-gram pool) lives in `batch.draft`, created by `attach`, one entry
per slot, so rows can join (`join`, after the target has prefilled them) and leave between steps.

Static shapes: for a given gamma a proposal always has the same shape (`shape(gamma)`), whatever the
rows hold, and a `graphable` drafter's `propose`, `commit` and `join` are pure device work (no host
synchronisation, no data-dependent shapes), so the step that calls them, and a prompt's join
(step.JoinGraph: `join` over a prefill shape's rows), can be captured in CUDA graphs. Rows that stopped still flow through (masked, never sliced); their state must not change.

A host drafter (not `graphable`: its state is Python on the host) is told only of the steps it drafted in
(`commit` at gamma > 0, step.tell): a commit at gamma 0 would only read kept tokens back, a synchronisation
that keeps a GPU's plain steps from overlapping the host's work. It proposes from the rows' tokens as the
host has read them (`batch.rows`: the request's prompt, then `Row.generated`) or as the device holds them,
and the steppers' callers read every step in flight before a step in which it drafts (Stepper.pipelines),
unless it `drafts_ahead`: proposes with a step in flight, as a guess past that step's draft that the
device aligns with what the step kept (suffix's chains).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from specdec.batch import RowBatch
from specdec.transfer import pack_rows, to_device
from specdec.verify import TreeSpec


@dataclass(frozen=True)
class DraftShape:
    """The static size of a proposal: `width` draft tokens (chain length or tree nodes), at most
    `depth` of them on one root-to-leaf path (= width for a chain: the gamma that really runs), and
    `lanes` uniform random numbers per row that drafting consumes."""

    width: int
    depth: int
    tree: bool = False
    lanes: int = 0


@dataclass
class Proposal:
    tokens: Tensor  # [B, N] draft tokens (a chain, or a tree's nodes in topological order)
    q: Tensor | None = None  # [B, N, V] distribution each token was drawn from; None = deterministic (one-hot q)
    num_drafted: Tensor | None = None  # [B] valid chain tokens per row; None = all N (chains only)
    tree: TreeSpec | None = None
    longest: int | None = None  # a host drafter's chain: the most tokens a row drafted, known on the host (step.narrow)


def host_tree_proposal(trees: dict[int, tuple[list[int], list[int]]], capacity: int, width: int, depth: int,
                       max_children: int, device: torch.device) -> Proposal:
    """A tree proposal from a host drafter's per-slot (tokens, parents) in topological order (parent -1: the
    pending token), packed on the host and copied without waiting for the device; absent slots draft nothing."""
    tokens = pack_rows({slot: t for slot, (t, _) in trees.items()}, capacity, width)  # [B, N]
    parents = pack_rows({slot: p for slot, (_, p) in trees.items()}, capacity, width, fill=-1)  # [B, N]
    num_nodes = [len(trees[slot][0]) if slot in trees else 0 for slot in range(capacity)]  # [B]
    tree = TreeSpec(to_device(parents, device), to_device(num_nodes, device), depth, max_children)
    return Proposal(tokens=to_device(tokens, device), tree=tree)


@dataclass
class Verified:
    """What one step kept, for the drafter's commit. Rows that did not take part have accepted = 0."""

    proposal: Proposal
    accepted: Tensor  # [B] accepted draft tokens
    kept: Tensor  # [B] tokens appended to each row (accepted + 1, or fewer where the row stopped)
    hidden: Tensor  # [B, D+1, Dm] the target's features at the kept block entries (pending token first): see target_features
    logits: Tensor  # [B, T, V] the target's logits over the whole verify block (rejected entries included)


class Drafter(Protocol):
    name: str
    graphable: bool  # propose, commit and join are graph-safe
    # Optional: the target layers whose input residual streams the drafter reads as its features,
    # concatenated (EAGLE-3's low, mid and high layers; see target_features). Absent or None: the
    # target's final hidden states.
    feature_layers: tuple[int, ...] | None

    def shape(self, gamma: int) -> DraftShape: ...

    def attach(self, batch: RowBatch) -> None:
        """Create this drafter's per-slot state for `batch` (sized by its capacity and max_len)."""
        ...

    def join(self, batch: RowBatch, slots: Tensor, hidden: Tensor) -> None:
        """Rows `slots` [n] were just prefilled: hidden [n, T, Dm] is the target's features (target_features)
        over their right-padded prompts (batch.prompt_length says how much is real); batch.tokens holds
        prompt + first token."""
        ...

    def propose(self, batch: RowBatch, gamma: int, u: Tensor) -> Proposal:
        """A proposal of shape(gamma) for every slot; u [B, lanes] uniforms for sampled drafts."""
        ...

    def commit(self, batch: RowBatch, verified: Verified) -> None: ...


def learns_across_requests(drafter: Drafter) -> bool:
    """Whether the drafter keeps state beyond its rows, learned from earlier requests (suffix's global
    index), which a benchmark must empty between the methods or passes it compares (`forget`)."""
    return getattr(drafter, "learns_across_requests", False)


def forget_requests(drafter: Drafter) -> None:
    """Drop what the drafter learned from earlier requests, if it learns any."""
    if learns_across_requests(drafter):
        drafter.forget()


class Stateless:
    """Base for drafters with no per-slot state."""

    graphable = True

    def attach(self, batch: RowBatch) -> None:
        pass

    def join(self, batch: RowBatch, slots: Tensor, hidden: Tensor) -> None:
        pass

    def commit(self, batch: RowBatch, verified: Verified) -> None:
        pass


@dataclass(frozen=True)
class DrafterOptions:
    """Everything a drafter may be built from; each drafter reads its own fields."""

    draft_model: object | None = None  # a loaded model, or a name/path for load_model
    ngram_max: int = 3
    ngram_min: int = 1
    extra: dict = field(default_factory=dict)


DrafterFactory = Callable[[object, DrafterOptions], Drafter]
DRAFTERS: dict[str, DrafterFactory] = {}


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        DRAFTERS[name] = factory
        return factory

    return wrap


def target_features(drafter) -> tuple[int, ...] | None:
    """The target layers a drafter reads (`feature_layers`), which the step asks the target's forwards for
    (`aux_layers`) and hands to `join` and `commit` as `hidden` ([.., n*D]); None: the final hidden states."""
    return getattr(drafter, "feature_layers", None)


def pending_tokens(batch: RowBatch) -> Tensor:
    """[B] each row's last token (emitted, not yet run through the target)."""
    return batch.tokens.gather(1, (batch.length - 1).clamp(min=0)[:, None]).squeeze(1)


def prompt_last(hidden: Tensor, lengths: Tensor) -> Tensor:
    """hidden [n, T, D] over right-padded prompts, lengths [n] -> [n, D] at each prompt's last token."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]

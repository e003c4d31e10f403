"""The drafter protocol, the decode state drafters read, and the registry that builds them by name.

A drafter proposes up to k tokens per row and is told what the target kept. It never mutates the
target model or its cache; whatever state it needs (its own model and cache, n-gram tables) it owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from specdec.config import SamplingParams
from specdec.verify import TreeSpec, VerifyResult


@dataclass
class Proposal:
    tokens: Tensor  # [B, k] draft tokens, padded past num_drafted
    probs: Tensor | None = None  # [B, k, V] draft distribution q; None = deterministic draft (one-hot q)
    num_drafted: Tensor | None = None  # [B] valid draft tokens per row; None = all k (chains only)
    tree: TreeSpec | None = None  # tokens are then the tree's nodes [B, N] (probs [B, N, V]: q each was drawn from)


@dataclass
class DecodeState:
    """What the engine knows about a batch between steps. Row b's last token is pending: emitted,
    but not yet run through the target (it leads the next verify block)."""

    tokens: list[list[int]]  # per row: prompt + emitted tokens
    prompt_lengths: list[int]
    active: list[bool]  # rows still generating
    sampling: SamplingParams
    generator: torch.Generator
    device: torch.device
    max_len: int  # cache slots per row the engine allocated
    draft_threshold: float | None = None  # stop a row's draft below this top-1 draft probability
    # Target hidden states [B, T, D] at the tokens the last step kept in the cache: the pending token, then
    # the accepted drafts (valid up to num_accepted + 1 per row); after prefill, the prompt's.
    target_hidden: Tensor | None = None
    # The target's logits [B, T, V] over the last step's whole block (pending token, then the chain or the
    # tree's nodes in proposal order), rejected positions included: what lookahead's Jacobi update reads.
    target_logits: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    name: str

    def max_tokens(self, gamma: int) -> int:
        """The most draft tokens (chain length or tree nodes) one proposal holds: sizes the caches."""
        ...

    def prefill(self, state: DecodeState) -> None: ...

    def propose(self, state: DecodeState, k: int) -> Proposal: ...

    def commit(self, state: DecodeState, result: VerifyResult) -> None: ...


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


def empty_proposal(state: DecodeState) -> Proposal:
    return Proposal(tokens=torch.zeros(state.batch_size, 0, dtype=torch.long, device=state.device))

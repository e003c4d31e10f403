"""`lookahead`: Jacobi iteration over a window of future positions plus an n-gram pool built from its
trajectories (after Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"), all verified in the target's one forward per step.

Per row, each step proposes a tree rooted at the pending token:
- the window: W guesses for the next W positions, as one chain. The target's argmax after each
  window prefix (read from the same verify forward, rejected positions included) is the next Jacobi
  iterate of the window, shifted past whatever was accepted;
- up to G guesses from the pool: (N-1)-token continuations stored under the pending token.
The pool is filled with n-grams of the Jacobi trajectories, the diagonals (iterate j at position p,
iterate j+1 at p+1, ...), each token predicted by the target after the one before it, and with the
n-grams of the text so far (prompt lookup's source). Chains are merged into a trie, so siblings are
distinct; nodes are deterministic (q = None), which keeps tree verification lossless.

This runs the Jacobi window as a draft chain (one level per step) instead of the paper's 2D window
of N-1 levels in the forward; the n-gram trajectories span the last N-1 steps instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Verified, host_tree_proposal, register
from specdec.sampling import greedy_tokens


@dataclass(frozen=True)
class LookaheadConfig:
    window: int = 4  # W: Jacobi window (future positions guessed per step)
    ngram: int = 4  # N: n-gram size of the pool (key + N-1 tokens)
    guesses: int = 3  # G: pool continuations verified per step
    pool_per_key: int = 8  # continuations kept per key token (most recent first)


@dataclass
class RowState:
    window: list[int]  # guesses for positions L .. L+W-1 (L = tokens so far; the pending token is at L-1)
    iterates: deque = field(default_factory=deque)  # recent windows as {position: token}
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    window_nodes: list[int] = field(default_factory=list)  # block index of each window node, last step
    indexed_upto: int = 0  # text n-grams already pooled up to this length


def add_to_pool(pool: dict, gram: tuple[int, ...], cap: int) -> None:
    key, rest = gram[0], gram[1:]
    entries = pool.setdefault(key, [])
    if rest in entries:
        entries.remove(rest)
    entries.insert(0, rest)
    del entries[cap:]


class LookaheadDrafter:
    """Per slot a RowState on the host (`batch.draft`, keyed by slot): the pool and the Jacobi window
    are Python structures, so this drafter reads the rows' tokens back in every step it drafts in and its
    steps run eagerly (graphable = False). It is not told of a step that drafted nothing (step.tell); its
    next proposal pools the text of such steps."""

    name = "lookahead"
    graphable = False

    def __init__(self, config: LookaheadConfig, seed: int = 0) -> None:
        self.config = config
        self.rng = np.random.default_rng(seed)

    def shape(self, gamma: int) -> DraftShape:
        c = self.config
        return DraftShape(width=c.window + c.guesses * (c.ngram - 1), depth=min(gamma, max(c.window, c.ngram - 1)),
                          tree=True)

    def attach(self, batch) -> None:
        batch.draft = {}

    def join(self, batch, slots: Tensor, hidden: Tensor) -> None:
        for slot in slots.tolist():
            tokens = row_tokens(batch, slot)
            batch.draft[slot] = RowState(window=self.fill([], tokens, self.config.window))
            self.index_text(batch.draft[slot], tokens)

    def fill(self, window: list[int], tokens: list[int], size: int) -> list[int]:
        """Pad a window to `size` with tokens drawn from the text so far (the paper starts from random ones)."""
        extra = size - len(window)
        return window + ([int(t) for t in self.rng.choice(tokens, size=extra)] if extra > 0 else [])

    def index_text(self, row: RowState, tokens: list[int]) -> None:
        N = self.config.ngram
        for end in range(max(row.indexed_upto, N), len(tokens) + 1):
            add_to_pool(row.pool, tuple(tokens[end - N : end]), self.config.pool_per_key)
        row.indexed_upto = len(tokens) + 1

    def propose(self, batch, gamma: int, u: Tensor | None) -> Proposal:
        shape = self.shape(gamma)
        trees = {}  # per slot: the row's trie (tokens, parents)
        active = batch.active.tolist()
        for slot, row in rows_in_view(batch):
            row.window_nodes = []
            if not active[slot]:
                continue
            text = row_tokens(batch, slot)
            self.index_text(row, text)  # the text of the steps it drafted nothing in (not told of them: step.tell)
            tokens, parents, row.window_nodes = self.row_trie(row, text[-1], shape.depth)
            trees[slot] = tokens, parents
        return host_tree_proposal(trees, batch.capacity, shape.width, shape.depth, 1 + self.config.guesses, batch.device)

    def row_trie(self, row: RowState, root: int, depth: int) -> tuple[list[int], list[int], list[int]]:
        """Merge the window chain and the pool's guesses into one trie under the root: (tokens, parents,
        block index of each window node)."""
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        tokens, parents = [], []

        def insert(chain) -> list[int]:
            parent, path = -1, []
            for token in chain[:depth]:
                node = children.get((parent, token))
                if node is None:
                    node = children[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                path.append(node)
                parent = node
            return path

        window_path = insert(row.window)
        for guess in row.pool.get(root, [])[: self.config.guesses]:
            insert(guess)
        return tokens, parents, [n + 1 for n in window_path]  # block index = node index + 1

    def commit(self, batch, verified: Verified) -> None:
        argmax = greedy_tokens(verified.logits).cpu()  # [B, T] the target's next token after each block entry
        emitted = verified.kept.tolist()
        for slot, row in rows_in_view(batch):
            window_nodes, row.window_nodes = row.window_nodes, []  # this step's only: a step may skip proposing
            if not emitted[slot]:
                continue
            tokens = row_tokens(batch, slot)
            if not window_nodes:
                self.index_text(row, tokens)
                continue
            L_old = len(tokens) - emitted[slot]  # tokens before this step's emission (pending at L_old - 1)
            # the next Jacobi iterate: after window prefix w_1..w_{i-1} (block 0 = the root) the target says...
            prefixes = [0] + window_nodes[:-1]
            iterate = {L_old + i: int(argmax[slot, node]) for i, node in enumerate(prefixes)}
            self.harvest(row, iterate)
            L = len(tokens)
            shifted = [iterate[p] for p in range(L, L_old + len(prefixes)) if p in iterate]
            row.window = self.fill(shifted, tokens, self.config.window)
            self.index_text(row, tokens)

    def harvest(self, row: RowState, iterate: dict[int, int]) -> None:
        """Pool the diagonals that end in this iterate: iterate j-N+2 at p, ..., this one at p+N-2."""
        N = self.config.ngram
        row.iterates.append(iterate)
        while len(row.iterates) > N - 1:
            row.iterates.popleft()
        if len(row.iterates) < N - 1:
            return
        for p in row.iterates[0]:
            gram = [row.iterates[j].get(p + j) for j in range(N - 1)]
            if None not in gram:
                # N-1 tokens of the trajectory; key = the first, and one more token per extra level
                add_to_pool(row.pool, tuple(gram), self.config.pool_per_key)


def rows_in_view(batch) -> list[tuple[int, RowState]]:
    """(slot, state) of the rows `batch` covers. The state dict is shared by a batch and its views of
    the first n slots (the server's buckets); a slot freed earlier keeps its state until a new row
    joins there, and may lie beyond a smaller view."""
    return [(slot, row) for slot, row in batch.draft.items() if slot < batch.capacity]


def row_tokens(batch, slot: int) -> list[int]:
    """A row's tokens so far, read back from the device."""
    return batch.tokens[slot, : int(batch.length[slot])].tolist()


@register("lookahead")
def build(target, options: DrafterOptions) -> LookaheadDrafter:
    fields = LookaheadConfig.__dataclass_fields__
    return LookaheadDrafter(LookaheadConfig(**{k: v for k, v in options.extra.items() if k in fields}))

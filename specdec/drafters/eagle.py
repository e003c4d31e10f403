"""`eagle`: EAGLE-2 drafting (Li et al. 2024) with a trained EagleHead on the target's features.

Before it drafts, the head has been fed the pairs (target feature at t, token t+1) of every kept
position, which leaves it with a predicted feature for the pending token (the root). Then it grows a tree level by level: expand the `frontier` most confident nodes (highest cumulative draft
log-probability), each giving its `branch` most likely children, for `depth` levels; finally keep the
`total_tokens` most confident nodes (a child never scores above its parent, so the kept set is a
tree). Nodes are deterministic top-k picks (q = None): tree verification stays lossless.

Prompt lookup grafted on (`lookup` > 0; on by default, GPU_LOOKUP / CPU_TREE's tokens): the continuation `ngram` would propose
(drafters/ngram.py, on the device) joins the tree as one more branch, merged where the tree already
holds its first tokens (`graft_chain`), so a row that copies from its prompt or repeats itself (a summary,
a quoted passage, code) can accept what the head, trained on other text, would not have guessed. Still
deterministic nodes with distinct siblings, so still lossless; the chain is at most `depth` long, so a
step never keeps more than depth + 1 tokens (what a chunked catch-up's width covers: chunk_width).

Per-slot state (`EagleState`): the head's KV cache, the head's predicted feature for the pending
token (the root of the next tree), and the target's features by position. With L tokens in a row, the
head has been fed the pairs for positions 0 .. L - 2 when it drafts; the tree's entries are written
after them and rolled back at the end of propose. The head is fed lazily (catch_up.py): `commit`, at
every step, only stores the target's features of the kept entries, and `propose`, which runs only when
the step drafts, first feeds each running row the pairs from its head-cache length up to L - 2
(`catch_up`: whatever the steps since its last draft kept), which leaves the root. A step at gamma 0
runs no head forward. How the pairs are fed depends on the stepper:

- eager stepper on the CPU (`catches_up(batch)`), in gaps: `join` stores the prompt's features and
  feeds nothing; a catch-up feeds each row exactly its gap (the prompt, at its first draft).
- any other stepper (graphed ones, and eager ones on a GPU), in chunks: `join` runs the head over the
  prompt; a catch-up is one fixed-width forward (`chunk_width`: at least depth + 1, what a drafting step
  keeps), and the host runs more before a propose after a long stretch at gamma 0 (`Lag`, run by
  Stepper.launch), so every shape is fixed by the tree configuration: propose and commit are captured
  in CUDA graphs.

On an H200 (bf16, default model) the head fed at every commit made a gamma-0 step cost about 5 % more
than a plain one, which out of domain, where the cost policy hardly drafts, held EAGLE below plain
(docs/design.md, "Lazy drafter state").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.config import NgramConfig
from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Verified, register
from specdec.drafters.catch_up import Lag, catches_up, chunk_width, feed_chunk, feed_gaps
from specdec.drafters.ngram import find_continuations, ngram_config
from specdec.drafters.shipped import trained_folder
from specdec.errors import UserError
from specdec.kv_cache import KVCache
from specdec.models import fused
from specdec.models.eagle import EagleHead, load_eagle_head
from specdec.sampling import topk_log_probs
from specdec.verify import TreeSpec, depth_bound


# On a GPU a verify forward of 24 tokens costs little more than one of 10, so a wider tree's extra
# accepted tokens are nearly free. benchmarks/eagle_tree_sweep.py, H200, bf16, default pair, gsm8k-eval,
# depth 5, x plain: 4 prompts x 128 tokens: 10 nodes 1.45x (tau 3.42), 16 1.47x, 24 1.53x (tau 3.85);
# 10 prompts x 256: 10 nodes 1.52x (tau 3.46), 24 1.55x (3.85), 32 1.63x (3.92), 48 1.61x (3.94).
# 24 and 32 are within the runs' noise of each other; the smaller tree costs less under batching.
# Later (H200, torch 2.11, 10 prompts x 128, depth 5, one run): 16 nodes 2.08x (tau 3.72), 24 2.04x (3.86),
# 32 2.07x (3.91), 48 2.04x (3.93): alike for one row, and a server verifies B x nodes tokens a step.
# There, 16 nodes at depth 5 served 1.80-1.97x `off` at 16-64 clients; 24 at depth 4 had served 1.52x at 32
# (another session, so not side by side). Deeper and wider (`9e67dc2`, 10 x 256, gamma 7): 64 nodes, depth 7,
# frontier 8 tau 4.85 at 2.31x against 16 / 5 / 4's 3.94 at 2.21x; but on `mixed` (20 x 128) tau is
# 1.55-1.57 for every shape and the wide tree costs (0.79x against 0.92x): kept.
GPU_TOTAL_TOKENS = 16
# The prompt lookup grafted onto the tree by default (`lookup`; docs/design.md, "Prompt lookup grafted onto an
# EAGLE tree"). H200, bf16, 16 nodes, depth 5, frontier 4, `eagle_tree_sweep.py`: on `mixed` (23 x 128) the then shipped
# 240k-token head went from 0.95x plain (tau 1.58) to 1.79x (3.63) with 5 grafted tokens and 1.69x (3.17) with 3; on
# gsm8k-eval (10 x 256) 2.22x with and without (tau 3.94 -> 4.22). A GPU verifies the extra nodes for little more.
GPU_LOOKUP = 5
# On the CPU a verified node costs a good part of a decode step (a compute-bound verify), so a chain (one node
# expanded per level, its best child) pays there and a tree does not; a grafted lookup pays out of domain and
# costs little in it. 2-core CPU, `eagle_tree_sweep.py`, the shipped (2M-token) head, depth 5,
# medians over gsm8k-eval 10 x 256 and mixed 23 x 128, x plain:
# - native Q4_1 target (its products dequantise every weight): chain, lookup 0 -> 3: gsm8k-eval 1.14x -> 1.13x,
#   mixed 0.56x -> 0.95x (lookup 5 gave mixed 0.89x, an earlier run: each grafted node costs there). Earlier, the
#   240k head, 4 x 128: chain depth 2 1.20, 3 1.17, 4 1.10; a 4-node tree 1.10; the 10-node tree 0.88;
# - float32 target (`--gguf dequantize`): chain with lookup 3 gsm8k-eval 1.72x, mixed 1.35x; the 10-node tree
#   (frontier 4, branch 4) with lookup 3 1.59x and 1.19x, without 1.65x and 0.75x.
CPU_TREE = {"frontier": 1, "branch": 1, "lookup": 3}


@dataclass(frozen=True)
class EagleTreeConfig:
    depth: int = 5  # levels grown (the engine's gamma caps it)
    branch: int = 4  # children taken per expanded node
    frontier: int = 4  # nodes expanded per level
    # Nodes verified per step: GPU_TOTAL_TOKENS on a GPU; on the CPU the default tree is a chain (CPU_TREE). 10
    # was the best of 4-15 on a 2-core CPU before the C layer path made verify blocks compute-bound there.
    total_tokens: int = 10
    # Prompt-lookup tokens grafted onto the tree as one more branch (at most depth; 0: none); by default
    # GPU_LOOKUP on a GPU, CPU_TREE's on the CPU (tree_config).
    lookup: int = 0

    def chain(self, depth: int) -> int:
        """Prompt-lookup tokens grafted onto a tree of `depth` levels."""
        return min(self.lookup, depth)

    def candidates(self, depth: int) -> int:
        """Nodes a tree of `depth` levels chooses from (as EagleDrafter.grow builds them)."""
        level = total = self.branch
        for _ in range(2, depth + 1):
            level = min(self.frontier, level) * self.branch
            total += level
        return total


@dataclass
class EagleState:
    cache: KVCache  # the head's, one row per slot
    root: Tensor  # [B, D] the head's feature for each row's pending token
    features: Tensor  # [B, S + depth, Dm] the target's feature at each position, to feed (past S: scratch, keep_features)
    lag: Lag | None = None  # a chunked catch-up's host-side bound; None: in gaps (catch_up.py)


class EagleDrafter:
    """Drafts with an EAGLE head (`eagle`) or an EAGLE-3 head (`eagle3`, models/eagle3.py): both take the
    target's features through `head.project` at committed positions and their own outputs in the tree."""

    graphable = True

    def __init__(self, target, head: EagleHead, tree: EagleTreeConfig, lookup: NgramConfig = NgramConfig()) -> None:
        self.name = head.kind
        problem = head.mismatch(target)
        if problem:
            raise UserError(f"this {head.kind} head was trained for another target ({problem})")
        self.feature_layers = head.feature_layers  # what the step hands join and commit (base.target_features)
        self.head = head.attach(target)
        self.tree = tree
        self.lookup = lookup  # the n-gram sizes the grafted chain matches (tree.lookup > 0)

    def shape(self, gamma: int) -> DraftShape:
        depth = min(self.tree.depth, gamma)
        width = min(self.tree.total_tokens, self.tree.candidates(depth)) + self.tree.chain(depth)
        return DraftShape(width=width, depth=depth, tree=True)

    def attach(self, batch) -> None:
        """The head's cache, with room for the tree's scratch entries and a catch-up's padding; the features."""
        B, D = batch.capacity, self.head.config.hidden_size
        width = chunk_width(self.tree.depth)
        cache = self.head.new_cache(B, batch.max_len + max(self.tree.depth * self.tree.frontier, width), static=batch.static)
        dtype = self.head.layers[0].post_attention_layernorm.weight.dtype
        root = torch.zeros(B, D, dtype=dtype, device=batch.device)
        features = torch.zeros(B, batch.max_len + self.tree.depth, self.head.feature_width, dtype=dtype, device=batch.device)
        batch.draft = EagleState(cache, root, features, None if catches_up(batch) else Lag(width))

    def join(self, batch, slots: Tensor, hidden: Tensor) -> None:
        """In gaps: keep the prompts' features for the first catch-up. In chunks: feed the prompts' pairs
        (feature at t, token t+1), the last one pairing with the first token."""
        state, lengths = batch.draft, batch.prompt_length[slots]  # [n]
        n, T = hidden.shape[:2]
        if state.lag is None:
            state.features[slots, :T] = hidden.to(state.features.dtype)
            state.cache.lengths.index_fill_(0, slots, 0)
            return
        scratch = self.head.new_cache(n, T, static=True)  # its T slots are all written: no overflow check (a host wait)
        positions = torch.arange(T, device=hidden.device).expand(n, T)
        out = self.head.features(self.head.project(hidden), batch.tokens[slots, 1 : T + 1], positions, scratch)  # [n, T, D]
        state.cache.k[:, slots, :, :T] = scratch.k
        state.cache.v[:, slots, :, :T] = scratch.v
        state.cache.lengths[slots] = lengths
        state.root[slots] = out[torch.arange(n, device=hidden.device), lengths - 1]

    def commit(self, batch, verified: Verified) -> None:
        """Keep the target's features of the kept entries, for the next catch-up."""
        keep_features(batch.draft.features, verified.hidden, verified.kept, batch.length)

    def catch_up(self, batch) -> None:
        """Feed every running row the pairs from its head-cache length up to L - 2 (in gaps: all of them; in
        chunks: up to Lag.width) and take the root from the last."""
        state = batch.draft
        gap = torch.where(batch.active, batch.length - 1 - state.cache.lengths, 0).clamp(min=0)  # [B] pairs to feed

        def feed(cache: KVCache, rows: slice, positions: Tensor, last: Tensor) -> Tensor:
            top = state.features.shape[1] - 1  # (a row's positions past its gap are scratch)
            features = state.features[rows].gather(1, positions.clamp(max=top)[..., None].expand(-1, -1, state.features.shape[-1]))
            features = self.head.project(features)  # [n, w, D]
            next_tokens = batch.tokens[rows].gather(1, (positions + 1).clamp(max=batch.max_len - 1))  # [n, w]
            out = self.head.features(features, next_tokens, positions, cache)  # [n, w, D]
            return out[torch.arange(out.shape[0], device=out.device), last]  # [n, D]

        if state.lag is None:
            fed = feed_gaps(state.cache, gap, feed)
        else:
            fed = feed_chunk(state.cache, gap, feed, state.lag.width)
        if fed is not None:
            state.root.copy_(torch.where((gap > 0)[:, None], fed, state.root))

    @torch.inference_mode()
    def propose(self, batch, gamma: int, u: Tensor | None) -> Proposal:
        depth = self.shape(gamma).depth
        self.catch_up(batch)
        tokens, parents = self.grow(batch.draft.root, batch, depth)
        bound, chain = depth_bound(depth, self.tree.depth, batch.device), self.tree.chain(depth)
        if not chain:
            return Proposal(tokens=tokens, tree=TreeSpec(parents, None, bound, self.tree.branch))
        drafts, found = find_continuations(batch.tokens, batch.length, chain, self.lookup.max_ngram, self.lookup.min_ngram)
        tokens, parents, num_nodes = fused.run_compiled(graft_chain, tokens, parents, drafts, found)
        return Proposal(tokens=tokens, tree=TreeSpec(parents, num_nodes, bound, self.tree.branch + 1))

    def grow(self, root_feature: Tensor, batch, depth: int) -> tuple[Tensor, Tensor]:
        """EAGLE-2 dynamic tree: (tokens [B, N], parents [B, N]) in topological order. Each level's
        candidates have a fixed place (Level), so between two head forwards the bookkeeping is one compiled
        function (fused.run_compiled: a few kernels, because nothing in it sorts, `top_indices`), and the
        children's top-k runs as two Triton kernels on CUDA (sampling.topk_log_probs)."""
        cfg, cache = self.tree, batch.draft.cache
        base = cache.lengths.clone()  # [B] committed head slots (the root's pair is the last)
        head, d2t = self.head, self.head.d2t
        # a node's head input is (its parent's feature, its token), at its parent's position; the root is
        # the pending token, at position L-1 (0 for a slot no row has held yet: it flows through masked, and
        # position -1 would index before the rotary table, an illegal address on CUDA)
        root_pos = (batch.length - 1).clamp(min=0)
        features, frontier, levels = root_feature[:, None], None, []  # features [B, P, D]: the expanded nodes'
        for level in range(1, depth):
            children = topk_log_probs(head.draft_logits(features), cfg.branch)  # ([B, P, K] log q, draft ids)
            offset = sum(c.tokens.shape[1] for c in levels)
            candidates, frontier = fused.run_compiled(next_frontier, *children, frontier, features, d2t, root_pos,
                                                      offset, level, cfg.frontier)
            levels.append(candidates)
            features = head.features(frontier.features, frontier.tokens, frontier.positions, cache,
                                     mask=frontier.ancestors[:, -frontier.tokens.shape[1]:])  # [B, F, D]
        children = topk_log_probs(head.draft_logits(features), cfg.branch)
        cache.lengths.copy_(base)  # the tree's entries are scratch
        return fused.run_compiled(finish_tree, *children, frontier, d2t, levels, cfg.total_tokens)


def keep_features(features: Tensor, hidden: Tensor, kept: Tensor, length: Tensor) -> None:
    """Store the target's features of the entries each row kept (hidden [B, W, Dm]: the old pending token and
    its accepted drafts first; kept [B], 0 for a row not in the step) at their positions L - kept - 1 ..
    L - 2 (length [B]: L after the step), in features [B, S + W - 1, Dm]; every other entry keeps its bits
    (a row not in the step must not change). On the CPU a slice copy per row (the host reads kept without
    waiting for a device), elsewhere graph-safe and compiled (`keep_features_indexed`; its eight kernels
    eagerly made a gamma-0 step 2.5 % dearer than a plain one on an H200): on the 2-core CPU the slice
    copies took 10 us a step at one row and 111 us at 16, the indexed write 42 and 122."""
    if features.device.type != "cpu":
        fused.run_compiled(keep_features_indexed, features, hidden, kept, length)
        return
    for b, (k, L) in enumerate(zip(kept.tolist(), length.tolist())):
        if k:
            features[b, L - k - 1 : L - 1] = hidden[b, :k]


def keep_features_indexed(features: Tensor, hidden: Tensor, kept: Tensor, length: Tensor) -> None:
    """keep_features as a gather and one indexed write: no host synchronisation, fixed shapes."""
    B, W = hidden.shape[:2]
    offsets = torch.arange(W, device=hidden.device)
    positions = ((length - kept - 1)[:, None] + offsets).clamp(min=0)  # [B, W] (a slot never held: 0)
    rows = torch.arange(B, device=hidden.device)[:, None].expand(B, W)
    new = torch.where((offsets < kept[:, None])[..., None], hidden.to(features.dtype), features[rows, positions])
    features.index_put_((rows, positions), new)


@dataclass
class Level:
    """One level's candidates, [B, n] each, frontier-major (the first level: the root's `branch` children;
    a later one: `branch` children of each of the F nodes expanded, n = F * branch): target token ids,
    cumulative draft log-probabilities, and parents as indices over all levels' candidates in order (-1: the
    root)."""

    tokens: Tensor
    scores: Tensor
    parents: Tensor


@dataclass
class Frontier:
    """The F most confident candidates of the last level, expanded next; their head-cache entries are the
    last F of `ancestors`."""

    scores: Tensor  # [B, F]
    index: Tensor  # [B, F] their indices over all levels' candidates (their children's parent)
    tokens: Tensor  # [B, F]
    features: Tensor  # [B, F, D] their parents' head features (the head's input for expanding them)
    positions: Tensor  # [B, F] their head inputs' position: their parents' (the root's position + level - 1)
    ancestors: Tensor  # [B, E, E] which expanded entries are ancestors of (or are) each other: the head's mask


def add_level(child_score: Tensor, child_pick: Tensor, expanded: Frontier | None, d2t: Tensor) -> Level:
    """The children of the nodes just expanded (child_score, child_pick [B, P, K]: their draft log-probabilities
    and draft-vocabulary ids; expanded None: the root, P = 1)."""
    B, P, K = child_pick.shape
    tokens = d2t[child_pick.flatten(1)]  # [B, P*K]
    if expanded is None:
        return Level(tokens, child_score.flatten(1), torch.full_like(tokens, -1))
    scores = (child_score + expanded.scores[..., None]).flatten(1)
    return Level(tokens, scores, expanded.index[..., None].expand(B, P, K).flatten(1))


def choose_frontier(level: Level, offset: int, features: Tensor, expanded: Frontier | None, root_pos: Tensor,
                    depth: int, F: int) -> Frontier:
    """The F most confident of `level` (the depth-th, its first candidate at `offset` over all levels), with
    their parents' features (features [B, P, D]: the head's, of the P nodes whose children the level holds)
    and their entries' ancestor sets (each one's parent's set and itself)."""
    B, n = level.scores.shape
    P = features.shape[1]
    rows = torch.arange(B, device=features.device)[:, None]
    chosen = top_indices(level.scores, F)  # [B, F] within the level
    parent = chosen // (n // P)  # [B, F] which of the P expanded nodes (the last P entries) each one's parent is
    E0 = 0 if expanded is None else expanded.ancestors.shape[1]
    ancestors = torch.zeros(B, E0 + F, E0 + F, dtype=torch.bool, device=features.device)
    if E0:  # (the first level's parent is the root: no entry)
        ancestors[:, :E0, :E0] = expanded.ancestors
        ancestors[:, E0:, :E0] = expanded.ancestors[rows, E0 - P + parent]
    ancestors[:, E0:, E0:] = torch.eye(F, dtype=torch.bool, device=features.device)
    positions = (root_pos + (depth - 1))[:, None].expand(B, F).contiguous()  # [B, F]
    return Frontier(level.scores.gather(1, chosen), offset + chosen, level.tokens.gather(1, chosen),
                    features[rows, parent], positions, ancestors)


def next_frontier(child_score: Tensor, child_pick: Tensor, expanded: Frontier | None, features: Tensor, d2t: Tensor,
                  root_pos: Tensor, offset: int, depth: int, frontier: int) -> tuple[Level, Frontier]:
    """One compiled step between two head forwards: the depth-th level (the children of the nodes expanded,
    features [B, P, D] their head features) and the nodes of it to expand next."""
    level = add_level(child_score, child_pick, expanded, d2t)
    return level, choose_frontier(level, offset, features, expanded, root_pos, depth, min(frontier, level.scores.shape[1]))


def finish_tree(child_score: Tensor, child_pick: Tensor, expanded: Frontier | None, d2t: Tensor, levels: list[Level],
                total: int) -> tuple[Tensor, Tensor]:
    """The last level, then the `total` best candidates of all levels as a tree (select_tree)."""
    levels = [*levels, add_level(child_score, child_pick, expanded, d2t)]
    depths = torch.cat([torch.full_like(c.parents, d) for d, c in enumerate(levels, 1)], 1)
    cat = lambda name: torch.cat([getattr(c, name) for c in levels], 1)  # noqa: E731
    return select_tree(cat("tokens"), cat("scores"), cat("parents"), depths, total)


def select_tree(tokens: Tensor, scores: Tensor, parents: Tensor, depths: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Keep the `total` best candidates (a child scores below its parent, ties broken by depth, so the
    kept set is closed under parents); return them breadth-first with re-indexed parents.
    tokens, scores, parents (candidate index, -1 = root), depths: [B, C]."""
    B, C = scores.shape
    total = min(total, C)
    kept = rank_order(scores - 1e-4 * depths) < total  # [B, C]; 1e-4: strictly below the parent even when q = 1
    order = depths * C + torch.arange(C, device=scores.device)  # [B, C] breadth first, then candidate order
    earlier = kept[:, None, :] & (order[:, None, :] < order[:, :, None])  # [B, C, C]: kept j comes before i
    new_index = torch.where(kept, earlier.sum(-1), -1)  # [B, C] node index of each kept candidate
    keep = pick_ranked(new_index, total)  # [B, N] candidate index of each node
    kept_parents = parents.gather(1, keep)  # [B, N] candidate index
    tree_parents = torch.where(kept_parents >= 0, new_index.gather(1, kept_parents.clamp(min=0)), -1)
    return tokens.gather(1, keep), tree_parents


def graft_chain(tokens: Tensor, parents: Tensor, chain: Tensor, found: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A tree (tokens, parents [B, N], topological order, distinct siblings) with a chain [B, k] from the root
    grafted on: its first tokens follow the tree's nodes while the tree holds them, the rest become new nodes
    after the tree's N, each under the one before. Returns (tokens, parents [B, N + k], num_nodes [B]); the
    unused places (and every chain place of a row with found [B] False) are padding under the root."""
    B, N = tokens.shape
    k = chain.shape[1]
    index, places = torch.arange(N, device=tokens.device), torch.arange(k, device=tokens.device)
    at = torch.full_like(found, -1, dtype=parents.dtype)  # [B] the node holding the chain so far (-1: the root)
    added = torch.zeros_like(at)  # [B] new nodes so far
    new_tokens, new_parents = torch.zeros_like(chain), torch.full_like(chain, -1, dtype=parents.dtype)  # [B, k]
    for i in range(k):
        same = (parents == at[:, None]) & (tokens == chain[:, i : i + 1])  # [B, N]: at most one (distinct siblings)
        held = same.any(1)
        place = (places == added[:, None]) & ~held[:, None]  # [B, k]: where a new node goes
        new_tokens = torch.where(place, chain[:, i : i + 1], new_tokens)
        new_parents = torch.where(place, at[:, None], new_parents)
        at = torch.where(held, (same * index).sum(1), N + added)
        added = added + (~held).to(added.dtype)
    new_tokens, new_parents = torch.where(found[:, None], new_tokens, 0), torch.where(found[:, None], new_parents, -1)
    return torch.cat([tokens, new_tokens], 1), torch.cat([parents, new_parents], 1), N + torch.where(found, added, 0)


def rank_order(x: Tensor) -> Tensor:
    """[..., C] each entry's place when x [..., C] is sorted largest first, the lower index first among equal
    values (0 for the largest), NaN as -inf (a slot no row holds flows through a step with whatever its
    buffers hold: its places must stay distinct, or pick_ranked would add indices up past C). By counting,
    over [..., C, C], the entries placed before each: a tree's candidate sets are small, and unlike a sort
    this compiles into fused kernels (torch.topk and argsort are kernels of their own, and each splits a
    compiled function's kernels around it)."""
    C = x.shape[-1]
    x = torch.where(x.isnan(), float("-inf"), x)
    index = torch.arange(C, device=x.device)
    a, b = x[..., :, None], x[..., None, :]  # entry i, entry j
    before = (b > a) | ((b == a) & (index[None, :] < index[:, None]))  # [..., C, C]: j is placed before i
    return before.sum(-1)


def pick_ranked(place: Tensor, k: int) -> Tensor:
    """[..., k] the index of the entry at each place 0..k-1 (place [..., C]: distinct places, or -1)."""
    C = place.shape[-1]
    at = place[..., None, :] == torch.arange(k, device=place.device)[:, None]  # [..., k, C]
    return (at * torch.arange(C, device=place.device)).sum(-1)


def top_indices(x: Tensor, k: int) -> Tensor:
    """[..., k] indices of the k largest entries of x [..., C], largest first (the lower index first among
    equal values), without a sort (rank_order)."""
    return pick_ranked(rank_order(x), k)


def tree_config(target, options: DrafterOptions) -> EagleTreeConfig:
    """The tree the options give, over this device's defaults (GPU_TOTAL_TOKENS and GPU_LOOKUP, CPU_TREE)."""
    given = {k: v for k, v in options.extra.items() if k in EagleTreeConfig.__dataclass_fields__}
    device = next(target.parameters()).device
    defaults = {"total_tokens": GPU_TOTAL_TOKENS, "lookup": GPU_LOOKUP} if device.type == "cuda" else CPU_TREE
    return EagleTreeConfig(**defaults | given)


@register("eagle")
def build(target, options: DrafterOptions) -> EagleDrafter:
    head = options.extra.get("eagle_head")
    if head is None:
        head = load_eagle_head(trained_folder("eagle", target, options.extra.get("eagle_path"), "--eagle-head"))
    return EagleDrafter(target, head, tree_config(target, options), ngram_config(options))

"""Verification of draft tokens against the target: pure tensor functions, no models or caches.

Conventions (names as in Leviathan et al. 2023): the target's distribution is p, the drafter's q,
gamma = k draft tokens per row. Row b proposed num_drafted[b] <= k tokens (the rest is padding).
Each row emits num_accepted[b] + 1 tokens: the accepted drafts, then either the recovered token
(sampled from norm(max(p - q, 0)) at the first rejection) or the bonus token (sampled from p after
the last draft when every draft was accepted).

Every function here is graph-safe: no host synchronisation, no data-dependent shapes, loops bounded
by Python ints only (k, a tree's static max_depth and max_children), so a decode step can run inside
a CUDA graph capture. Randomness comes in as uniforms u in [0, 1) (`sampling.uniforms`), one per
acceptance test and one per sampled token, at documented positions, so a row's outcome depends only
on its own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.sampling import RowSampling, greedy_tokens, sample, sampled_probs


@dataclass
class VerifyResult:
    tokens: Tensor  # [B, k+1] emitted tokens; row b's first num_accepted[b] + 1 are valid
    num_accepted: Tensor  # [B] accepted draft tokens (excludes the recovered / bonus token)


def count_accepted(accept: Tensor, num_drafted: Tensor | None) -> Tensor:
    """accept [B, k] bool -> [B] length of the all-accepted prefix, capped at num_drafted [B]: the first
    rejected position, k if none. A min, not a cumprod: a scan compiled with other work can read its own
    results back wrong (docs/design.md, "Scans in compiled code")."""
    k = accept.shape[1]
    if k == 0:
        return accept.new_zeros(accept.shape[0], dtype=torch.long)
    position = torch.arange(k, device=accept.device)  # [k]
    if num_drafted is not None:
        accept = accept & (position < num_drafted[:, None])
    return torch.where(accept, k, position).amin(-1)


def remove_rejected(r: Tensor, q: Tensor) -> Tensor:
    """The distribution after a rejected draft: norm(max(r - q, 0)), rows [..., V]. Where that has no
    mass (r == q, so a rejection had probability zero) r itself is kept, to stay finite."""
    rest = (r - q).clamp_(min=0)
    mass = rest.sum(-1, keepdim=True)
    return torch.where(mass > 0, rest.div_(mass.clamp(min=1e-30)), r)


def one_hot(tokens: Tensor, V: int) -> Tensor:
    """tokens [B] -> [B, V] float32: the distribution of a deterministic draft."""
    return torch.zeros(*tokens.shape, V, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)


def take_row(x: Tensor, index: Tensor) -> Tensor:
    """x [B, T, V], index [B] -> [B, V]: x[b, index[b]] (a gather: no host sync)."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor, num_drafted: Tensor | None = None) -> VerifyResult:
    """draft_tokens [B, k], target_logits [B, k+1, V]: keep drafts while they equal the target's argmax."""
    k = draft_tokens.shape[1]
    target_tokens = greedy_tokens(target_logits)  # [B, k+1]
    num_accepted = count_accepted(draft_tokens == target_tokens[:, :k], num_drafted)
    # Accepted drafts equal the argmax, and the token after them is the argmax: emit the argmax row.
    return VerifyResult(tokens=target_tokens, num_accepted=num_accepted)


def rejection_sample(
    draft_tokens: Tensor,  # [B, k]
    q: Tensor | None,  # [B, k, V] draft distribution; None = deterministic draft (one-hot q)
    p: Tensor,  # [B, k+1, V] target distribution
    u: Tensor,  # [B, k+1] uniforms: u[:, j] tests draft j, u[:, k] draws the recovered / bonus token
    num_drafted: Tensor | None = None,  # [B]
) -> VerifyResult:
    """Speculative sampling: accept draft x with prob min(1, p(x)/q(x)); at the first rejection
    sample from norm(max(p - q, 0)); after k acceptances sample the bonus token from p."""
    B, k = draft_tokens.shape
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    num_accepted = count_accepted(u[:, :k] * q_draft < p_draft, num_drafted)  # [B]

    p_next = take_row(p, num_accepted)  # [B, V] target distribution after the accepted prefix
    if k > 0:
        limit = torch.full_like(num_accepted, k) if num_drafted is None else num_drafted
        rejected = num_accepted < limit  # [B] a draft was rejected (else: bonus)
        at = num_accepted.clamp(max=k - 1)  # [B]
        q_next = one_hot(draft_tokens.gather(1, at[:, None]).squeeze(1), p.shape[-1]) if q is None else take_row(q, at)
        p_next = torch.where(rejected[:, None], remove_rejected(p_next, q_next), p_next)
    next_token = sample(p_next, u[:, k])  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, k+1]
    return VerifyResult(tokens=tokens.scatter(1, num_accepted[:, None], next_token[:, None]), num_accepted=num_accepted)


def verify_chain(
    draft_tokens: Tensor,  # [B, k]
    q: Tensor | None,  # [B, k, V] (rows that sample); None = deterministic drafts
    logits: Tensor,  # [B, k+1, V] the target's logits
    sampling: RowSampling,
    u: Tensor | None,  # [B, k+1] as for rejection_sample (unused, may be None, when no row samples)
    num_drafted: Tensor | None,  # [B]
    any_sampled: bool,  # whether any row samples (the caller knows from the requests)
) -> VerifyResult:
    """Greedy verification for greedy rows (exactly `greedy_verify`'s result, whatever u), rejection
    sampling with each row's own parameters for the others. An all-greedy batch (any_sampled False)
    skips the probabilities entirely."""
    greedy = greedy_verify(draft_tokens, logits, num_drafted)
    if not any_sampled:
        return greedy
    sampled = rejection_sample(draft_tokens, q, sampled_probs(logits, sampling), u, num_drafted)
    g = sampling.greedy  # [B]
    return VerifyResult(tokens=torch.where(g[:, None], greedy.tokens, sampled.tokens),
                        num_accepted=torch.where(g, greedy.num_accepted, sampled.num_accepted))


# ---- Trees ------------------------------------------------------------------------------------------
# A tree proposal is N draft nodes per row, flattened in topological order. The target runs one
# forward over the block [root, node 1, ..., node N], where the root (block index 0) is the pending
# token; node i sits at block index i + 1, at RoPE position root + depth, and attends to its ancestors.
# Loops run over depth levels and sibling slots, bounded by the tree's static max_depth and
# max_children, never over nodes or data.


@dataclass
class TreeSpec:
    parents: Tensor  # [B, N] parent's node index, -1 = the root; parents[b, i] < i
    num_nodes: Tensor | None = None  # [B] valid nodes per row (padding nodes hang off the root, never accepted)
    max_depth: int | None = None  # static bound on every node's depth (root 0, its children 1); None = N
    max_children: int | None = None  # static bound on any entry's valid children; None = N

    def __post_init__(self) -> None:
        N = self.parents.shape[1]
        self.max_depth = N if self.max_depth is None else self.max_depth
        self.max_children = N if self.max_children is None else self.max_children

    @property
    def parent_blocks(self) -> Tensor:
        """[B, N+1] each block entry's parent block index (the root is its own parent)."""
        root = torch.zeros_like(self.parents[:, :1])
        return torch.cat([root, self.parents + 1], dim=1)

    def valid(self) -> Tensor:
        """[B, N] which nodes are real."""
        idx = torch.arange(self.parents.shape[1], device=self.parents.device)
        return torch.ones_like(self.parents, dtype=torch.bool) if self.num_nodes is None else idx < self.num_nodes[:, None]

    def depths(self) -> Tensor:
        """[B, N+1] depth of every block entry (root 0): one pass per level, each entry one deeper than
        its parent (after d passes every entry of depth <= d is right)."""
        parent = self.parent_blocks
        is_node = torch.arange(parent.shape[1], device=parent.device) > 0  # [N+1]
        depth = torch.zeros_like(parent)
        for _ in range(self.max_depth):
            depth = torch.where(is_node, depth.gather(1, parent) + 1, 0)
        return depth

    def ancestor_mask(self) -> Tensor:
        """[B, N+1, N+1] bool: entry j is an ancestor of (or is) entry i — the tree attention mask. Pass d
        marks every entry's d-th ancestor (the root is its own parent, so walks stop there)."""
        parent = self.parent_blocks
        B, T = parent.shape
        mask = torch.zeros(B, T, T, dtype=torch.bool, device=parent.device)
        up = torch.arange(T, device=parent.device).expand(B, T)  # [B, T] each entry's ancestor d levels up
        for _ in range(self.max_depth + 1):
            mask.scatter_(2, up[..., None], True)
            up = parent.gather(1, up)
        return mask


@dataclass
class TreeVerifyResult(VerifyResult):
    path: Tensor | None = None  # [B, max_depth+1] block indices of the kept entries (root first); valid up to num_accepted


def tree_uniforms_needed(tree: TreeSpec) -> int:
    """How many uniforms per row `tree_rejection_sample` (and `verify_tree`) consumes:
    u[:, d * max_children + s] tests the child in sibling slot s at depth level d (d < max_depth), and
    u[:, max_depth * max_children] draws the recovered / bonus token."""
    return tree.max_depth * tree.max_children + 1


def depth_bound(depth: int, deepest: int, device: torch.device) -> int:
    """A drafter's tree's static max_depth: on CUDA its deepest shape's, whatever the gamma; elsewhere the
    tree's own depth. On CUDA verification runs compiled (fused.run_compiled), and torch.compile traces
    the bound in, so one bound compiles verify_tree and tree_layout once per kind of batch rather than
    once per depth: 8 compiles instead of 32 over an EAGLE server's step shapes (gammas 1-4, buckets 1-32,
    greedy and sampled; counted with dynamo on a CPU). On the CPU they run eagerly, and each extra level
    costs: 0.1-0.3 ms greedy, up to 25 % of a sampled verification (2-core CPU, default vocabulary).
    The extra levels hold no node, so no row moves into them: greedy rows keep the same tokens, and
    sampled rows draw from the same distributions, though from uniforms at other lanes
    (tree_uniforms_needed)."""
    return deepest if device.type == "cuda" else depth


def children_table(tree: TreeSpec) -> Tensor:
    """[B, N+1, M] block indices of each entry's valid children in node order, -1 padded
    (M = tree.max_children; children beyond M are left out, which never breaks losslessness)."""
    parents = torch.where(tree.valid(), tree.parents + 1, -1)  # [B, N] parent block, -1 = padding node
    B, N = parents.shape
    M = tree.max_children
    earlier = torch.ones(N, N, dtype=torch.bool, device=parents.device).tril(-1)  # [i, j]: j < i
    rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)  # [B, N] index among siblings
    slot = torch.where((parents >= 0) & (rank < M), parents * M + rank, (N + 1) * M)  # [B, N]; the last slot: discarded
    kids = torch.full((B, (N + 1) * M + 1), -1, dtype=torch.long, device=parents.device)
    kids.scatter_(1, slot, torch.arange(1, N + 1, device=parents.device).expand(B, N))
    return kids[:, :-1].view(B, N + 1, M)


def longest_accepted(accepted: Tensor, tree: TreeSpec) -> tuple[Tensor, Tensor]:
    """The deepest accepted entry's path: accepted [B, N+1] (an entry only with its parent).
    Returns path [B, max_depth+1] (block index at each depth, 0 beyond the end) and num_accepted [B]."""
    B, T = accepted.shape
    depth, parent = tree.depths(), tree.parent_blocks  # [B, N+1] each
    score = torch.where(accepted, depth * T + (T - 1 - torch.arange(T, device=depth.device)), -1)  # deepest, then first
    node = score.argmax(-1, keepdim=True)  # [B, 1]
    num_accepted = depth.gather(1, node).squeeze(1)  # [B]
    path = torch.zeros(B, tree.max_depth + 1, dtype=torch.long, device=depth.device)
    for _ in range(tree.max_depth):  # walk up, writing each entry at its depth (the root stays 0)
        path.scatter_(1, depth.gather(1, node), node)
        node = parent.gather(1, node)
    return path, num_accepted


def tree_greedy_verify(node_tokens: Tensor, tree: TreeSpec, target_logits: Tensor) -> TreeVerifyResult:
    """node_tokens [B, N], target_logits [B, N+1, V]: the longest root-to-node path whose every token
    equals the target's argmax after its parent; emits that path then the target's next token."""
    argmax = greedy_tokens(target_logits)  # [B, N+1]
    parent = tree.parent_blocks  # [B, N+1]
    match = torch.cat([torch.ones_like(node_tokens[:, :1], dtype=torch.bool),
                       (node_tokens == argmax.gather(1, parent[:, 1:])) & tree.valid()], dim=1)  # [B, N+1]
    accepted = match
    for _ in range(tree.max_depth):  # after d passes an entry's flag covers its d nearest ancestors
        accepted = match & accepted.gather(1, parent)
    path, num_accepted = longest_accepted(accepted, tree)
    # Along an accepted path each token is the argmax after its parent: the argmaxes at the path emit it.
    return TreeVerifyResult(tokens=argmax.gather(1, path), num_accepted=num_accepted, path=path)


def tree_rejection_sample(
    node_tokens: Tensor,  # [B, N]
    q: Tensor | None,  # [B, N, V] distribution each node was drawn from; None = deterministic nodes
    tree: TreeSpec,
    p: Tensor,  # [B, N+1, V] target distribution after each block entry
    u: Tensor,  # [B, tree_uniforms_needed(tree)] uniforms, laid out as tree_uniforms_needed says
) -> TreeVerifyResult:
    """Multi-candidate speculative sampling (SpecInfer, Miao et al. 2024; EAGLE): at the current entry
    try its children in order, accepting child x with prob min(1, r(x)/q(x)), where r starts as the
    target's p there and loses each rejected sibling's q (r <- norm(max(r - q, 0))); move to an
    accepted child, or, when every child is rejected, emit the recovered token sampled from r (at a
    leaf, r = p: the bonus token). Vectorised over rows: one pass per depth level and sibling slot;
    every row still walking is at the same depth, so each level writes one static column. Deterministic
    nodes (q None) keep r unnormalised with its mass, so a rejection costs O(1) per row, not O(V)."""
    B, N = node_tokens.shape
    dev = p.device
    D, M = tree.max_depth, tree.max_children
    kids = children_table(tree)  # [B, N+1, M]
    tokens = torch.zeros(B, D + 1, dtype=torch.long, device=dev)
    path = torch.zeros(B, D + 1, dtype=torch.long, device=dev)
    entry = torch.zeros(B, dtype=torch.long, device=dev)  # current block entry per row
    walking = torch.ones(B, dtype=torch.bool, device=dev)  # not yet emitted its last token
    r = take_row(p, entry)  # [B, V] distribution at the current entry, less the rejected siblings (a copy of p)
    mass = r.sum(-1)  # [B] r's mass (deterministic nodes: r is kept unnormalised)
    for d in range(D):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        children = kids.gather(1, entry[:, None, None].expand(B, 1, M)).squeeze(1)  # [B, M] block indices, -1 = none
        for slot in range(M):
            child = children[:, slot]  # [B]
            trying = walking & ~moved & (child > 0)
            node = (child - 1).clamp(min=0)  # [B]
            x = node_tokens.gather(1, node[:, None]).squeeze(1)  # [B]
            r_x = r.gather(1, x[:, None]).squeeze(1)  # [B]
            if q is None:  # q(x) = 1: accept with prob r(x) / mass
                accept = trying & (u[:, d * M + slot] * mass < r_x)
                r, mass = remove_rejected_token(r, mass, x, trying & ~accept)
            else:
                q_node = take_row(q, node)  # [B, V]
                accept = trying & (u[:, d * M + slot] * q_node.gather(1, x[:, None]).squeeze(1) < r_x)
                r = torch.where((trying & ~accept)[:, None], remove_rejected(r, q_node), r)
            tokens[:, d] = torch.where(accept, x, tokens[:, d])
            path[:, d + 1] = torch.where(accept, child, path[:, d + 1])
            entry = torch.where(accept, child, entry)
            moved |= accept
        walking &= moved  # rows that rejected every child stop here, r holding the recovered distribution
        r = torch.where(moved[:, None], take_row(p, entry), r)
        mass = torch.where(moved, r.sum(-1), mass)
    num_accepted = (path[:, 1:] > 0).sum(-1)  # [B] levels moved down
    drawn = sample(r, u[:, D * M])  # [B] recovered token, or the bonus token after a leaf
    return TreeVerifyResult(tokens=tokens.scatter(1, num_accepted[:, None], drawn[:, None]),
                            num_accepted=num_accepted, path=path)


def remove_rejected_token(r: Tensor, mass: Tensor, x: Tensor, rejected: Tensor) -> tuple[Tensor, Tensor]:
    """remove_rejected for a deterministic draft x [B] (one-hot q): max(r - q, 0) is r without x. On an
    unnormalised r [B, V] (modified in place) with its mass [B]: zero r[x] and subtract it, where
    rejected [B]. Rejecting never empties r: a token holding all the mass is always accepted."""
    r_x = r.gather(1, x[:, None])  # [B, 1]
    r.scatter_(1, x[:, None], torch.where(rejected[:, None], 0.0, r_x))
    return r, torch.where(rejected, mass - r_x.squeeze(1), mass)


def verify_tree(
    node_tokens: Tensor,  # [B, N]
    q: Tensor | None,  # [B, N, V] (rows that sample); None = deterministic nodes
    tree: TreeSpec,
    logits: Tensor,  # [B, N+1, V] the target's logits
    sampling: RowSampling,
    u: Tensor | None,  # [B, tree_uniforms_needed(tree)] (unused, may be None, when no row samples)
    any_sampled: bool,
) -> TreeVerifyResult:
    """`verify_chain` for trees: `tree_greedy_verify` for greedy rows, `tree_rejection_sample` with each
    row's own parameters for the others; an all-greedy batch skips the probabilities."""
    greedy = tree_greedy_verify(node_tokens, tree, logits)
    if not any_sampled:
        return greedy
    sampled = tree_rejection_sample(node_tokens, q, tree, sampled_probs(logits, sampling), u)
    g = sampling.greedy  # [B]
    return TreeVerifyResult(tokens=torch.where(g[:, None], greedy.tokens, sampled.tokens),
                            num_accepted=torch.where(g, greedy.num_accepted, sampled.num_accepted),
                            path=torch.where(g[:, None], greedy.path, sampled.path))

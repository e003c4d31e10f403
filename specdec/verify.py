"""Verification of draft tokens against the target: pure tensor functions, no models or caches.

Conventions (names as in Leviathan et al. 2023): the target's distribution is p, the drafter's q,
gamma = k draft tokens per row. Row b proposed num_drafted[b] <= k tokens (the rest is padding).
Each row emits num_accepted[b] + 1 tokens: the accepted drafts, then either the recovered token
(sampled from norm(max(p - q, 0)) at the first rejection) or the bonus token (sampled from p after
the last draft when every draft was accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.sampling import sample


@dataclass
class VerifyResult:
    tokens: Tensor  # [B, k+1] emitted tokens; row b's first num_accepted[b] + 1 are valid
    num_accepted: Tensor  # [B] accepted draft tokens (excludes the recovered / bonus token)


def count_accepted(accept: Tensor, num_drafted: Tensor | None) -> Tensor:
    """accept [B, k] bool -> [B] length of the all-accepted prefix, capped at num_drafted [B]."""
    if num_drafted is not None:
        accept = accept & (torch.arange(accept.shape[1], device=accept.device) < num_drafted[:, None])
    return accept.long().cumprod(-1).sum(-1)


def remove_rejected(r: Tensor, q: Tensor) -> Tensor:
    """The distribution after a rejected draft: norm(max(r - q, 0)), rows [..., V]. Where that has no
    mass (r == q, so a rejection had probability zero) r itself is kept, to stay finite."""
    rest = (r - q).clamp(min=0)
    mass = rest.sum(-1, keepdim=True)
    return torch.where(mass > 0, rest / mass.clamp(min=1e-30), r)


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor, num_drafted: Tensor | None = None) -> VerifyResult:
    """draft_tokens [B, k], target_logits [B, k+1, V]: keep drafts while they equal the target's argmax."""
    k = draft_tokens.shape[1]
    target_tokens = target_logits.argmax(-1)  # [B, k+1]
    num_accepted = count_accepted(draft_tokens == target_tokens[:, :k], num_drafted)
    # Accepted drafts equal the argmax, and the token after them is the argmax: emit the argmax row.
    return VerifyResult(tokens=target_tokens, num_accepted=num_accepted)


def rejection_sample(
    draft_tokens: Tensor,  # [B, k]
    q: Tensor | None,  # [B, k, V] draft distribution; None = deterministic draft (one-hot q)
    p: Tensor,  # [B, k+1, V] target distribution
    generator: torch.Generator | None,
    num_drafted: Tensor | None = None,  # [B]
) -> VerifyResult:
    """Speculative sampling: accept draft x with prob min(1, p(x)/q(x)); at the first rejection
    sample from norm(max(p - q, 0)); after k acceptances sample the bonus token from p."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(B, k, generator=generator, device=p.device)  # [B, k]
    num_accepted = count_accepted(u * q_draft < p_draft, num_drafted)  # [B]

    p_next = p[rows, num_accepted]  # [B, V] target distribution after the accepted prefix
    limit = torch.full_like(num_accepted, k) if num_drafted is None else num_drafted
    rejected = num_accepted < limit  # [B] a draft was rejected (else: bonus)
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if q is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at][:, None], 1.0)  # [B, V]
        else:
            q_next = q[rows, at]  # [B, V]
        p_next = torch.where(rejected[:, None], remove_rejected(p_next, q_next), p_next)
    next_token = sample(p_next, generator)  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = next_token
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)


# ---- Trees ------------------------------------------------------------------------------------------
# A tree proposal is N draft nodes per row, flattened in topological order. The target runs one
# forward over the block [root, node 1, ..., node N], where the root (block index 0) is the pending
# token; node i sits at block index i + 1, at RoPE position root + depth, and attends to its ancestors.


@dataclass
class TreeSpec:
    parents: Tensor  # [B, N] parent's node index, -1 = the root; parents[b, i] < i
    num_nodes: Tensor | None = None  # [B] valid nodes per row (padding nodes hang off the root, never accepted)

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
        """[B, N+1] depth of every block entry (root 0)."""
        parent = self.parent_blocks
        depth = torch.zeros_like(parent)
        for _ in range(parent.shape[1] - 1):  # depth propagates one level per pass
            depth = torch.where(torch.arange(parent.shape[1], device=parent.device) == 0, 0, depth.gather(1, parent) + 1)
        return depth

    def ancestor_mask(self) -> Tensor:
        """[B, N+1, N+1] bool: entry j is an ancestor of (or is) entry i — the tree attention mask."""
        B, T = self.parents.shape[0], self.parents.shape[1] + 1
        mask = torch.eye(T, dtype=torch.bool, device=self.parents.device).expand(B, T, T).clone()
        parent = self.parent_blocks
        for i in range(1, T):  # parents come first, so their rows are complete
            mask[:, i] |= mask[torch.arange(B, device=mask.device), parent[:, i]]
        return mask


@dataclass
class TreeVerifyResult(VerifyResult):
    path: Tensor | None = None  # [B, D+1] block indices of the kept entries (root first); valid up to num_accepted


def longest_accepted(accepted: Tensor, depth: Tensor, ancestors: Tensor) -> tuple[Tensor, Tensor]:
    """The deepest accepted entry's path: accepted, depth [B, N+1]; ancestors [B, N+1, N+1].
    Returns path [B, D+1] (block index at each depth, 0 beyond the end) and num_accepted [B]."""
    B, T = accepted.shape
    D = int(depth.max())
    score = torch.where(accepted, depth * T + (T - 1 - torch.arange(T, device=depth.device)), -1)  # deepest, then first
    best = score.argmax(-1)  # [B]
    on_path = ancestors[torch.arange(B, device=depth.device), best]  # [B, N+1]
    at_depth = on_path[:, None, :] & (depth[:, None, :] == torch.arange(D + 1, device=depth.device)[None, :, None])
    return at_depth.int().argmax(-1), depth.gather(1, best[:, None]).squeeze(1)  # [B, D+1], [B]


def tree_greedy_verify(node_tokens: Tensor, tree: TreeSpec, target_logits: Tensor) -> TreeVerifyResult:
    """node_tokens [B, N], target_logits [B, N+1, V]: the longest root-to-node path whose every token
    equals the target's argmax after its parent; emits that path then the target's next token."""
    argmax = target_logits.argmax(-1)  # [B, N+1]
    parent = tree.parent_blocks  # [B, N+1]
    match = torch.cat([torch.ones_like(node_tokens[:, :1], dtype=torch.bool),
                       (node_tokens == argmax.gather(1, parent[:, 1:])) & tree.valid()], dim=1)  # [B, N+1]
    accepted = match.clone()
    for _ in range(node_tokens.shape[1]):  # an entry is accepted when it and all its ancestors match
        nxt = match & accepted.gather(1, parent)
        if torch.equal(nxt, accepted):
            break
        accepted = nxt
    path, num_accepted = longest_accepted(accepted, tree.depths(), tree.ancestor_mask())
    # Along an accepted path each token is the argmax after its parent: the argmaxes at the path emit it.
    return TreeVerifyResult(tokens=argmax.gather(1, path), num_accepted=num_accepted, path=path)


def children_table(tree: TreeSpec) -> Tensor:
    """[B, N+1, M] block indices of each entry's children in node order, -1 padded (M = max fan-out)."""
    parents = torch.where(tree.valid(), tree.parents + 1, -1)  # [B, N] parent block, -1 = padding node
    B, N = parents.shape
    earlier = torch.ones(N, N, dtype=torch.bool, device=parents.device).tril(-1)  # [i, j]: j < i
    rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)  # [B, N] index among siblings
    M = int(rank.max()) + 1 if N else 1
    kids = torch.full((B, N + 2, M), -1, dtype=torch.long, device=parents.device)  # row N+1 collects padding
    rows = torch.arange(B, device=parents.device)[:, None].expand(B, N)
    kids[rows, torch.where(parents >= 0, parents, N + 1), rank] = torch.arange(1, N + 1, device=parents.device)
    return kids[:, : N + 1]


def tree_rejection_sample(
    node_tokens: Tensor,  # [B, N]
    q: Tensor | None,  # [B, N, V] distribution each node was drawn from; None = deterministic nodes
    tree: TreeSpec,
    p: Tensor,  # [B, N+1, V] target distribution after each block entry
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """Multi-candidate speculative sampling (SpecInfer, Miao et al. 2024; EAGLE): at the current entry
    try its children in order, accepting child x with prob min(1, r(x)/q(x)), where r starts as the
    target's p there and loses each rejected sibling's q (r <- norm(max(r - q, 0))); move to an
    accepted child, or, when every child is rejected, emit the recovered token sampled from r (at a
    leaf, r = p: the bonus token). Vectorised over rows: one pass per depth and sibling slot."""
    B, N = node_tokens.shape
    V, dev = p.shape[-1], p.device
    rows = torch.arange(B, device=dev)
    kids = children_table(tree)  # [B, N+1, M]
    depth_max = int(tree.depths().max())
    tokens = torch.zeros(B, depth_max + 1, dtype=torch.long, device=dev)
    path = torch.zeros(B, depth_max + 1, dtype=torch.long, device=dev)
    entry = torch.zeros(B, dtype=torch.long, device=dev)  # current block entry per row
    depth = torch.zeros(B, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for _ in range(depth_max + 1):
        r = p[rows, entry]  # [B, V]
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for slot in range(kids.shape[2]):
            child = kids[rows, entry, slot]  # [B] block index, -1 = none
            trying = (child > 0) & ~moved & ~done
            node = (child - 1).clamp(min=0)
            x = node_tokens[rows, node]  # [B]
            q_x = torch.zeros(B, V, device=dev).scatter_(1, x[:, None], 1.0) if q is None else q[rows, node]  # [B, V]
            u = torch.rand(B, generator=generator, device=dev)
            accept = trying & (u * q_x[rows, x] < r[rows, x])
            tokens[accept, depth[accept]] = x[accept]
            path[accept, depth[accept] + 1] = child[accept]
            entry = torch.where(accept, child, entry)
            moved |= accept
            r = torch.where((trying & ~accept)[:, None], remove_rejected(r, q_x), r)
        finish = ~moved & ~done
        drawn = sample(r, generator)  # [B]
        tokens[finish, depth[finish]] = drawn[finish]
        done |= finish
        depth = depth + moved.long()
    return TreeVerifyResult(tokens=tokens, num_accepted=depth, path=path)

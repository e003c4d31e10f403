"""`eagle`: EAGLE-2 drafting (Li et al. 2024) with a trained EagleHead on the target's features.

Per step the head first catches up on the pairs (target feature at t, token t+1) that the last
verification kept, which leaves it with a predicted feature for the pending token (the root). Then it
grows a tree level by level: expand the `frontier` most confident nodes (highest cumulative draft
log-probability), each giving its `branch` most likely children, for `depth` levels; finally keep the
`total_tokens` most confident nodes (a child never scores above its parent, so the kept set is a
tree). Nodes are deterministic top-k picks (q = None): tree verification stays lossless.

Per-slot state (`EagleState`): the head's KV cache and the head's predicted feature for the pending
token (the root of the next tree). With L tokens in a row, the cache holds the pairs for positions
0 .. L - 2. `commit` feeds the pairs the last step kept (always depth + 1 of them; the cache length
masks the extra ones) right away, so a step that drafted nothing (gamma 0) keeps the head in step too;
the tree's entries are written after the committed pairs and rolled back at the end of propose.
Every shape is fixed by the tree configuration, so both can be captured in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Verified, register
from specdec.drafters.shipped import trained_folder
from specdec.errors import UserError
from specdec.kv_cache import KVCache
from specdec.models.eagle import EagleHead, load_eagle_head
from specdec.verify import TreeSpec


@dataclass(frozen=True)
class EagleTreeConfig:
    depth: int = 5  # levels grown (the engine's gamma caps it)
    branch: int = 4  # children taken per expanded node
    frontier: int = 4  # nodes expanded per level
    total_tokens: int = 10  # nodes verified per step (best of 4-15 on a 2-core CPU: benchmarks/eagle_tree_sweep.py)

    def candidates(self, depth: int) -> int:
        """Nodes a tree of `depth` levels chooses from (as EagleDrafter.grow builds them)."""
        total = self.branch
        for _ in range(2, depth + 1):
            total += min(self.frontier, total) * self.branch
        return total


@dataclass
class EagleState:
    cache: KVCache  # the head's, one row per slot
    root: Tensor  # [B, D] the head's feature for each row's pending token


class EagleDrafter:
    name = "eagle"
    graphable = True

    def __init__(self, target, head: EagleHead, tree: EagleTreeConfig) -> None:
        if head.config.vocab_size != target.config.vocab_size or head.config.hidden_size != target.config.hidden_size:
            raise UserError("this EAGLE head was trained for another target (vocabulary or width differ)")
        self.head = head.attach(target)
        self.tree = tree

    def shape(self, gamma: int) -> DraftShape:
        depth = min(self.tree.depth, gamma)
        return DraftShape(width=min(self.tree.total_tokens, self.tree.candidates(depth)), depth=depth, tree=True)

    def attach(self, batch) -> None:
        B, D = batch.capacity, self.head.config.hidden_size
        cache = self.head.new_cache(B, batch.max_len + self.tree.depth * self.tree.frontier, static=batch.static)
        root = torch.zeros(B, D, dtype=self.head.fc.weight.dtype, device=batch.device)
        batch.draft = EagleState(cache, root)

    def join(self, batch, slots: Tensor, hidden: Tensor) -> None:
        """Feed the prompts' pairs (feature at t, token t+1), the last one pairing with the first token."""
        state, lengths = batch.draft, batch.prompt_length[slots]  # [n]
        n, T = hidden.shape[:2]
        scratch = self.head.new_cache(n, T)
        positions = torch.arange(T, device=hidden.device).expand(n, T)
        out = self.head.features(hidden, batch.tokens[slots, 1 : T + 1], positions, scratch)  # [n, T, D]
        state.cache.k[:, slots, :, :T] = scratch.k
        state.cache.v[:, slots, :, :T] = scratch.v
        state.cache.lengths[slots] = lengths
        state.root[slots] = out[torch.arange(n, device=hidden.device), lengths - 1]

    def commit(self, batch, verified: Verified) -> None:
        """Feed the pairs of the kept entries (feature at the entry, the token after it) and keep the head's
        feature of the new pending token. Rows that did not take part write only past their cache length."""
        state, dev = batch.draft, batch.device
        took_part = verified.kept > 0  # [B]
        count = verified.accepted + 1  # [B] kept entries: the old pending token and the accepted drafts
        W = verified.hidden.shape[1]
        start = torch.where(took_part, batch.length - count - 1, state.cache.lengths)  # [B] first pair's position
        positions = start[:, None] + torch.arange(W, device=dev)  # [B, W]
        next_tokens = batch.tokens.gather(1, (positions + 1).clamp(max=batch.max_len - 1))  # [B, W]
        state.cache.lengths.copy_(start)
        out = self.head.features(verified.hidden.to(state.root.dtype), next_tokens, positions, state.cache)  # [B, W, D]
        state.cache.lengths.copy_(torch.where(took_part, start + count, start))
        last = out.gather(1, (count - 1).clamp(max=W - 1)[:, None, None].expand(-1, 1, out.shape[-1])).squeeze(1)
        state.root.copy_(torch.where(took_part[:, None], last, state.root))

    @torch.inference_mode()
    def propose(self, batch, gamma: int, u: Tensor | None) -> Proposal:
        depth = self.shape(gamma).depth
        tokens, parents = self.grow(batch.draft.root, batch, depth)
        return Proposal(tokens=tokens, tree=TreeSpec(parents, None, depth, self.tree.branch))

    def grow(self, root_feature: Tensor, batch, depth: int) -> tuple[Tensor, Tensor]:
        """EAGLE-2 dynamic tree: (tokens [B, N], parents [B, N]) in topological order."""
        cfg, dev, cache = self.tree, batch.device, batch.draft.cache
        B = root_feature.shape[0]
        rows = torch.arange(B, device=dev)
        base = cache.lengths.clone()  # [B] committed head slots (the root's pair is the last)
        # a node's head input is (its parent's feature, its token), at its parent's position; the root is
        # the pending token, at position L-1
        root_pos = batch.length - 1
        logq = self.head.logits(root_feature).log_softmax(-1)  # [B, Vd]
        score, pick = logq.topk(cfg.branch, dim=-1)  # [B, K]
        tokens, scores = [self.head.d2t[pick]], [score]
        parents = [torch.full_like(pick, -1)]
        depths = [torch.ones_like(pick)]
        features = [root_feature[:, None].expand(-1, cfg.branch, -1)]  # parent's feature for each candidate
        entry_of = [torch.full_like(pick, -1)]  # head-cache entry of each expanded candidate
        entry_anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)  # [B, E, E] ancestor entries
        num_entries = 0
        for level in range(2, depth + 1):
            all_scores, all_depths = torch.cat(scores, 1), torch.cat(depths, 1)  # [B, C]
            ranked = torch.where(all_depths == level - 1, all_scores, float("-inf"))
            F = min(cfg.frontier, ranked.shape[1])
            chosen = ranked.topk(F, dim=-1).indices  # [B, F] candidates to expand
            cand_tokens, cand_feats = torch.cat(tokens, 1), torch.cat(features, 1)
            cand_parents, cand_entry = torch.cat(parents, 1), torch.cat(entry_of, 1)
            parent_entry = torch.where(cand_parents[rows[:, None], chosen] >= 0,
                                       cand_entry.gather(1, cand_parents.gather(1, chosen).clamp(min=0)), -1)  # [B, F]
            # ancestors of each new entry: its parent's ancestors and itself
            E = num_entries + F
            grown = torch.zeros(B, E, E, dtype=torch.bool, device=dev)
            grown[:, :num_entries, :num_entries] = entry_anc
            parent_rows = entry_anc[rows[:, None], parent_entry.clamp(min=0)] if num_entries else \
                torch.zeros(B, F, 0, dtype=torch.bool, device=dev)  # [B, F, E_old]
            parent_rows = parent_rows & (parent_entry >= 0)[..., None]
            grown[:, num_entries:, :num_entries] = parent_rows
            grown[:, num_entries:, num_entries:] = torch.eye(F, dtype=torch.bool, device=dev)
            new_feats = self.head.features(
                cand_feats[rows[:, None], chosen], cand_tokens[rows[:, None], chosen],
                root_pos[:, None] + (level - 2), cache, mask=grown[:, num_entries:],
            )  # [B, F, D]
            entry_anc, num_entries = grown, E
            new_entry = torch.full_like(cand_entry, -1)
            new_entry[rows[:, None], chosen] = torch.arange(E - F, E, device=dev).expand(B, F)
            entry_of = [torch.maximum(cand_entry, new_entry)]
            tokens, scores, parents, depths, features = [cand_tokens], [all_scores], [cand_parents], [all_depths], [cand_feats]
            logq = self.head.logits(new_feats).log_softmax(-1)  # [B, F, Vd]
            child_score, child_pick = logq.topk(cfg.branch, dim=-1)  # [B, F, K]
            child_score = child_score + all_scores.gather(1, chosen)[..., None]
            tokens.append(self.head.d2t[child_pick].flatten(1))
            scores.append(child_score.flatten(1))
            parents.append(chosen[..., None].expand(-1, -1, cfg.branch).flatten(1))
            depths.append(torch.full_like(child_pick.flatten(1), level))
            features.append(new_feats[:, :, None].expand(-1, -1, cfg.branch, -1).flatten(1, 2))
            entry_of.append(torch.full_like(child_pick.flatten(1), -1))
        cache.lengths.copy_(base)  # the tree's entries are scratch
        return select_tree(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(depths, 1),
                           cfg.total_tokens)


def select_tree(tokens: Tensor, scores: Tensor, parents: Tensor, depths: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Keep the `total` best candidates (a child scores below its parent, ties broken by depth, so the
    kept set is closed under parents); return them breadth-first with re-indexed parents.
    tokens, scores, parents (candidate index, -1 = root), depths: [B, C]."""
    B, C = scores.shape
    total = min(total, C)
    rank = scores - 1e-4 * depths  # strictly below the parent even when q = 1
    keep = rank.topk(total, dim=-1).indices  # [B, N]
    order = (depths.gather(1, keep) * C + keep).argsort(-1)  # breadth first, then candidate order
    keep = keep.gather(1, order)  # [B, N] candidate index of each kept node
    new_index = torch.full((B, C), -1, dtype=torch.long, device=scores.device)
    new_index.scatter_(1, keep, torch.arange(total, device=scores.device).expand(B, total))
    kept_parents = parents.gather(1, keep)  # [B, N] candidate index
    tree_parents = torch.where(kept_parents >= 0, new_index.gather(1, kept_parents.clamp(min=0)), -1)
    return tokens.gather(1, keep), tree_parents


@register("eagle")
def build(target, options: DrafterOptions) -> EagleDrafter:
    head = options.extra.get("eagle_head")
    if head is None:
        head = load_eagle_head(trained_folder("eagle", target, options.extra.get("eagle_path"), "--eagle-head"))
    tree = EagleTreeConfig(**{k: v for k, v in options.extra.items() if k in EagleTreeConfig.__dataclass_fields__})
    return EagleDrafter(target, head, tree)

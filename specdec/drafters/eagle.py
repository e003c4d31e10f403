"""`eagle`: EAGLE-2 drafting (Li et al. 2024) with a trained EagleHead on the target's features.

Per step the head first catches up on the pairs (target feature at t, token t+1) that the last
verification committed, which leaves it with a predicted feature for the pending token (the root).
Then it grows a tree level by level: expand the `frontier` most confident nodes (highest cumulative
draft log-probability), each giving its `branch` most likely children, for `depth` levels; finally
keep the `total_tokens` most confident nodes (a child never scores above its parent, so the kept set
is a tree). Nodes are deterministic top-k picks (q = None): tree verification stays lossless.

Head cache: committed pairs occupy slots 0 .. L-2 for a row with L tokens; tree expansions are
written after them and rolled back at the end of propose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.drafters.base import DecodeState, DrafterOptions, Proposal, register
from specdec.drafters.shipped import trained_folder
from specdec.errors import UserError
from specdec.models.eagle import EagleHead, load_eagle_head
from specdec.verify import TreeSpec, VerifyResult


@dataclass(frozen=True)
class EagleTreeConfig:
    depth: int = 5  # levels grown (the engine's gamma caps it)
    branch: int = 4  # children taken per expanded node
    frontier: int = 4  # nodes expanded per level
    total_tokens: int = 10  # nodes verified per step (best of 4-15 on a 2-core CPU: benchmarks/eagle_tree_sweep.py)


class EagleDrafter:
    name = "eagle"

    def __init__(self, target, head: EagleHead, tree: EagleTreeConfig) -> None:
        if head.config.vocab_size != target.config.vocab_size or head.config.hidden_size != target.config.hidden_size:
            raise UserError("this EAGLE head was trained for another target (vocabulary or width differ)")
        self.head = head.attach(target)
        self.tree = tree
        self.cache = None
        self.stash: Tensor | None = None  # [B, S, D] target features not yet fed to the head
        self.stash_start: list[int] = []  # per row: position of stash[:, 0]
        self.stash_len: list[int] = []

    def max_tokens(self, gamma: int) -> int:
        return self.tree.total_tokens

    def prefill(self, state: DecodeState) -> None:
        self.cache = self.head.new_cache(state.batch_size, state.max_len + self.tree.depth * self.tree.frontier)
        self.stash, self.stash_start, self.stash_len = state.target_hidden, [0] * state.batch_size, list(state.prompt_lengths)

    def commit(self, state: DecodeState, result: VerifyResult) -> None:
        kept = (result.num_accepted + 1).tolist()
        self.stash = state.target_hidden
        self.stash_len = [n if a else 0 for n, a in zip(kept, state.active)]
        self.stash_start = [len(row) - n - 1 for row, n in zip(state.tokens, kept)]

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Proposal:
        root_feature = self.catch_up(state)  # [B, D]
        depth = min(self.tree.depth, k)
        tokens, parents = self.grow(root_feature, state, depth)
        return Proposal(tokens=tokens, tree=TreeSpec(parents))

    def catch_up(self, state: DecodeState) -> Tensor:
        """Feed the committed (feature, next token) pairs; return the predicted feature of the pending token."""
        dev = state.device
        B = state.batch_size
        counts = torch.tensor(self.stash_len, device=dev)  # [B]
        T = max(1, max(self.stash_len))
        starts = torch.tensor(self.stash_start, device=dev)  # [B]
        self.cache.trim(starts)
        idx = (starts[:, None] + 1 + torch.arange(T, device=dev)).clamp(max=state.max_len - 1)  # [B, T] next-token positions
        padded = [row + [row[-1]] * (state.max_len - len(row)) for row in state.tokens]
        next_tokens = torch.tensor(padded, device=dev).gather(1, idx)  # [B, T]
        feats = self.stash[:, :T]  # [B, <=T, D]
        if feats.shape[1] < T:
            feats = torch.nn.functional.pad(feats, (0, 0, 0, T - feats.shape[1]))
        out = self.head.features(feats.to(self.head.fc.weight.dtype), next_tokens, starts[:, None] + torch.arange(T, device=dev), self.cache)
        self.cache.trim(starts + counts)
        last = (counts - 1).clamp(min=0)
        return out[torch.arange(B, device=dev), last]  # [B, D]

    def grow(self, root_feature: Tensor, state: DecodeState, depth: int) -> tuple[Tensor, Tensor]:
        """EAGLE-2 dynamic tree: (tokens [B, N], parents [B, N]) in topological order."""
        B, dev, cfg = state.batch_size, state.device, self.tree
        rows = torch.arange(B, device=dev)
        base = self.cache.lengths.clone()  # [B] committed head slots (the root's pair is the last)
        # a node's head input is (its parent's feature, its token), at its parent's position; the root is
        # the pending token, at position L-1
        root_pos = torch.tensor([len(t) - 1 for t in state.tokens], device=dev)
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
                root_pos[:, None] + (level - 2), self.cache, mask=grown[:, num_entries:],
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
        self.cache.trim(base)  # the tree's entries are scratch
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

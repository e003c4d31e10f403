"""`medusa`: Medusa drafting (Cai et al. 2024): K heads on the target's feature propose a static tree.

The feature is the target's final hidden state x_n at the last kept token, the one whose LM-head
output gave the pending token y (after prefill: the prompt's last position; after a step: the last
accepted entry of the verified path). Head k's top-ranked tokens are candidates for the token k+1
places after y. The tree is static and sparse: each node is a path of head ranks, e.g. (0, 1) = head
0's best token followed by head 1's second best; a node's token depends only on its own depth and
rank (the heads all read the same x_n). Nodes are deterministic top-k picks (q = None), so tree
verification keeps the output lossless whatever the heads say.

State: the feature per slot, nothing else. `join` and `commit` only pick it out of the target's hidden
states (a gather, no forward), at every step, gamma 0 included, so a step that drafts nothing costs
Medusa nothing and its state needs no catch-up (unlike EAGLE's or a draft model's, catch_up.py).

Tree shape: DrafterOptions.extra["medusa_tree"], a list of rank paths or a node count (then the
tree is built from the heads' measured rank accuracies, stored by training in their config.json);
default: the tree stored with the heads, else DEFAULT_TREE. The engine's gamma caps the depth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Verified, prompt_last, register
from specdec.drafters.shipped import trained_folder
from specdec.errors import UserError
from specdec.models.checkpoint import read_config
from specdec.models.medusa import MedusaHeads, load_medusa_heads
from specdec.sampling import topk_wide
from specdec.verify import TreeSpec, depth_bound

# 12 nodes, for a CPU: verifying 13 tokens reads the target's weights once, like 1 token, but costs
# about 1.3 times a 1-token forward on the 2-core machine we measure on, and each further node adds less.
# It is `sparse_tree(accuracy, 12)` for the rank accuracies of 4 heads trained by `specdec train medusa
# --data self` on the default model, measured on unseen problems: rank 0 of heads 0..3 right 45%, 28%,
# 19%, 14% of the time, rank 1 13%, 12%, 10%, 8%. Trained heads carry their own tree (see tree_for).
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 3), (0, 0, 0),
)

# On the CPU, a chain of each head's top token: a verify there is compute-bound, so every verified node costs
# a good part of a decode step. Beside the native Q4_1 default model the 12-node tree above ran at 0.32x
# plain (heldout, 20 prompts x 128 tokens, gamma 3, 2-core CPU); beside the float32 one (`--gguf dequantize`,
# gamma 4, one interleaved run, every output lossless) the tree gave 1.07x on gsm8k-eval 10 x 256 and 0.61x on
# mixed 23 x 128, the chain 1.35x and 0.83x.
CPU_CHAIN: tuple[tuple[int, ...], ...] = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


@dataclass(frozen=True)
class MedusaTree:
    """A static tree of rank paths, breadth-first (so the nodes up to a depth are a prefix)."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, paths, num_heads: int) -> "MedusaTree":
        """Validate (every prefix present, depth <= heads, no repeats) and sort breadth-first."""
        paths = tuple(tuple(int(r) for r in p) for p in paths)
        if not paths or len(set(paths)) != len(paths):
            raise UserError("a Medusa tree needs at least one path and no repeated paths")
        for p in paths:
            if not p or min(p) < 0:
                raise UserError(f"Medusa tree path {list(p)}: ranks must be >= 0 and paths non-empty")
            if len(p) > num_heads:
                raise UserError(f"Medusa tree path {list(p)} is deeper than the {num_heads} heads")
            if len(p) > 1 and p[:-1] not in paths:
                raise UserError(f"Medusa tree path {list(p)} lacks its parent {list(p[:-1])}")
        return cls(tuple(sorted(paths, key=lambda p: (len(p), paths.index(p)))))

    def parents(self) -> list[int]:
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def depths(self) -> list[int]:
        return [len(p) for p in self.paths]

    def ranks(self) -> list[int]:
        return [p[-1] for p in self.paths]


def sparse_tree(rank_accuracy: list[list[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """The `num_nodes` paths of highest expected acceptance, prod_d a[d][rank_d] (Medusa's tree
    construction, heads taken as independent). rank_accuracy [K][R]: head k's rank-r token is right.
    A path never scores above its parent, so the chosen set contains its parents; ties go shallow first."""
    K = len(rank_accuracy)
    heap = [(-a, 1, (r,)) for r, a in enumerate(rank_accuracy[0])]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        score, depth, path = heapq.heappop(heap)
        chosen.append(path)
        if depth < K:
            for r, a in enumerate(rank_accuracy[depth]):
                heapq.heappush(heap, (score * a, depth + 1, path + (r,)))
    return chosen


class MedusaDrafter:
    name = "medusa"
    graphable = True

    def __init__(self, target, heads: MedusaHeads, tree: MedusaTree) -> None:
        if max(tree.ranks()) >= heads.config.draft_vocab_size:
            raise UserError(f"Medusa tree rank {max(tree.ranks())} exceeds the heads' {heads.config.draft_vocab_size}-token vocabulary")
        self.heads = heads.attach(target)
        self.tree = tree
        dev = next(target.parameters()).device
        self.parents = torch.tensor(tree.parents(), device=dev)  # [N]
        self.node_head = torch.tensor(tree.depths(), device=dev) - 1  # [N] head giving each node's token
        self.node_rank = torch.tensor(tree.ranks(), device=dev)  # [N]
        self.depths = tree.depths()
        self.top = max(tree.ranks()) + 1
        parents = tree.parents()
        self.fan_out = max(parents.count(i) for i in range(-1, len(parents)))  # most children of one entry

    def shape(self, gamma: int) -> DraftShape:
        depth = min(gamma, max(self.depths))
        return DraftShape(width=sum(d <= depth for d in self.depths), depth=depth, tree=True)

    def attach(self, batch) -> None:
        """Per slot: the target's feature at the row's last kept token [B, D]."""
        D = self.heads.config.hidden_size
        batch.draft = torch.zeros(batch.capacity, D, dtype=next(self.heads.parameters()).dtype, device=batch.device)

    def join(self, batch, slots: Tensor, hidden: Tensor) -> None:
        batch.draft[slots] = prompt_last(hidden, batch.prompt_length[slots])

    def commit(self, batch, verified: Verified) -> None:
        last = verified.hidden.gather(1, verified.accepted[:, None, None].expand(-1, 1, verified.hidden.shape[-1]))
        batch.draft.copy_(torch.where((verified.kept > 0)[:, None], last.squeeze(1), batch.draft))

    @torch.inference_mode()
    def propose(self, batch, gamma: int, u: Tensor | None) -> Proposal:
        shape = self.shape(gamma)  # breadth-first: the nodes up to a depth are a prefix
        N = shape.width
        logits = self.heads(batch.draft)  # [B, K, Vd]
        ranked = topk_wide(logits, self.top)[1]  # [B, K, R]
        picks = ranked[:, self.node_head[:N], self.node_rank[:N]]  # [B, N] draft-vocabulary indices
        parents = self.parents[:N].expand(batch.capacity, N)
        return Proposal(tokens=self.heads.d2t[picks], tree=TreeSpec(parents, None, depth_bound(shape.depth, max(self.depths), batch.device), self.fan_out))


def tree_for(option, heads: MedusaHeads, stored: dict, on_cpu: bool = False) -> MedusaTree:
    """The tree from the `medusa_tree` option (paths or a node count), else a chain on the CPU (CPU_CHAIN),
    else the heads' stored one."""
    K = heads.config.num_heads
    if option is None and on_cpu:
        return MedusaTree.of([p for p in CPU_CHAIN if len(p) <= K], K)
    if isinstance(option, int) and not isinstance(option, bool):
        accuracy = stored.get("rank_accuracy")
        if accuracy is None:
            raise UserError("a Medusa tree by node count needs heads trained by specdec (their rank accuracies)")
        return MedusaTree.of(sparse_tree(accuracy, option), K)
    paths = option or stored.get("medusa_tree") or [p for p in DEFAULT_TREE if len(p) <= K]
    return MedusaTree.of(paths, K)


@register("medusa")
def build(target, options: DrafterOptions) -> MedusaDrafter:
    heads, stored = options.extra.get("medusa_heads"), {}
    path = options.extra.get("medusa_path")
    if heads is None:
        path = trained_folder("medusa", target, path, "--medusa-heads")
        heads = load_medusa_heads(path)
    if path is not None:
        stored = read_config(Path(path), "a Medusa heads folder")
    on_cpu = next(target.parameters()).device.type == "cpu"
    return MedusaDrafter(target, heads, tree_for(options.extra.get("medusa_tree"), heads, stored, on_cpu))

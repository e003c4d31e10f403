"""Tensor parallelism for the native Llama-family model over torch.distributed (Megatron-style sharding).

Each of N ranks holds 1/N of every decoder layer and runs the same program on the same inputs:

- q/k/v and gate/up are split by output (column parallel): rank r keeps query and KV heads
  [r*H/N, (r+1)*H/N) and the matching slice of the MLP's intermediate features, so attention and
  SiLU·mul run on local heads and features with no communication, and the KV cache holds local heads;
- o_proj and down_proj are split by input (row parallel): each rank's product is a partial sum of the
  output, and the ranks add their partials (`Split.reduce`) before the residual stream moves on;
- the LM head is split by vocabulary (rows [r*Vs, (r+1)*Vs), Vs = ceil(V/N), the last shard padded with
  zero rows) and each forward gathers the logits (`Split.gather`);
- the embedding, norms and everything outside the target (drafters, sampling, the step) are replicated.

**Exactness.** An all-reduce's summation order depends on the message size and the algorithm NCCL picks
(ring, tree), so a token's bits would depend on how many tokens share the forward, and greedy speculation
would stop being lossless. The ranks therefore *gather* their float32 partials and each adds them in rank
order, residual first: every element's sum has one order for any number of tokens, rows or ranks'
message sizes, and every rank computes the same bits. So everything the step does after a forward
(verification, sampling with counter-based random numbers, the drafters) is bitwise the same on every
rank, and no rank needs to send the others the step's outcome. (Between N = 1 and N = 2 the sums differ
in order, so their logits differ by rounding: equal greedy tokens there is expected, not guaranteed.)

Host decisions that depend on time or on what only rank 0 sees are taken on rank 0 and sent: the `cost`
gamma policy's choice (`Shard.agree`), and a server's every change to its batch (server/mirror.py).

Launch with `torchrun --nproc-per-node N` (or `specdec ... --tp N`, which does it): `join_group`
reads torchrun's environment and opens an NCCL group on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
from torch import Tensor

from specdec.errors import UserError


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group (rank 0 of 1: no parallelism)."""

    rank: int = 0
    world: int = 1
    group: object = None  # a torch.distributed ProcessGroup (None: the default group)
    host_group: object = None  # a gloo group for host-side agreement (CUDA ranks' decisions)

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def local(self, n: int, what: str) -> int:
        """This rank's share of n heads or features (UserError when n does not split evenly)."""
        if n % self.world:
            raise UserError(f"tensor parallelism over {self.world} ranks needs {what} divisible by {self.world}, got {n}")
        return n // self.world

    def span(self, n: int) -> slice:
        """This rank's slice of n evenly split items."""
        size = self.local(n, "a split dimension")
        return slice(self.rank * size, (self.rank + 1) * size)

    def agree(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank (a host-side broadcast of a few integers)."""
        if not self.parallel:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.host_group)
        return t.tolist()


SINGLE = Shard()
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12


@dataclass(eq=False)
class Split:
    """How a Linear layer's product combines across the ranks of `shard`.

    kind "rows": the layer's inputs are split; each rank's output is a partial sum, reduced in rank order.
    kind "columns": its outputs are split in equal shards of ceil(out_features / N) (the last padded); the
    shards are gathered and the padding dropped."""

    shard: Shard
    kind: str  # "rows" | "columns"
    out_features: int  # the whole layer's

    def combine(self, y: Tensor) -> Tensor:
        return self.reduce(y).to(y.dtype) if self.kind == "rows" else self.gather(y)

    def gather_ranks(self, y: Tensor) -> Tensor:
        """[N, *y.shape]: every rank's y, in rank order."""
        out = torch.empty((self.shard.world * y.shape[0], *y.shape[1:]), dtype=y.dtype, device=y.device)
        ALL_GATHER(out, y.contiguous(), group=self.shard.group)
        return out.view(self.shard.world, *y.shape)

    def reduce(self, part: Tensor) -> Tensor:
        """The sum of every rank's `part`, in float32, added in rank order."""
        parts = self.gather_ranks(part)  # [N, ...]
        total = parts[0].float()
        for p in parts[1:]:
            total = total + p.float()
        return total

    def gather(self, y: Tensor) -> Tensor:
        """[..., out/N] on each rank -> [..., out]: the column shards side by side."""
        parts = self.gather_ranks(y)  # [N, ..., Vs]
        return torch.cat(list(parts), dim=-1)[..., : self.out_features]

    def whole_weight(self, weight: Tensor) -> Tensor:
        """The whole [out_features, in] weight of a column-split layer, from every rank's rows."""
        return self.gather_ranks(weight).flatten(0, 1)[: self.out_features]


def padded_share(n: int, world: int) -> int:
    """Rows per rank of an n-row layer split in equal shards (the last one padded)."""
    return -(-n // world)


def shard_state(state: dict[str, Tensor], config, shard: Shard) -> dict[str, Tensor]:
    """This rank's tensors of a native model's full state dict (names as LlamaModel's; fused q/k/v and
    gate/up as loading.fuse_hf_weights makes them)."""
    if not shard.parallel:
        return state
    c, r = config, shard.rank
    H, Hkv, Dh, I = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    heads, kv_heads, features = shard.span(H), shard.span(Hkv), shard.span(I)
    out = {}
    for name, t in state.items():
        leaf = name.split(".")[-2] if "." in name else name  # the module's own name
        if leaf == "qkv_proj":
            q, k, v = t.split([H * Dh, Hkv * Dh, Hkv * Dh])
            t = torch.cat([q.unflatten(0, (H, Dh))[heads].flatten(0, 1), k.unflatten(0, (Hkv, Dh))[kv_heads].flatten(0, 1),
                           v.unflatten(0, (Hkv, Dh))[kv_heads].flatten(0, 1)])
        elif leaf == "gate_up_proj":
            gate, up = t.split([I, I])
            t = torch.cat([gate[features], up[features]])
        elif leaf == "o_proj" and name.endswith(".weight"):
            t = t.unflatten(1, (H, Dh))[:, heads].flatten(1)
        elif leaf == "down_proj" and name.endswith(".weight"):
            t = t[:, features]
        elif leaf in ("o_proj", "down_proj"):  # a row-parallel bias is added once, by rank 0
            t = t if r == 0 else torch.zeros_like(t)
        elif name == "lm_head.weight":
            Vs = padded_share(c.vocab_size, shard.world)
            t = torch.nn.functional.pad(t, (0, 0, 0, Vs * shard.world - c.vocab_size))[r * Vs:(r + 1) * Vs]
        out[name] = t.clone() if t is not state[name] else t
    return out


@cache
def join_group(tp: int, device: str) -> Shard:
    """Join the group torchrun started (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR in the environment):
    NCCL on CUDA (each rank on GPU LOCAL_RANK), gloo on the CPU. tp = 1 outside torchrun: no group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp == 1 and world == 1:
        return SINGLE
    if world != tp:
        raise UserError(f"--tp {tp} needs {tp} processes (torchrun --nproc-per-node {tp}); this run has {world}")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise UserError(f"--tp {tp} needs {tp} GPUs on this host; it has {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None)
    host = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    return Shard(dist.get_rank(), world, dist.group.WORLD, host)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def finish_ranks(shard: Shard, code: int = 0, wait: bool = True) -> None:
    """End a tensor-parallel run with exit status `code`: each rank finishes its device work, (wait) waits
    for the others, leaves a gloo group, and exits at once without the interpreter's finalization. A
    CUDA rank never leaves: NCCL's teardown of communicators that CUDA graphs captured hung a run on an
    H200. A CPU rank that left and then finalised aborted now and then on a 2-core VM ("terminate called
    without an active exception", no Python frame on the stack), after writing its results: 6 aborts in
    about 15 TP test runs within minutes, none in 20 runs later; with a barrier before leaving too. A
    single rank (no group) returns."""
    if not shard.parallel:
        return
    cuda = dist.get_backend() == "nccl"
    if cuda:
        torch.cuda.synchronize()
    if wait:
        dist.barrier(group=shard.host_group)
    if not cuda:
        leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""What it costs to give every tensor-parallel rank every rank's partial product, on one host's GPUs.

    torchrun --nproc-per-node N benchmarks/tp_reduce.py [D ...]      (default D: 4096 8192)

For a decode step's float32 partial [1, D], each timed as the median of 20 replays of a CUDA graph of 10
(events):
- nccl_all_gather_us: the NCCL all-gather specdec uses (Split.gather_ranks); each rank then adds the
  partials in rank order, so every rank gets the same bits;
- barrier_us: a symmetric-memory barrier alone (torch.distributed._symmetric_memory), the least a
  one-shot exchange through peer memory must pay;
- push_copies_barrier_us: each rank copies its partial into its slot of every peer's buffer, then a
  barrier (the all-gather done by hand; its result is checked equal to NCCL's on every rank);
- one_shot_all_reduce_us / two_shot_all_reduce_us: torch's symmetric-memory all-reduces (their sum
  order is theirs, so not what specdec's exactness needs; timed for comparison).
Rank 0 prints one JSON line per D.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from tensor_parallel import graphed_us  # benchmarks/, this script's folder


def measure(D: int, rank: int, world: int, group_name: str) -> dict:
    part = torch.randn(1, D, device="cuda") * (rank + 1)  # [1, D]
    gathered = torch.empty(world, D, device="cuda")  # [N, D]
    out = {"nccl_all_gather_us": graphed_us(lambda: dist.all_gather_into_tensor(gathered, part))}
    bufs = [symm_mem.empty(world, D, dtype=torch.float32, device="cuda") for _ in range(2)]  # two, used in turn
    handles = [symm_mem.rendezvous(b, group_name) for b in bufs]
    peers = [[h.get_buffer(p, (world, D), torch.float32) for p in range(world)] for h in handles]
    out["barrier_us"] = graphed_us(lambda: handles[0].barrier(channel=0))
    turn = [0]

    def push() -> None:  # a buffer is rewritten only after every rank passed the next exchange's barrier
        i = turn[0] % 2
        turn[0] += 1
        for p in range(world):
            peers[i][p][rank].copy_(part[0])
        handles[i].barrier(channel=0)

    out["push_copies_barrier_us"] = graphed_us(push)
    push()
    torch.cuda.synchronize()
    mine = bufs[(turn[0] - 1) % 2].clone()
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    out["push_equals_nccl_on_every_rank"] = all(torch.equal(m, gathered) for m in everyone)
    flat = symm_mem.empty(D, dtype=torch.float32, device="cuda")
    symm_mem.rendezvous(flat, group_name)
    flat.copy_(part[0])
    out["one_shot_all_reduce_us"] = graphed_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(flat, "sum", group_name))
    out["two_shot_all_reduce_us"] = graphed_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(flat, "sum", group_name))
    return out


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    for D in [int(a) for a in sys.argv[1:]] or [4096, 8192]:
        result = measure(D, rank, world, dist.group.WORLD.group_name)
        if rank == 0:
            print(json.dumps({"world": world, "D": D, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **result}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tensor-parallel serving: rank 0 runs the HTTP server and the scheduler; the other ranks follow it.

Every rank holds a shard of the target, and a step computes the same bits on every rank
(models/tensor_parallel.py), so the ranks need to agree only on what to run. The scheduler's
decisions depend on what only rank 0 sees (requests arriving and leaving, step times), so rank 0's
BatchOps (`MirroredOps`) sends every call, its name and arguments, to the other ranks before running it,
and each follower runs the same call on its own BatchOps (`follow`): the same calls in the same order
leave the same batch on every rank. A call travels as one pickled broadcast over the gloo host group,
about two per step (launch, read).

A call that raises on rank 0 cannot be retried row by row as a single process does (a follower may not
have failed, and the ranks' batches would part), so under tensor parallelism an error inside a step
ends the server: rank 0 logs it and exits, and the launcher stops the followers.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from specdec.models.tensor_parallel import Shard
from specdec.server.scheduler import BatchOps

log = logging.getLogger("specdec.server")
STOP = "stop"
MIRRORED = ("capture_shapes", "start_prefill", "prefill_chunk", "end_prefill", "release", "launch", "read", "forget",
            "forget_requests", "step_alone", "reset")


class MirroredOps(BatchOps):
    """Rank 0's BatchOps: each call in MIRRORED is sent to the followers, then run."""

    def __init__(self, shard: Shard, *args) -> None:
        self.shard = shard
        super().__init__(*args)

    def send(self, name: str, args: tuple) -> None:
        dist.broadcast_object_list([(name, args)], src=0, group=self.shard.host_group)

    def close(self) -> None:
        """Release the followers: the scheduler has stopped."""
        self.send(STOP, ())


def mirrored(name: str):
    def call(self: MirroredOps, *args):
        try:
            self.send(name, args)
            return getattr(BatchOps, name)(self, *args)
        except Exception:  # a follower gone, or the call itself failed
            log.exception(f"tensor-parallel {name} failed: the ranks cannot go on apart; stopping the server")
            os._exit(1)

    call.__name__ = name
    return call


for _name in MIRRORED:
    setattr(MirroredOps, _name, mirrored(_name))


def follow(ops: BatchOps, shard: Shard) -> None:
    """A follower's loop: run rank 0's calls on `ops` until it stops."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=shard.host_group)
        name, args = box[0]
        if name == STOP:
            return
        getattr(BatchOps, name)(ops, *args)

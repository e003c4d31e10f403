"""Elementwise pieces of a decoder layer, each fused into one kernel on CUDA by torch.compile: the
library path's fusion (kernels="library"). The exact path fuses them into its Triton GEMMs instead
(specdec/models/triton_ops.py).

A decode forward of a large model on a GPU is a few big matrix-vector products and ~30 small
elementwise kernels per layer; in a CUDA graph the small ones still cost a few microseconds each
(measured on an H200, Llama-3-8B shape: 1,413 kernels, 6.2 ms of kernel time against a 3.6 ms
weight-reading floor; fusing these brought it to 670 kernels and 4.9 ms; compiling whole layers
gave no more). Only forwards captured into CUDA graphs run compiled (inside `fusing()`): their
shapes are few and fixed, while eager forwards (prefill, draft heads of every tree shape) would
recompile for each new shape and lose more than fusion gains. On the CPU, or with
SPECDEC_COMPILE=0, the same functions run eagerly; the maths is identical either way.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from functools import cache

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate-half layout: x [B, H, T, Dh], cos and sin [B, 1, T, Dh]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


FUSING = [False]  # inside fusing(): set while a graphed forward warms up and is captured
RECOMPILE_LIMIT = 64  # one compile per (dtype, eps) a process meets; dynamic shapes cover the rest
EAGER: set = set()  # functions whose compilation failed: they run eagerly from then on


@cache
def compiled(fn):
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # Its value-range analysis warns for every symbolic power it cannot bound ("failed while executing
    # pow_by_natural"), dozens of times in a server's start; the bound is only widened, nothing is wrong.
    logging.getLogger("torch.utils._sympy.interp").setLevel(logging.ERROR)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def graphs_compiled() -> int:
    """How many graphs torch.compile has built in this process. A compile takes seconds on the thread that
    meets a new shape, so a step timed across one times the compiler (StepReport.compiled). Read from
    dynamo's own counters, which count every compile and recompile of every function; where dynamo is not
    imported, nothing has compiled (and importing it here would put most of a second into a step)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]


@contextmanager
def fusing():
    """Within: elementwise pieces on CUDA run through their compiled kernels."""
    previous, FUSING[0] = FUSING[0], True
    try:
        yield
    finally:
        FUSING[0] = previous


def run(fn, *args):
    """fn(*args), through its compiled kernel inside fusing() on a CUDA device (eager if compiling it
    ever failed: the maths is the same)."""
    if FUSING[0] and args[0].is_cuda:
        return run_compiled(fn, *args)
    return fn(*args)


def run_compiled(fn, *args):
    """fn(*args) through torch.compile when args[0] is on CUDA, eager elsewhere. The speculative step's
    bookkeeping between forwards (stopping, tree growth, verification) is dozens of tiny operations: as
    separate kernels they cost more than the forward's own tail. Eager and graphed CUDA steps both run
    the compiled code, so they share its arithmetic (and their sampled tokens). A function that fails to
    compile, or that met more shapes than RECOMPILE_LIMIT, runs eagerly from then on, said once;
    SPECDEC_COMPILE=0 turns compiling off."""
    if not args[0].is_cuda or fn in EAGER or os.environ.get("SPECDEC_COMPILE", "1") == "0":
        return fn(*args)
    try:
        return compiled(fn)(*args)
    except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
        EAGER.add(fn)
        print(f"specdec: {fn.__name__} could not be compiled ({type(e).__name__}); it runs as separate kernels",
              file=sys.stderr)
        return fn(*args)

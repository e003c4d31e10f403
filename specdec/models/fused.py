"""Elementwise pieces of a decoder layer, each fused into one kernel on CUDA by torch.compile.

A decode forward of a large model on a GPU is a few big matrix-vector products and ~30 small
elementwise kernels per layer; in a CUDA graph the small ones still cost a few microseconds each
(measured on an H200, Llama-3-8B shape: 1,413 kernels, 6.2 ms of kernel time against a 3.6 ms
weight-reading floor; fusing these brought it to 670 kernels and 4.9 ms; compiling whole layers
gave no more). On the CPU, or with SPECDEC_COMPILE=0, the same functions run eagerly; the maths is
identical either way.
"""

from __future__ import annotations

import os
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


@cache
def compiled(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


def run(fn, *args):
    """fn(*args), through its compiled kernel when the first argument is on a CUDA device."""
    if args[0].is_cuda and os.environ.get("SPECDEC_COMPILE", "1") != "0":
        return compiled(fn)(*args)
    return fn(*args)

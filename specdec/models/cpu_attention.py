"""Attention over the KV cache on the CPU with each query's output independent of its neighbours.

`F.scaled_dot_product_attention` on the CPU picks its blocking by shape: a query computed alone (a
plain decoding step) and the same query inside a verify block or a batch get different bits (measured
in float32), which breaks exact greedy equality between plain and speculative decoding. `attend` runs
cpu_attention.c instead: one fixed-order softmax pass per (row, head, query) over the keys it sees,
skipping the others (see the C file). Used by `Attention.forward` (specdec/models/llama.py) on the
CPU whenever the layer's products run through the CPU kernel.

Microseconds per call, this kernel / SDPA, default model shape (9 query heads, 3 KV heads, Dh = 64),
S keys, T queries; AMD EPYC (Zen 3, AVX2), 2 threads, the 2 cores shared with other jobs:

                T=1 S=128   S=512     S=2048     T=5 S=128   S=512     S=2048
    float32     39/48       84/104    187/269    88/117      199/200   700/814
    bfloat16    45/169      79/500    208/2100   99/111      217/264   694/1003

In decoding (default model, batch 1, 1 thread, alternating), a forward took the same time with either
at a 100-token context in float32 (63 ms each) and less with this kernel at 1,000 tokens (85 vs 103 ms
float32, 70 vs 145 ms bfloat16): exactness costs nothing here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specdec.models import cpu_gemm


def supports(q: Tensor) -> bool:
    """Whether `attend` can replace SDPA for q: on the CPU, a dtype the kernel reads, no autograd
    (training keeps SDPA), and the kernel library built."""
    return q.device.type == "cpu" and q.dtype in cpu_gemm.KERNEL_DTYPES and not torch.is_grad_enabled() and cpu_gemm.available()


def attend(q: Tensor, k_all: Tensor, v_all: Tensor, attn_mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(Dh), masked) v, each query on its own.

    q [B, H, T, Dh]; k_all, v_all [B, Hkv, S, Dh] (H a multiple of Hkv: grouped-query attention);
    attn_mask bool [B or 1, 1, T, S], True = sees; all float32 or all bfloat16 on the CPU, read through
    their strides (copied only if the last dimension is strided). Returns [B, H, T, Dh] (a view of a
    [B, T, H, Dh] tensor, so that
    `.transpose(1, 2).reshape(B, T, H * Dh)` costs nothing). A query that sees no key gets zeros.
    """
    B, H, T, Dh = q.shape
    Hkv, S = k_all.shape[1], k_all.shape[2]
    q, k_all, v_all, attn_mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_all, v_all, attn_mask))
    qs, ks, vs, ms = q.stride(), k_all.stride(), v_all.stride(), attn_mask.stride()
    out = q.new_empty(B, T, H, Dh)  # [B, T, H, Dh]
    cpu_gemm.library().attend(
        q.data_ptr(), k_all.data_ptr(), v_all.data_ptr(), attn_mask.data_ptr(), out.data_ptr(), q.dtype == torch.bfloat16,
        B, H, Hkv, T, S, Dh, 1.0 / math.sqrt(Dh), qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        0 if attn_mask.shape[0] == 1 else ms[0], ms[2], cpu_gemm.threads(),
    )
    return out.transpose(1, 2)

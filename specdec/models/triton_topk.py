"""The k most likely tokens of a draft distribution, as log-probabilities, in two Triton kernels.

An EAGLE level scores each expanded node's children by log_softmax(logits) and keeps the `branch` best.
As PyTorch operations that is a softmax reduction, an elementwise pass, a padded radix select per slice
of the vocabulary, a second select and a gather: about ten kernels, 30-40 us per level on an H200 at
batch 1 (the radix select alone ran 16 us), inside every captured draft step. Here:

1. `topk_chunk_kernel`, one program per (row, CHUNK-entry slice of the vocabulary): the slice's max m,
   its sum of exp(x - m), and its k largest entries (k rounds of max, then the lowest index holding it);
2. `topk_merge_kernel`, one program per row: logsumexp = M + log(sum_c s_c exp(m_c - M)) over the slices,
   and the k largest of the slices' candidates, minus it.

Values are float32 log-probabilities, largest first; among equal values the lower index comes first.
The result feeds only drafting (which tokens the tree tries), never verification, so its rounding
(x - logsumexp rather than log_softmax's own order) cannot change an output token.

This module imports triton at the top: import it lazily (specdec.sampling.topk_log_probs does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specdec.models.kernels import on_tensor_device
from specdec.models.triton_ops import cdiv, launch_options, next_power_of_2, pdl_enter

CHUNK = 1024  # vocabulary entries per first-stage program: 8 programs per row for an 8k draft vocabulary


@triton.jit
def topk_chunk_kernel(x_ptr, val_ptr, idx_ptr, m_ptr, s_ptr, V, n_chunks, K: tl.constexpr, CHUNK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    pdl_enter(USE_PDL)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    x = tl.load(x_ptr + row * V + offs, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a slice of -inf only: its sum is 0, not NaN
    s = tl.sum(tl.exp(x - m_safe), axis=0)
    out = (row * n_chunks + c) * K
    left = valid  # entries not taken yet
    for j in tl.static_range(K):
        best = tl.max(tl.where(left, x, float("-inf")), axis=0)
        at = tl.min(tl.where(left & (x == best), offs, V), axis=0)  # V: none left (a slice shorter than K)
        tl.store(val_ptr + out + j, best)
        tl.store(idx_ptr + out + j, at)
        left = left & (offs != at)
    slot = row * n_chunks + c
    tl.store(m_ptr + slot, m)
    tl.store(s_ptr + slot, s)


@triton.jit
def topk_merge_kernel(val_ptr, idx_ptr, m_ptr, s_ptr, out_val_ptr, out_idx_ptr, V, n_chunks, K: tl.constexpr,
                      C_BLOCK: tl.constexpr, KC_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    c = tl.arange(0, C_BLOCK)
    m = tl.load(m_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    s = tl.load(s_ptr + row * n_chunks + c, mask=c < n_chunks, other=0.0)
    top = tl.max(m, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    lse = top_safe + tl.log(tl.sum(s * tl.exp(m - top_safe), axis=0))
    j = tl.arange(0, KC_BLOCK)
    n = n_chunks * K
    v = tl.load(val_ptr + row * n + j, mask=j < n, other=float("-inf"))
    ix = tl.load(idx_ptr + row * n + j, mask=j < n, other=V)
    left = (j < n) & (ix < V)  # candidates not taken yet (V: a short slice had none)
    for r in tl.static_range(K):
        best = tl.max(tl.where(left, v, float("-inf")), axis=0)
        at = tl.min(tl.where(left & (v == best), ix, V), axis=0)
        tl.store(out_val_ptr + row * K + r, best - lse)
        tl.store(out_idx_ptr + row * K + r, tl.minimum(at, V - 1).to(tl.int64))  # V - 1: never an address past the vocabulary
        left = left & (ix != at)


@on_tensor_device
def topk_log_softmax(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values float32, indices int64) [..., k]: the k largest entries of log_softmax(x) along the last
    dimension, largest first, the lower index first among equal values. x [..., V] on CUDA (or the CPU under
    Triton's interpreter), any float dtype."""
    V = x.shape[-1]
    rows = x.reshape(-1, V).contiguous()  # [R, V]
    R, n = rows.shape[0], cdiv(V, CHUNK)
    dev = x.device
    part_v = torch.empty(R, n, k, dtype=torch.float32, device=dev)
    part_i = torch.empty(R, n, k, dtype=torch.int32, device=dev)
    m = torch.empty(R, n, dtype=torch.float32, device=dev)
    s = torch.empty(R, n, dtype=torch.float32, device=dev)
    values = torch.empty(R, k, dtype=torch.float32, device=dev)
    index = torch.empty(R, k, dtype=torch.int64, device=dev)
    use_pdl, extra = launch_options(dev)
    topk_chunk_kernel[(R, n)](rows, part_v, part_i, m, s, V, n, K=k, CHUNK=CHUNK, USE_PDL=use_pdl, num_warps=4, **extra)
    topk_merge_kernel[(R,)](part_v, part_i, m, s, values, index, V, n, K=k, C_BLOCK=max(2, next_power_of_2(n)),
                            KC_BLOCK=max(2, next_power_of_2(n * k)), USE_PDL=use_pdl, num_warps=1, **extra)
    return values.view(*x.shape[:-1], k), index.view(*x.shape[:-1], k)

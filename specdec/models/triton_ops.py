"""Triton kernels of the exact decoder forward: every per-row result is bitwise the same for any number of rows.

Why: speculative decoding is lossless only if a token's logits do not depend on how many tokens are
computed beside it (a 1-token decode step vs a (k+1)-token verify block, a row alone vs a batch).
cuBLAS picks other kernels and split-K per shape, and attention and norms reduce in other orders, so
a bf16 verify forward rounds differently from a decode forward. Here every reduction has an order
fixed by the weight's shape (or the token's own visible sequence) alone:

- GEMM ("swap AB"): a program computes out^T = W[rows] @ x^T for BLOCK_N weight rows and a tile of
  16, 32 or 64 tokens (token_tile: wider for many rows): the weight tile is the MMA's A operand
  (64 rows: one Hopper wgmma, read straight from shared memory) and the tokens are its N dimension, so a
  token's result depends neither on the other tokens of the tile nor on the tile's width (tensor cores
  compute each output element on its own; the epilogue's sums run per token). K is
  walked in BLOCK_K steps in order. Where the weight has too few row tiles to fill the GPU (and a
  program would stream more than SPLIT_MIN_BYTES of it), K is split into SPLIT fixed ranges (a function of the weight's shape, never of M); each range's fp32 partial is
  written out and the last program to arrive adds them in split order (a deterministic split-K). Weight
  tile sizes and SPLIT depend on (kind, N, K, dtype), never on M; M is never specialised.
- Attention: split-KV over fixed chunks. A token's visible sequence (the committed prefix, then its
  visible nodes of the block or tree in slot order) is cut at absolute multiples of CHUNK keys; each
  chunk is reduced in BLOCK_S blocks with an online softmax (Milakov & Gimelshein 2018; FlashAttention,
  Dao et al. 2022) from a fresh state, and the chunks' (max, sum, acc) partials are combined in chunk
  order by the last program to finish one (flash-decoding, Dao et al. 2023, with fixed boundaries). The
  boundaries depend on the token's visible sequence alone, so the result does not depend on T, B, or on
  how many programs share the chunks (chosen per launch to fill the GPU). A tree node whose ancestors
  sit at scattered slots reduces exactly like the chain it stands for.
- RMSNorm (the final norm, and `prenorm`): one row per program, the whole row in one tile.

Fusion (five launches per decoder layer): an RMSNorm before q/k/v or gate/up is applied by the GEMM
that takes it, rms_norm(h) W^T = rstd · (h ⊙ w) W^T, from NormedRows made by the GEMM that produced h
(o_proj and down_proj write h, h ⊙ w for the next norm's weight, and each row's partial sums of h² over
every 64 columns; the first layer's come from one small kernel per forward): the consuming GEMM streams
h ⊙ w through its main loop untouched (no per-K-step work besides the dots) and scales the accumulator
by each row's rstd in the epilogue. The residual add runs in the epilogue of o_proj and down_proj, RoPE
(cos/sin computed in the kernel from the positions), Qwen3's per-head q/k RMSNorm and the KV-cache
write in the epilogue of the q/k/v GEMM, and SiLU(gate) · up in the epilogue of gate_up. The paired
kernels hold two accumulators per program: rows j and j + Dh/2 of each head (the rotate-half partners)
for q/k/v, rows j and j + I of the fused gate/up weight for the MLP. Every epilogue input (positions,
cache slots, biases, residual, norm weights, partial sums) is loaded before the main loop and used
after it, so its latency hides under the weight stream.

Launches: on Hopper every kernel is launched with programmatic dependent launch (PDL): it signals at its
start that the next kernel may launch, and waits (griddepcontrol.wait) for the previous kernel's
completion before its first memory access, so a kernel's launch and set-up overlap the previous one's
tail. Every program waits before anything else (also programs with no work), so a kernel never
completes before its predecessor. Before waiting, a GEMM program prefetches the first weight tiles
of its K range into L2 (weights are never written by a forward, so this does not race). SPECDEC_PDL=0
turns PDL off, SPECDEC_PREFETCH=0 the prefetch.

Dtypes: bf16/fp16 operands accumulate in fp32; fp32 operands use IEEE fp32 dots (never TF32).
Under the Triton interpreter (TRITON_INTERPRET=1) bf16 arithmetic is not emulated (bf16 is held as raw
uint16), so interpreter checks use fp16 and fp32.

This module imports triton at the top: import it lazily (specdec.models.kernels does).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specdec.models.kernels import COUNTER_LANE

BLOCK_T = 16  # tokens per GEMM tile (the MMA's N); many rows take wider tiles (token_tile)
TILE_32_FROM, TILE_64_FROM = 192, 1536  # rows M from which token_tile takes 32- and 64-token tiles (measured: token_tile)
BLOCK_Q = 16  # query heads (of one token, sharing one KV head) per attention tile
C_BLOCK = 16  # attention partials combined per step
NORM_PART = 64  # columns per partial sum of squares of a fused RMSNorm's input rows (NormedRows)
SPLIT_MIN_BYTES = 160 << 10  # a program streaming at most this much weight unsplit is not split (see pick_gemm_config)
SMS = 132  # streaming multiprocessors of an H100 SXM / H200: the grid sizes below aim at it (a constant, so tilings do not depend on the card)
WORKSPACE_BYTES = 64 << 20  # at most this much fp32 attention partials per launch (longer blocks launch in slices of tokens)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PDL = os.environ.get("SPECDEC_PDL", "1") != "0"  # read at launch: the benchmark switches it
PREFETCH = os.environ.get("SPECDEC_PREFETCH", "1") != "0"  # GEMMs prefetch their first weight tiles to L2 while waiting (PDL only)


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM tiling. It may depend on the weight's (N, K) and dtype, never on the number of rows.
    block_n: weight rows per accumulator per program; split_k: fixed K ranges, combined in order."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class AttentionConfig:
    """One attention tiling. block_s and chunk fix the blocks and chunks of every token's visible
    sequence: one value per model (changing them changes the bits)."""

    block_s: int
    chunk: int = 128
    num_warps: int = 4
    num_stages: int = 2


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host. triton.cdiv and triton.next_power_of_2 are constexpr functions since
    Triton 3.5: 2-6 us a call from host code, ~10 calls per GEMM launch, which an eager forward pays."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for 0), for the host (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# (kind, rows per accumulator, K, dtype) -> tiling measured best on an H100/H200; others use pick_gemm_config.
# kind: "plain" (o_proj, down, lm_head), "silu" (gate_up; rows = I), "qkv" (rows = (H + 2 Hkv) * Dh / 2).
TUNED_GEMM: dict[tuple[str, int, int, torch.dtype], GemmConfig] = {}


def pick_gemm_config(kind: str, rows: int, K: int, dtype: torch.dtype, min_block_n: int = 64) -> GemmConfig:
    """A tiling for `rows` weight rows per accumulator of depth K: 64-row tiles (one wgmma); K split into
    fixed ranges until the row tiles x splits about fill the GPU (each range 3 K steps or more), unless a
    program would stream at most SPLIT_MIN_BYTES of weights unsplit (then the combine costs more than it
    saves); as many pipeline stages as shared memory holds for the programs resident at once: one per SM
    for a grid of one wave, else three per SM where three stages fit in a third of it, else two."""
    tuned = TUNED_GEMM.get((kind, rows, K, dtype))
    if tuned is not None and tuned.block_n >= min_block_n:
        return tuned
    return heuristic_gemm_config(kind, rows, K, dtype, min_block_n)


@cache
def heuristic_gemm_config(kind: str, rows: int, K: int, dtype: torch.dtype, min_block_n: int) -> GemmConfig:
    """pick_gemm_config's rule, once per shape (an eager forward asks for it at every launch)."""
    elem = torch.finfo(dtype).bits // 8
    block_n = max(64, min_block_n)
    block_k = 64 if elem == 4 or K <= 1024 else 128
    block_k = max(16, min(block_k, next_power_of_2(K)))
    tiles = 1 if kind == "plain" else 2  # weight tiles per K step
    n_tiles, k_blocks = cdiv(rows, block_n), cdiv(K, block_k)
    split = 1
    if tiles * block_n * K * elem > SPLIT_MIN_BYTES:
        split = max(1, min(SMS // n_tiles, k_blocks // 3))
    steps = cdiv(k_blocks, split)
    stage_bytes = (tiles * block_n + BLOCK_T) * block_k * elem
    if n_tiles * split <= SMS:
        budget = 200 * 1024  # one program per SM
    elif 3 * stage_bytes <= 72 * 1024:
        budget = 72 * 1024  # three per SM
    else:
        budget = 110 * 1024  # two per SM
    stages = max(2, min(6, budget // stage_bytes, steps + 1))
    return GemmConfig(block_n, block_k, split, num_warps=4, num_stages=stages)


def pick_attention_config(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    return AttentionConfig(block_s=64 if head_dim <= 64 or dtype != torch.float32 else 32, chunk=128)


@cache
def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on `device` may use griddepcontrol (Hopper and later; never under the interpreter)."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> tuple[bool, dict]:
    """(USE_PDL constexpr, extra launch options) for a kernel on `device`."""
    use = PDL and pdl_capable(device)
    return use, ({"launch_pdl": True} if use else {})


_COUNTERS: dict[tuple[str, int | None, str], list[Tensor]] = {}


def counters(device: torch.device, n: int) -> Tensor:
    """Zeroed int32 arrival counters (split-K, split-KV), at least n, of the current counter lane
    (kernels.counter_lane). Every kernel leaves the counters it used at zero, so one buffer serves all
    launches that run one after another; work that overlaps it runs in another lane. Buffers are never
    freed: a CUDA graph may hold the address of an older one."""
    bufs = _COUNTERS.setdefault((device.type, device.index, COUNTER_LANE.get()), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(1 << 16, next_power_of_2(n)), dtype=torch.int32, device=device))
    return bufs[-1]


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (see the module docstring)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """prefetch.global.L2 of each address in ptrs (no result, never faults on the addresses given)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_weights(w_ptr, rows_a, rows_b, K, k_lo, k_hi, PAIR: tl.constexpr, PREFETCH_K: tl.constexpr):
    """Ask L2 for weight rows rows_a (and rows_b) [BLOCK_N], columns k_lo .. k_lo + PREFETCH_K (within
    k_hi), one request per 128-byte line."""
    STEP: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    cols = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // STEP) * STEP, k_hi - 1)  # [lines per row]
    prefetch_l2(w_ptr + rows_a[:, None].to(tl.int64) * K + cols[None, :])
    if PAIR:
        prefetch_l2(w_ptr + rows_b[:, None].to(tl.int64) * K + cols[None, :])


# ---------------------------------------------------------------------------------------------- GEMM


@triton.jit
def load_w_tile(w_ptr, rows, offs_k, K, EVEN_K: tl.constexpr):
    """Weight rows `rows` [BLOCK_N] x columns offs_k [BLOCK_K] (the MMA's A operand)."""
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_k[None, :] < K, other=0.0)


@triton.jit
def gemm_mainloop(x_ptr, w_ptr, rows_a, rows_b, offs_t, M, K, k_lo, k_hi,
                  PAIR: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc_a [BLOCK_N, BLOCK_T] = W[rows_a, k_lo:k_hi] @ x^T (and acc_b for rows_b). The loop holds the
    dots and nothing else: both operands come straight from the pipelined async copies into shared
    memory (a fused RMSNorm's x ⊙ w was computed by whoever produced x: see NormedRows)."""
    acc_a = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    t_ok = offs_t < M
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(x_rows + offs_k[None, :], mask=t_ok[:, None], other=0.0)
        else:
            a = tl.load(x_rows + offs_k[None, :], mask=t_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        at = tl.trans(a)  # [BLOCK_K, BLOCK_T]
        acc_a = tl.dot(load_w_tile(w_ptr, rows_a, offs_k, K, EVEN_K), at, acc_a, input_precision="ieee")
        if PAIR:
            acc_b = tl.dot(load_w_tile(w_ptr, rows_b, offs_k, K, EVEN_K), at, acc_b, input_precision="ieee")
    return acc_a, acc_b


@triton.jit
def split_combine(acc_a, acc_b, ws_ptr, cnt_ptr, tile, n_tiles, pid_s,
                  PAIR: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Write this K range's partials; the last of the SPLIT programs of the tile to arrive returns
    (True, sums over the ranges in range order), the others (False, ...). Workspace: [SPLIT, n_tiles, 2,
    BLOCK_N, BLOCK_T] fp32."""
    SIZE: tl.constexpr = BLOCK_N * BLOCK_T
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    mine = ws_ptr + (pid_s * n_tiles + tile).to(tl.int64) * (2 * SIZE)
    tl.store(mine + offs, acc_a)
    if PAIR:
        tl.store(mine + SIZE + offs, acc_b)
    tl.debug_barrier()  # every thread's partial is written before the (one-thread, release) arrival
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT - 1
    if last:
        acc_a = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # range order, whoever arrived last
            part = ws_ptr + (s * n_tiles + tile).to(tl.int64) * (2 * SIZE)
            acc_a += tl.load(part + offs, cache_modifier=".cg")
            if PAIR:
                acc_b += tl.load(part + SIZE + offs, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch
    return last, acc_a, acc_b


@triton.jit
def load_row_squares(sq_ptr, offs_t, M, K, NORM_PART: tl.constexpr, NORM_PARTS: tl.constexpr):
    """[BLOCK_T, NORM_PARTS] partial sums of squares of the input rows (see NormedRows; 0 past the last)."""
    parts = tl.arange(0, NORM_PARTS)
    n_parts = tl.cdiv(K, NORM_PART)
    return tl.load(sq_ptr + offs_t[:, None].to(tl.int64) * n_parts + parts[None, :],
                   mask=(offs_t < M)[:, None] & (parts < n_parts)[None, :], other=0.0)


@triton.jit
def group_sums(x, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """[16, COLS]: row g is the sum of x's rows g*GROUP .. (g+1)*GROUP - 1 (x [ROWS, COLS] fp32; rows past
    ROWS // GROUP are 0), added in row order in every column whatever the tile's width. An fp32 `ieee` dot
    runs on FMA units, each output element accumulating over k in order (ones and zeros: exact products of
    finite inputs; an overflowed row would spread its NaN to every group, where it is garbage anyway);
    a tl.sum's order follows the tensor's layout, which follows its shape, so the token tile's width
    (token_tile) would change a token's bits."""
    select = tl.where(tl.arange(0, ROWS)[None, :] // GROUP == tl.arange(0, 16)[:, None], 1.0, 0.0)  # [16, ROWS]
    return tl.dot(select, x, input_precision="ieee")


@triton.jit
def norm_rstd(sq, K, eps, NORM_PARTS: tl.constexpr):
    """[BLOCK_T] each token's RMSNorm rstd, from its partial sums of squares sq [BLOCK_T, NORM_PARTS] added
    in part order (group_sums; its other rows are zeros, which add exactly): what a fused norm scales the
    accumulator by."""
    return tl.rsqrt(tl.sum(group_sums(tl.trans(sq), NORM_PARTS, NORM_PARTS), axis=0) / K + eps)


@triton.jit
def store_plain(acc, sq, bias, res, nw, offs_n, offs_t, y_ptr, yn_ptr, ysq_ptr, M, N, K, eps, pid_n,
                HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMIT_NORM: tl.constexpr,
                NORM_PART: tl.constexpr, NORM_PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """y = acc (+ bias) (+ residual); EMIT_NORM: also the next RMSNorm's input as NormedRows: yn = y ⊙ nw
    (rounded) and each token's sum of y² over every NORM_PART columns (the tile's rows, in order)."""
    if HAS_NORM:
        acc = acc * norm_rstd(sq, K, eps, NORM_PARTS)[None, :]
    if HAS_BIAS:
        acc += bias.to(tl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (offs_t < M)[None, :]
    offsets = offs_t[None, :].to(tl.int64) * N + offs_n[:, None]
    dtype = y_ptr.dtype.element_ty
    if HAS_RESIDUAL:  # round the product to the output dtype first, as `x + linear(h)` does
        acc = acc.to(dtype).to(tl.float32) + res.to(tl.float32)
    out = acc.to(dtype)
    tl.store(y_ptr + offsets, out, mask=mask)
    if EMIT_NORM:
        h = out.to(tl.float32)
        tl.store(yn_ptr + offsets, (h * nw.to(tl.float32)[:, None]).to(dtype), mask=mask)
        G: tl.constexpr = BLOCK_N // NORM_PART
        squares = tl.where(mask, h * h, 0.0)
        part_sq = group_sums(squares, NORM_PART, BLOCK_N)  # [16, BLOCK_T], rows G.. zero
        n_parts = tl.cdiv(N, NORM_PART)
        g = tl.arange(0, 16)
        part = pid_n * G + g
        tl.store(ysq_ptr + offs_t[None, :].to(tl.int64) * n_parts + part[:, None], part_sq,
                 mask=((g < G) & (part < n_parts))[:, None] & (offs_t < M)[None, :])


@triton.jit
def store_silu(gate, up, sq, bias_a, bias_b, offs_n, offs_t, y_ptr, M, I, K, eps,
               HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_PARTS: tl.constexpr):
    if HAS_NORM:
        rstd = norm_rstd(sq, K, eps, NORM_PARTS)[None, :]
        gate = gate * rstd
        up = up * rstd
    if HAS_BIAS:
        gate += bias_a.to(tl.float32)[:, None]
        up += bias_b.to(tl.float32)[:, None]
    y = gate * tl.sigmoid(gate) * up
    mask = (offs_n < I)[:, None] & (offs_t < M)[None, :]
    tl.store(y_ptr + offs_t[None, :].to(tl.int64) * I + offs_n[:, None], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_rms(y, rstd_eps, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-head rstd of rows grouped by HALF (a head's first-half rows; y holds first² + second²), summed in
    row order (group_sums) and spread back over the head's rows by a dot with one 1 per row (exact)."""
    rstd = tl.rsqrt(group_sums(y, HALF, BLOCK_N) / (2 * HALF) + rstd_eps)  # [16, BLOCK_T]
    spread = tl.where(tl.arange(0, BLOCK_N)[:, None] // HALF == tl.arange(0, 16)[None, :], 1.0, 0.0)  # [BLOCK_N, 16]
    return tl.dot(spread, rstd, input_precision="ieee")


@triton.jit
def store_qkv(first, second, sq, bias_a, bias_b, pos, inv_freq, slot, w_first, w_second, offs_c, head, j, rows_a, offs_t,
              q_ptr, k_ptr, v_ptr, M, T, K, eps, qk_eps, rope_factor, stride_cb, stride_ch, stride_cs,
              NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
              HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
              NORM_PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """RoPE (rotate-half) on q and k, q stored to q[M, H*Dh], k and v written to the cache at slot
    lengths[b] + t (token m = b*T + t). first/second [BLOCK_N, BLOCK_T]: columns j and j + Dh/2 of head
    `head` for half-columns offs_c. pos [BLOCK_T] (float), inv_freq [BLOCK_N], slot [BLOCK_T], biases and
    q/k norm weights [BLOCK_N]: loaded before the main loop."""
    HALF: tl.constexpr = HEAD_DIM // 2
    HALVES: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HALF
    if HAS_NORM:
        rstd = norm_rstd(sq, K, eps, NORM_PARTS)[None, :]
        first = first * rstd
        second = second * rstd
    if HAS_BIAS:
        first += bias_a.to(tl.float32)[:, None]
        second += bias_b.to(tl.float32)[:, None]
    dtype = q_ptr.dtype.element_ty
    t_ok = offs_t < M
    rotated = (head < NUM_HEADS + NUM_KV_HEADS)[:, None]  # q and k heads; v heads pass through
    is_q = head < NUM_HEADS
    if QK_NORM:  # Qwen3: RMSNorm over each q and k head of the rounded projection, as the library path
        first = first.to(dtype).to(tl.float32)
        second = second.to(dtype).to(tl.float32)
        rstd = head_rms(first * first + second * second, qk_eps, HALF, BLOCK_N)
        n_first = ((first * rstd).to(dtype).to(tl.float32) * w_first.to(tl.float32)[:, None]).to(dtype).to(tl.float32)
        n_second = ((second * rstd).to(dtype).to(tl.float32) * w_second.to(tl.float32)[:, None]).to(dtype).to(tl.float32)
        first = tl.where(rotated, n_first, first)
        second = tl.where(rotated, n_second, second)
    angle = pos[None, :] * inv_freq[:, None]  # [BLOCK_N, BLOCK_T], as positions.float() * inv_freq
    cos = tl.cos(angle) * rope_factor
    sin = tl.sin(angle) * rope_factor
    first, second = (tl.where(rotated, first * cos - second * sin, first),
                     tl.where(rotated, second * cos + first * sin, second))
    col_ok = offs_c < HALVES
    q_out = q_ptr + offs_t[None, :].to(tl.int64) * (NUM_HEADS * HEAD_DIM) + rows_a[:, None]
    q_mask = (is_q & col_ok)[:, None] & t_ok[None, :]
    tl.store(q_out, first.to(dtype), mask=q_mask)
    tl.store(q_out + HALF, second.to(dtype), mask=q_mask)
    b = offs_t // T
    token_base = b.to(tl.int64) * stride_cb + slot.to(tl.int64) * stride_cs  # [BLOCK_T]
    is_v = head >= NUM_HEADS + NUM_KV_HEADS
    kv_head = tl.where(is_v, head - NUM_HEADS - NUM_KV_HEADS, head - NUM_HEADS)  # [BLOCK_N]
    kv_offsets = token_base[None, :] + (kv_head * stride_ch + j)[:, None]
    k_mask = (~is_q & ~is_v & col_ok)[:, None] & t_ok[None, :]
    v_mask = (is_v & col_ok)[:, None] & t_ok[None, :]
    tl.store(k_ptr + kv_offsets, first.to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_ptr + kv_offsets + HALF, second.to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(v_ptr + kv_offsets, first.to(v_ptr.dtype.element_ty), mask=v_mask)
    tl.store(v_ptr + kv_offsets + HALF, second.to(v_ptr.dtype.element_ty), mask=v_mask)


@triton.jit(do_not_specialize=["M", "T"])
def gemm_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, ws_ptr, cnt_ptr, xsq_ptr, nw_ptr, yn_ptr, ysq_ptr,
    k_ptr, v_ptr, pos_ptr, inv_freq_ptr, lengths_ptr, qn_ptr, kn_ptr,
    M, N, K, eps, T, qk_eps, rope_factor, stride_cb, stride_ch, stride_cs,
    EPILOGUE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    EMIT_NORM: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_PART: tl.constexpr, NORM_PARTS: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
):
    """EPILOGUE 0: y[M, N] = rstd · (x[M, K] @ W[N, K]^T) (+ bias) (+ residual) [and the next norm's input].
    EPILOGUE 1: y[M, N] = silu(g) * u with [g | u] = rstd · (x @ W[2N, K]^T) (+ bias).
    EPILOGUE 2: q/k/v of tokens x[M, K] (N = (H + 2 Hkv) * Dh/2 half-columns), see store_qkv.
    HAS_NORM: x holds rms_norm's x ⊙ w and xsq its rows' partial sums of squares (NormedRows); rstd = 1
    otherwise. Grid: (token tiles, row tiles, SPLIT); tokens tiled by BLOCK_T for every M."""
    pid_t, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < M
    rows = tl.minimum(offs_n, N - 1)  # clamp instead of masking the weight loads; extra rows are not stored
    if EPILOGUE == 2:
        HALF: tl.constexpr = HEAD_DIM // 2
        head, j = rows // HALF, rows % HALF
        rows_a = head * HEAD_DIM + j
        rows_b = rows_a + HALF
    elif EPILOGUE == 1:
        rows_a = rows
        rows_b = rows + N
    else:
        rows_a = rows
        rows_b = rows
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT) * BLOCK_K
    k_lo = pid_s * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    if USE_PDL and PREFETCH_K > 0:  # weights only: nothing a forward writes is read before the wait
        if k_lo < k_hi:
            prefetch_weights(w_ptr, rows_a, rows_b, K, k_lo, k_hi, EPILOGUE != 0, PREFETCH_K)
    pdl_enter(USE_PDL)
    # The epilogue's inputs are loaded here and used after the main loop, so their latency hides under it
    # (nothing uses them before the loop: its pipelined weight copies are issued right after these loads).
    sq = 0.0
    if HAS_NORM:
        sq = load_row_squares(xsq_ptr, offs_t, M, K, NORM_PART, NORM_PARTS)
    bias_a = 0.0
    bias_b = 0.0
    if HAS_BIAS:
        bias_a = tl.load(bias_ptr + rows_a)
        if EPILOGUE != 0:
            bias_b = tl.load(bias_ptr + rows_b)
    if EPILOGUE == 0:
        out_mask = (offs_n < N)[:, None] & t_ok[None, :]
        res = 0.0
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + offs_t[None, :].to(tl.int64) * N + offs_n[:, None], mask=out_mask, other=0.0)
        nw = 0.0
        if EMIT_NORM:
            nw = tl.load(nw_ptr + rows)
    if EPILOGUE == 2:
        pos = tl.load(pos_ptr + offs_t, mask=t_ok, other=0).to(tl.float32)  # [BLOCK_T]
        inv_freq = tl.load(inv_freq_ptr + j)  # [BLOCK_N]
        slot = tl.load(lengths_ptr + offs_t // T, mask=t_ok, other=0) + offs_t % T  # [BLOCK_T]
        w_first = 0.0
        w_second = 0.0
        if QK_NORM:
            is_q = head < NUM_HEADS
            w_first = tl.where(is_q, tl.load(qn_ptr + j), tl.load(kn_ptr + j))
            w_second = tl.where(is_q, tl.load(qn_ptr + j + HALF), tl.load(kn_ptr + j + HALF))
    acc_a, acc_b = gemm_mainloop(x_ptr, w_ptr, rows_a, rows_b, offs_t, M, K, k_lo, k_hi,
                                 EPILOGUE != 0, EVEN_K, BLOCK_N, BLOCK_T, BLOCK_K)
    if SPLIT > 1:
        n_tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = pid_n * tl.num_programs(0) + pid_t
        last, acc_a, acc_b = split_combine(acc_a, acc_b, ws_ptr, cnt_ptr, tile, n_tiles, pid_s,
                                           EPILOGUE != 0, SPLIT, BLOCK_N, BLOCK_T)
    else:
        last = True
    if last:
        if EPILOGUE == 0:
            store_plain(acc_a, sq, bias_a, res, nw, offs_n, offs_t, y_ptr, yn_ptr, ysq_ptr, M, N, K, eps, pid_n,
                        HAS_NORM, HAS_BIAS, HAS_RESIDUAL, EMIT_NORM, NORM_PART, NORM_PARTS, BLOCK_N, BLOCK_T)
        elif EPILOGUE == 1:
            store_silu(acc_a, acc_b, sq, bias_a, bias_b, offs_n, offs_t, y_ptr, M, N, K, eps, HAS_NORM, HAS_BIAS, NORM_PARTS)
        else:
            store_qkv(acc_a, acc_b, sq, bias_a, bias_b, pos, inv_freq, slot, w_first, w_second, offs_n, head, j, rows_a,
                      offs_t, y_ptr, k_ptr, v_ptr, M, T, K, eps, qk_eps, rope_factor, stride_cb, stride_ch, stride_cs,
                      NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_NORM, HAS_BIAS, QK_NORM, NORM_PARTS, BLOCK_N, BLOCK_T)


@triton.jit
def prenorm_kernel(x_ptr, w_ptr, xn_ptr, sq_ptr, D, BLOCK_D: tl.constexpr, NORM_PART: tl.constexpr, USE_PDL: tl.constexpr):
    """One row of NormedRows for rms_norm(x; w): xn = x ⊙ w rounded to x's dtype, and the sums of x² over
    every NORM_PART columns (the first layer's input; later layers get theirs from the GEMM before)."""
    row = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    store_normed_row(x, w_ptr, xn_ptr, sq_ptr, row, D, offs, mask, BLOCK_D, NORM_PART)


@triton.jit
def store_normed_row(x, w_ptr, xn_ptr, sq_ptr, row, D, offs, mask, BLOCK_D: tl.constexpr, NORM_PART: tl.constexpr):
    """Row `row` of NormedRows for rms_norm(x; w), x [BLOCK_D] fp32: xn = x ⊙ w rounded to xn's dtype, and
    the sums of x² over every NORM_PART columns."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(xn_ptr + row * D + offs, (x * w).to(xn_ptr.dtype.element_ty), mask=mask)
    PARTS: tl.constexpr = BLOCK_D // NORM_PART
    part_sq = tl.sum(tl.reshape(x * x, [PARTS, NORM_PART]), axis=1)  # [PARTS]
    n_parts = tl.cdiv(D, NORM_PART)
    part = tl.arange(0, PARTS)
    tl.store(sq_ptr + row * n_parts + part, part_sq, mask=part < n_parts)


@triton.jit
def add_partials_kernel(parts_ptr, res_ptr, h_ptr, w_ptr, xn_ptr, sq_ptr, M, D, N: tl.constexpr, HAS_NORM: tl.constexpr,
                        BLOCK_D: tl.constexpr, NORM_PART: tl.constexpr, USE_PDL: tl.constexpr):
    """One row of h = residual + parts[0] + ... + parts[N-1] (fp32, in that order; rounded to h's dtype):
    the ranks' partial products of a row-parallel layer (tensor_parallel.py), and NormedRows of h for the
    next norm as prenorm_kernel makes them."""
    row = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.load(res_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(N):
        acc = acc + tl.load(parts_ptr + (r * M + row) * D + offs, mask=mask, other=0.0)
    h = acc.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * D + offs, h, mask=mask)
    if HAS_NORM:
        store_normed_row(h.to(tl.float32), w_ptr, xn_ptr, sq_ptr, row, D, offs, mask, BLOCK_D, NORM_PART)


# ------------------------------------------------------------------------------------------ attention


@triton.jit
def attend_chunk(q, k_ptr, v_ptr, cache, order, lo, hi, window_start, q_pos, window, scale_log2, stride_cs,
                 HAS_ORDER: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(max, sum, unnormalised output) of q [BLOCK_Q, Dh] over the visible-sequence indices lo..hi-1
    (lo a multiple of BLOCK_S), reduced in BLOCK_S blocks from a fresh online-softmax state."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    for i0 in range(lo, hi, BLOCK_S):
        i = i0 + tl.arange(0, BLOCK_S)  # [BLOCK_S] indices into the visible sequence
        valid = i < hi
        if HAS_ORDER:  # committed slots first, then the window's visible slots in slot order
            in_window = i >= window_start
            node = tl.load(order + (i - window_start), mask=valid & in_window, other=0)
            slot = tl.where(in_window, window_start + node, i)
        else:  # a causal block: the visible sequence is slots 0 .. seen-1
            slot = i
        kv_offsets = cache + slot[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
        keys = tl.load(k_ptr + kv_offsets, mask=valid[:, None], other=0.0)  # [BLOCK_S, Dh]
        values = tl.load(v_ptr + kv_offsets, mask=valid[:, None], other=0.0)  # [BLOCK_S, Dh]
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale_log2  # [BLOCK_Q, BLOCK_S]
        if HAS_WINDOW:
            valid = valid & (q_pos - i < window)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))  # exactly 1 when the max stays
        p = tl.exp2(scores - m_safe[:, None])  # exactly 0 where not visible
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(values.dtype), values, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def combine_head(ws_acc, ws_ml, base, n, HEAD_DIM: tl.constexpr, C_BLOCK: tl.constexpr):
    """One query head's output from its n chunk partials at base .. base+n-1, combined in chunk order."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([], float("-inf"), dtype=tl.float32)
    l_run = tl.full([], 0.0, dtype=tl.float32)
    a_run = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for c0 in range(0, n, C_BLOCK):
        cs = c0 + tl.arange(0, C_BLOCK)
        ok = cs < n
        idx = base + cs
        m_c = tl.load(ws_ml + idx * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(ws_ml + idx * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        a_c = tl.load(ws_acc + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m_c, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == m_run, 1.0, tl.exp2(m_run - m_safe))
        w = tl.exp2(m_c - m_safe)  # exactly 0 for empty chunks and padding
        l_run = l_run * alpha + tl.sum(l_c * w, axis=0)
        a_run = a_run * alpha + tl.sum(a_c * w[:, None], axis=0)
        m_run = m_new
    return tl.where(l_run > 0, a_run / l_run, 0.0)


@triton.jit(do_not_specialize=["T", "t0", "n_t", "W", "P", "c_max"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lengths_ptr, order_ptr, count_ptr, positions_ptr, ws_acc, ws_ml, cnt_ptr,
    T, t0, n_t, W, P, c_max, window, scale_log2, stride_cb, stride_ch, stride_cs,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, C_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """o[M, H*Dh] for tokens t0 .. t0+n_t-1 of every batch row (M = B*T) over that row's cache.

    A token's keys are reduced in the order of its *visible sequence*: the committed slots
    0 .. window_start-1, then the visible slots of the last W (order[b, t, :count[b, t]], in slot order;
    without order tables, a causal block: slots 0 .. lengths[b]+t), cut into chunks at multiples of
    CHUNK. Program (t, query-head tile, p) of (batch row, KV head) reduces chunks p, p+P, ... of the token;
    a token with one chunk is written directly, otherwise the last program to finish one combines all
    partials in chunk order. A token sees the same sequence (bitwise the same keys, same lanes, same
    blocks and chunks) computed alone, in a verify block, in a batch, or as a tree node whose ancestors
    sit at scattered slots, so its output is the same in all of these."""
    TILES: tl.constexpr = (GROUP + BLOCK_Q - 1) // BLOCK_Q
    H: tl.constexpr = NUM_KV_HEADS * GROUP
    pid0, pid_bh = tl.program_id(0), tl.program_id(1)
    pdl_enter(USE_PDL)
    p = pid0 % P
    tile = (pid0 // P) % TILES
    t_local = pid0 // (P * TILES)
    t = t0 + t_local
    b, kv_head = pid_bh // NUM_KV_HEADS, pid_bh % NUM_KV_HEADS
    local = b * n_t + t_local  # this launch's token index (workspace, counters)
    token = b * T + t
    length = tl.load(lengths_ptr + b)
    if HAS_ORDER:
        window_start = length + T - W  # slots before it are committed and seen
        seen = window_start + tl.load(count_ptr + token)  # length of the visible sequence
    else:
        window_start = length
        seen = length + t + 1
    start = 0
    q_pos = 0
    if HAS_WINDOW:  # sequence index = position (a chain); blocks wholly before the window add nothing
        q_pos = tl.load(positions_ptr + token)
        start = tl.maximum(q_pos - window + 1, 0) // BLOCK_S * BLOCK_S
    c_first = start // CHUNK
    n = (seen - 1) // CHUNK - c_first + 1  # chunks holding visible keys
    if p < n:
        g = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] query heads within the group
        row_ok = g < GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = token.to(tl.int64) * (H * HEAD_DIM) + (kv_head * GROUP + g) * HEAD_DIM
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_Q, Dh]
        order = order_ptr
        if HAS_ORDER:
            order = order_ptr + token.to(tl.int64) * W
        cache = b.to(tl.int64) * stride_cb + kv_head * stride_ch
        part = (local.to(tl.int64) * H + kv_head * GROUP + g) * c_max  # [BLOCK_Q] partials of chunk 0
        for c in range(c_first + p, c_first + n, P):
            lo = tl.maximum(c * CHUNK, start)
            hi = tl.minimum(c * CHUNK + CHUNK, seen)
            m_i, l_i, acc = attend_chunk(q, k_ptr, v_ptr, cache, order, lo, hi, window_start, q_pos, window, scale_log2,
                                         stride_cs, HAS_ORDER, HAS_WINDOW, BLOCK_Q, BLOCK_S, HEAD_DIM)
            if n == 1:
                out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
                tl.store(o_ptr + q_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
            else:
                idx = part + (c - c_first)
                tl.store(ws_ml + idx * 2, m_i, mask=row_ok)
                tl.store(ws_ml + idx * 2 + 1, l_i, mask=row_ok)
                tl.store(ws_acc + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        if n > 1:
            mine = (n - p + P - 1) // P  # chunks this program reduced
            counter = cnt_ptr + (local * NUM_KV_HEADS + kv_head) * TILES + tile
            tl.debug_barrier()  # every thread's partials are written before the (one-thread, release) arrival
            arrived = tl.atomic_add(counter, mine, sem="acq_rel", scope="gpu")
            if arrived + mine == n:  # the last: combine every chunk in order
                for gi in tl.static_range(BLOCK_Q if GROUP > BLOCK_Q else GROUP):
                    head_in_group = tile * BLOCK_Q + gi
                    if head_in_group < GROUP:
                        h = kv_head * GROUP + head_in_group
                        out = combine_head(ws_acc, ws_ml, (local.to(tl.int64) * H + h) * c_max, n, HEAD_DIM, C_BLOCK)
                        tl.store(o_ptr + token.to(tl.int64) * (H * HEAD_DIM) + h * HEAD_DIM + offs_d, out.to(o_ptr.dtype.element_ty))
                tl.atomic_xchg(counter, 0)  # ready for the next launch


# -------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """y = w * (x * rstd) per row, rounded like specdec.models.fused.rms_norm: normalise in fp32, round
    to the dtype, then multiply by the weight in the dtype."""
    row = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- wrappers


@dataclass(frozen=True)
class NormedRows:
    """rms_norm(h; w) as the GEMMs take it (they apply it: rms_norm(h) W^T = rstd · (h ⊙ w) W^T): x = h ⊙ w
    rounded to h's dtype [M, D], and each row's sum of squares of h as fp32 partial sums over every
    NORM_PART columns [M, cdiv(D, NORM_PART)], added in one fixed order by the GEMM that takes them
    (rstd = rsqrt(sum / D + eps)). Made by `prenorm`, or by the GEMM that produces h (next_norm), so the
    GEMM's main loop streams x untouched."""

    x: Tensor
    sq: Tensor
    eps: float


def token_tile(M: int) -> int:
    """Tokens per GEMM tile for M rows: 16, or 32 / 64 from TILE_32_FROM / TILE_64_FROM rows. A weight tile is
    streamed once per token tile, so wide tiles cut the weight traffic of a prefill or a wide batched verify;
    below the thresholds the narrow tiles' extra programs run faster. Default model, bf16, H200, graphed
    forwards, ms for 16 / 32 / 64-token tiles (the scratch form of benchmarks/token_tiles.py, median of 20):
      1 x 25 (a verify block)   1.01 / 1.18 / 1.78     32 x 5 (160 rows)   1.42 / 1.47 / 2.26
      8 x 25 (200 rows)         1.81 / 1.75 / 2.37     32 x 25 (800)       4.97 / 4.06 / 4.53
      64 x 25 (1600)            9.39 / 7.56 / 7.31     16 x 128 (a prefill of 2048 tokens)  7.09 / 4.97 / 4.75
      64 x 128 (8192)           26.4 / 17.9 / 16.9
    A token's result does not depend on the tile's width: its dot products walk K in the same BLOCK_K steps,
    each output element computed on its own, and the epilogue's sums run in a fixed order (group_sums).
    tests/test_triton_ops.py checks every width against rows alone, bit for bit; the benchmark found the
    model's logits and hidden states bitwise equal across the three widths at all 19 shapes."""
    return 64 if M >= TILE_64_FROM else 32 if M >= TILE_32_FROM else BLOCK_T


def tile_stages(c: GemmConfig, kind_tiles: int, block_t: int) -> int:
    """Pipeline stages for a wider token tile: as many as the shared memory the config was sized for holds
    (at least two)."""
    if block_t == BLOCK_T:
        return c.num_stages
    budget = c.num_stages * (kind_tiles * c.block_n + BLOCK_T) * c.block_k
    return max(2, min(c.num_stages, budget // ((kind_tiles * c.block_n + block_t) * c.block_k)))


def launch_gemm(epilogue: int, x: Tensor | NormedRows, weight: Tensor, rows: int, c: GemmConfig, y: Tensor, bias=None,
                residual=None, qkv: dict | None = None, next_norm: tuple[Tensor | None, float] | None = None) -> NormedRows | None:
    """Launch gemm_kernel over x [M, K] and `rows` weight rows per accumulator (see its docstring); returns
    the next norm's NormedRows of y when next_norm has a weight."""
    x_rows, x_sq, eps = (x.x, x.sq, x.eps) if isinstance(x, NormedRows) else (x, None, 0.0)
    M, K = x_rows.shape
    block_t = token_tile(M)
    grid = (cdiv(M, block_t), cdiv(rows, c.block_n), c.split_k)
    ws = cnt = None
    if c.split_k > 1:
        tiles = grid[0] * grid[1]
        ws = torch.empty(c.split_k * tiles * 2 * c.block_n * block_t, dtype=torch.float32, device=x_rows.device)
        cnt = counters(x_rows.device, tiles)
    next_w, next_eps = next_norm if next_norm is not None else (None, 0.0)
    normed = None
    if next_w is not None:
        assert epilogue == 0 and c.block_n % NORM_PART == 0
        normed = NormedRows(torch.empty_like(y), torch.empty(M, cdiv(y.shape[1], NORM_PART), dtype=torch.float32,
                                                             device=y.device), float(next_eps))
    q = qkv or {}
    k_cache = q.get("k_cache")
    strides = k_cache.stride()[:3] if k_cache is not None else (0, 0, 0)
    use_pdl, extra = launch_options(x_rows.device)
    per_split = cdiv(cdiv(K, c.block_k), c.split_k) * c.block_k
    ahead = c.block_k * max(1, c.num_stages - 1)  # what the pipeline's prologue loads first
    prefetch_k = max(128 // weight.element_size(), min(next_power_of_2(per_split), 1 << (ahead.bit_length() - 1)))
    prefetch_k = prefetch_k if use_pdl and PREFETCH else 0
    gemm_kernel[grid](
        x_rows, weight, bias, residual, y, ws, cnt, x_sq, next_w, None if normed is None else normed.x,
        None if normed is None else normed.sq,
        k_cache, q.get("v_cache"), q.get("positions"), q.get("inv_freq"), q.get("lengths"), q.get("q_norm"), q.get("k_norm"),
        M, rows, K, eps, q.get("T", 1), q.get("qk_eps", 0.0), q.get("rope_factor", 1.0), *strides,
        EPILOGUE=epilogue, HAS_NORM=x_sq is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        EMIT_NORM=normed is not None, EVEN_K=K % c.block_k == 0, SPLIT=c.split_k,
        NUM_HEADS=q.get("num_heads", 1), NUM_KV_HEADS=q.get("num_kv_heads", 1), HEAD_DIM=q.get("head_dim", 2),
        QK_NORM=q.get("q_norm") is not None,
        BLOCK_T=block_t, BLOCK_N=c.block_n, BLOCK_K=c.block_k, NORM_PART=NORM_PART,
        NORM_PARTS=max(16, next_power_of_2(cdiv(K, NORM_PART))), USE_PDL=use_pdl, PREFETCH_K=prefetch_k,
        num_warps=c.num_warps, num_stages=tile_stages(c, 1 if epilogue == 0 else 2, block_t), **extra,
    )
    return normed


def rows_of(x: Tensor | NormedRows) -> Tensor:
    return x.x if isinstance(x, NormedRows) else x


def prenorm(x: Tensor, weight: Tensor, eps: float) -> NormedRows:
    """x [M, D] -> NormedRows of rms_norm(x; weight, eps), for a GEMM to apply."""
    M, D = x.shape
    normed = NormedRows(torch.empty_like(x), torch.empty(M, cdiv(D, NORM_PART), dtype=torch.float32, device=x.device),
                        float(eps))
    use_pdl, extra = launch_options(x.device)
    prenorm_kernel[(M,)](x, weight, normed.x, normed.sq, D, BLOCK_D=max(NORM_PART, next_power_of_2(D)),
                         NORM_PART=NORM_PART, USE_PDL=use_pdl, num_warps=4, **extra)
    return normed


def add_partials(parts: Tensor, residual: Tensor, next_norm: tuple[Tensor | None, float]) -> tuple[Tensor, Tensor | NormedRows]:
    """parts [N, M, D] fp32 (every rank's partial product), residual [M, D] -> (h = residual + the parts in
    rank order [M, D], the next norm's input: NormedRows of h, or h itself when the norm weight is None)."""
    N, M, D = parts.shape
    h = torch.empty_like(residual)
    weight, eps = next_norm
    normed = None if weight is None else NormedRows(
        torch.empty_like(residual), torch.empty(M, cdiv(D, NORM_PART), dtype=torch.float32, device=h.device), float(eps))
    use_pdl, extra = launch_options(h.device)
    add_partials_kernel[(M,)](parts, residual, h, weight, None if normed is None else normed.x,
                              None if normed is None else normed.sq, M, D, N=N, HAS_NORM=normed is not None,
                              BLOCK_D=max(NORM_PART, next_power_of_2(D)), NORM_PART=NORM_PART, USE_PDL=use_pdl,
                              num_warps=4, **extra)
    return h, (h if normed is None else normed)


def linear(x: Tensor | NormedRows, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
           out_dtype: torch.dtype | None = None, config: GemmConfig | None = None,
           next_norm: tuple[Tensor | None, float] | None = None):
    """x [M, K] (NormedRows: rms_norm(h) fused) -> y [M, N] = x @ weight[N, K]^T (+ bias) (+ residual [M, N]).
    next_norm (weight or None, eps): returns (y, the next RMSNorm's input: NormedRows of y, or y itself
    when the weight is None)."""
    M, K = rows_of(x).shape
    N = weight.shape[0]
    c = config or pick_gemm_config("plain", N, K, weight.dtype)
    y = torch.empty(M, N, dtype=out_dtype or rows_of(x).dtype, device=weight.device)
    normed = launch_gemm(0, x, weight, N, c, y, bias=bias, residual=residual, next_norm=next_norm)
    if next_norm is None:
        return y
    return y, (y if normed is None else normed)


def silu_linear(x: Tensor | NormedRows, weight: Tensor, bias: Tensor | None = None, config: GemmConfig | None = None) -> Tensor:
    """x [M, K] (NormedRows: rms_norm(h) fused), fused gate/up weight [2I, K] -> silu(gate) * up [M, I]."""
    M, K = rows_of(x).shape
    I = weight.shape[0] // 2
    c = config or pick_gemm_config("silu", I, K, weight.dtype)
    y = torch.empty(M, I, dtype=rows_of(x).dtype, device=weight.device)
    launch_gemm(1, x, weight, I, c, y, bias=bias)
    return y


def qkv_rope_write(x: Tensor | NormedRows, weight: Tensor, bias: Tensor | None,
                   positions: Tensor, inv_freq: Tensor, rope_factor: float, k_cache: Tensor, v_cache: Tensor,
                   lengths: Tensor, T: int, num_heads: int, num_kv_heads: int,
                   q_norm: Tensor | None = None, k_norm: Tensor | None = None, qk_eps: float = 0.0,
                   config: GemmConfig | None = None) -> Tensor:
    """x [M, K] (M = B*T; NormedRows: rms_norm(h) fused) -> rotated q [M, H*Dh]; rotated k and v are
    written into k_cache, v_cache [B, Hkv, S, Dh] at slots lengths[b] .. lengths[b]+T-1. positions [B, T]
    (int), inv_freq [Dh/2] fp32: cos/sin of positions.float() * inv_freq, times rope_factor. q_norm,
    k_norm [Dh]: Qwen3's per-head RMSNorm of q and k (eps qk_eps) before RoPE."""
    M, K = rows_of(x).shape
    head_dim = k_cache.shape[-1]
    halves = weight.shape[0] // 2
    min_block_n = head_dim // 2 if q_norm is not None else 64  # the per-head norm needs whole heads in a tile
    c = config or pick_gemm_config("qkv", halves, K, weight.dtype, min_block_n)
    assert q_norm is None or c.block_n % (head_dim // 2) == 0, "qk_norm needs block_n a multiple of head_dim / 2"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = torch.empty(M, num_heads * head_dim, dtype=rows_of(x).dtype, device=weight.device)
    launch_gemm(2, x, weight, halves, c, q, bias=bias, qkv=dict(
        k_cache=k_cache, v_cache=v_cache, positions=positions, inv_freq=inv_freq, lengths=lengths, T=T,
        rope_factor=float(rope_factor), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        q_norm=q_norm, k_norm=k_norm, qk_eps=float(qk_eps)))
    return q


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, T: int,
              visible: tuple[Tensor, Tensor] | None = None, positions: Tensor | None = None, window: int | None = None,
              config: AttentionConfig | None = None, programs: int | None = None) -> Tensor:
    """q [M, H*Dh] (M = B*T) over caches [B, Hkv, S, Dh] holding lengths[b] + T written slots per row ->
    [M, H*Dh]. visible: (order, count) from kernels.visible_order for a tree mask, None for a causal block;
    positions [B, T] int64 (read for a sliding window). programs: how many programs share each token's
    chunks (default: enough to fill the GPU; any value gives the same bits)."""
    B, num_kv_heads, S, head_dim = k_cache.shape
    H = q.shape[1] // head_dim
    group = H // num_kv_heads
    c = config or pick_attention_config(head_dim, q.dtype)
    assert c.chunk % c.block_s == 0
    tiles = cdiv(group, BLOCK_Q)
    c_max = cdiv(S, c.chunk) + 1
    out = torch.empty_like(q)
    per_token = H * c_max * (head_dim + 2) * 4
    step = max(1, min(T, WORKSPACE_BYTES // (per_token * B)))
    ws = torch.empty(B * step * H * c_max * (head_dim + 2), dtype=torch.float32, device=q.device)
    ws_acc, ws_ml = ws[:B * step * H * c_max * head_dim], ws[B * step * H * c_max * head_dim:]
    cnt = counters(q.device, B * step * num_kv_heads * tiles)
    order, count = visible if visible is not None else (None, None)
    W = order.shape[-1] if visible is not None else T
    use_pdl, extra = launch_options(q.device)
    for t0 in range(0, T, step):
        n_t = min(step, T - t0)
        P = programs or max(1, min(c_max, cdiv(2 * SMS, B * n_t * num_kv_heads * tiles)))
        attention_kernel[(n_t * tiles * P, B * num_kv_heads)](
            q, k_cache, v_cache, out, lengths, order, count, positions, ws_acc, ws_ml, cnt,
            T, t0, n_t, W, P, c_max, window or 0, math.log2(math.e) / math.sqrt(head_dim),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, HAS_ORDER=visible is not None,
            HAS_WINDOW=window is not None, BLOCK_Q=BLOCK_Q, BLOCK_S=c.block_s, CHUNK=c.chunk, C_BLOCK=C_BLOCK,
            USE_PDL=use_pdl, num_warps=c.num_warps, num_stages=c.num_stages, **extra,
        )
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [M, D] -> RMSNorm per row [M, D]."""
    M, D = x.shape
    y = torch.empty_like(x)
    use_pdl, extra = launch_options(x.device)
    rms_norm_kernel[(M,)](x, weight, y, D, eps, BLOCK_D=next_power_of_2(D), USE_PDL=use_pdl, num_warps=4, **extra)
    return y

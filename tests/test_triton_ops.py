"""The exact kernel path: Triton kernels whose per-row results are bitwise the same for any number of rows,
and the model-level promise built on them (a token's logits and hidden state do not depend on the verify
block, tree or batch it is computed in).

Kernel and model tests run on CUDA (SPECDEC_TEST_DEVICE=cuda with triton importable), or on the CPU
under Triton's interpreter with SPECDEC_TRITON_INTERPRET=1 (float16 and float32 only: the interpreter
holds bf16 as raw bits and does no bf16 arithmetic; fewer shapes, as it is slow). The interpreter's dot
is numpy's BLAS, whose bits depend on a row's position in the tile (tensor cores' do not), so under the
interpreter it is replaced by a position-independent one. Triton 3.6's interpreter needs numpy < 2.4:

    SPECDEC_TRITON_INTERPRET=1 PYTHONPATH=<numpy 2.3>:<triton 3.6> python -m pytest tests/test_triton_ops.py

The last tests run in the ordinary CPU suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, TINY, build_hf, save_hf
from specdec.errors import UserError
from specdec.models import load_model
from specdec.models import fused
from specdec.models.kernels import block_equals_steps, kernel_path, triton_problem, visible_order
from specdec.models.llama import build_attention_mask

INTERPRET = os.environ.get("SPECDEC_TRITON_INTERPRET") == "1"
ON_CUDA = torch.device(DEVICE).type == "cuda"


def triton_skip_reason() -> str | None:
    if not (ON_CUDA or INTERPRET):
        return "Triton kernels run with SPECDEC_TEST_DEVICE=cuda (or SPECDEC_TRITON_INTERPRET=1 on the CPU)"
    return triton_problem()


needs_triton = pytest.mark.skipif(triton_skip_reason() is not None, reason=triton_skip_reason() or "")
DTYPES = [torch.float16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}  # ||out - ref|| / ||ref||
ROWS = (1, 2, 5, 17) if INTERPRET else (1, 2, 5, 11, 16, 33, 64)
BLOCK_TOKENS = (1, 2, 5, 11, 16)


@pytest.fixture(autouse=True, scope="module")
def position_independent_interpreter_dot():
    """Under the interpreter: a dot whose output element depends only on its row and column (as on tensor
    cores), instead of numpy's BLAS (its micro-kernels round rows differently by position)."""
    if not INTERPRET or triton_skip_reason() is not None:
        yield
        return
    import numpy as np
    from triton.runtime import interpreter

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        out = np.einsum("ik,kj->ij", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    original = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = dot
    yield
    interpreter.InterpreterBuilder.create_dot = original


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0) -> torch.Tensor:
    """Drawn on the CPU in float32, then rounded and moved: the same values on every device."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def ops():
    from specdec.models import triton_ops

    return triton_ops


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # float32 reference
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


# ------------------------------------------------------------------------------------------------- GEMMs

N, K_EVEN, K_ODD, HEAD_DIM, HEADS, KV_HEADS = 72, 256, 160, 32, 6, 2
GEMM_KINDS = ("plain", "bias", "residual", "norm", "lm_head", "emit_norm", "silu", "qkv", "qk_norm")


def gemm_configs():
    """The default tiling, and a fixed split-K of 3 ranges (K_EVEN: the last range is empty; K_ODD: one
    ragged K step per range): the deterministic split-K combine is exercised whatever the default picks."""
    from specdec.models.triton_ops import GemmConfig

    return {"default": None, "split3": GemmConfig(block_n=64, block_k=64, split_k=3, num_stages=2)}


def part_squares(y: torch.Tensor, part: int = 64) -> torch.Tensor:
    """[M, N] -> [M, cdiv(N, part)] float32 sums of y² over every `part` columns (NormedRows.sq)."""
    y = y.float()
    return torch.stack([y[:, i:i + part].pow(2).sum(-1) for i in range(0, y.shape[1], part)], dim=-1)


def gemm_case(kind: str, dtype: torch.dtype, K: int, M: int, config=None):
    """(run(rows) -> outputs of those rows of x, float32 reference outputs of all M rows) for one fused
    variant. A fused RMSNorm's input (NormedRows) comes from `prenorm` of the same rows; "emit_norm": a
    residual GEMM that also writes the next norm's input (y, y ⊙ w, partial sums of y²)."""
    x = randn(M, K, dtype=dtype, seed=1)
    nw = randn(K, dtype=dtype, seed=2, scale=0.2) + 1
    ops_ = ops()
    if kind in ("qkv", "qk_norm"):
        return qkv_case(x, nw, dtype, K, M, kind == "qk_norm", config)
    width = 2 * N if kind == "silu" else N
    w = randn(width, K, dtype=dtype, seed=3, scale=K ** -0.5)
    bias = randn(width, dtype=dtype, seed=4) if kind in ("bias", "silu") else None
    res = randn(M, N, dtype=dtype, seed=5) if kind in ("residual", "emit_norm") else None
    norm = kind in ("norm", "lm_head", "silu")
    a = rms(x, nw) if norm else x.float()
    y = a @ w.float().T + (0 if bias is None else bias.float())

    def rows(r):
        return ops_.prenorm(x[r], nw, 1e-6) if norm else x[r]

    if kind == "silu":
        gate, up = y.chunk(2, dim=-1)
        ref = F.silu(gate) * up
        return (lambda r: (ops_.silu_linear(rows(r), w, bias, config=config),)), (ref,)
    if res is not None:
        y = y + res.float()
    if kind == "emit_norm":
        next_w = randn(N, dtype=dtype, seed=6, scale=0.2) + 1

        def run(r):
            out, normed = ops_.linear(rows(r), w, None, res[r], config=config, next_norm=(next_w, 1e-6))
            return out, normed.x, normed.sq

        return run, (y, y * next_w.float(), part_squares(y))
    out_dtype = torch.float32 if kind == "lm_head" else None
    return (lambda r: (ops_.linear(rows(r), w, bias, None if res is None else res[r], out_dtype, config=config),)), (y,)


def qkv_case(x, nw, dtype, K, M, qk_norm=False, config=None):
    """q/k/v of M tokens of one batch row: q, and the cache slots the rotated k and v are written to
    (qk_norm: with Qwen3's per-head q/k RMSNorm before RoPE)."""
    ops_ = ops()
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    w = randn(width, K, dtype=dtype, seed=3, scale=K ** -0.5)
    bias = randn(width, dtype=dtype, seed=4, scale=0.1)
    q_norm = randn(HEAD_DIM, dtype=dtype, seed=6, scale=0.2) + 1 if qk_norm else None
    k_norm = randn(HEAD_DIM, dtype=dtype, seed=7, scale=0.2) + 1 if qk_norm else None
    start, factor = 7, 1.25
    positions = torch.arange(start, start + M, device=DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE).float() / HEAD_DIM)
    angles = positions[:, None].float() * inv_freq  # [M, Dh/2]
    cos, sin = angles.cos() * factor, angles.sin() * factor
    y = rms(x, nw) @ w.float().T + bias.float()

    def rotate(t):  # [M, heads, Dh]
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([t1 * cos[:, None] - t2 * sin[:, None], t2 * cos[:, None] + t1 * sin[:, None]], dim=-1)

    q, k, v = y.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k = q.view(M, HEADS, HEAD_DIM), k.view(M, KV_HEADS, HEAD_DIM)
    if qk_norm:
        q, k = rms(q, q_norm), rms(k, k_norm)
    ref = (rotate(q).reshape(M, -1), rotate(k).transpose(0, 1), v.view(M, KV_HEADS, HEAD_DIM).transpose(0, 1))

    def run(r: slice):
        rows = range(M)[r]
        caches = [torch.zeros(1, KV_HEADS, start + M, HEAD_DIM, dtype=dtype, device=DEVICE) for _ in range(2)]
        lengths = torch.tensor([start + rows.start], device=DEVICE)
        q = ops_.qkv_rope_write(ops_.prenorm(x[r], nw, 1e-6), w, bias, positions[r][None].contiguous(), inv_freq, factor,
                                *caches, lengths, len(rows), HEADS, KV_HEADS, q_norm, k_norm, 1e-6, config=config)
        return q, caches[0][0, :, start + rows.start:start + rows.stop], caches[1][0, :, start + rows.start:start + rows.stop]

    return run, ref


@needs_triton
@pytest.mark.parametrize("config", ["default", "split3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [K_EVEN, K_ODD])
@pytest.mark.parametrize("kind", GEMM_KINDS)
def test_gemm_rows_are_invariant_and_right(kind, K, dtype, config):
    """Each of M rows gets the bits it gets alone (M = 1), for every M, and the product is right."""
    M = max(ROWS)
    run, ref = gemm_case(kind, dtype, K, M, gemm_configs()[config])
    alone = [run(slice(m, m + 1)) for m in range(M)]
    for rows in ROWS:
        for i, out in enumerate(run(slice(0, rows))):
            single = torch.cat([a[i] for a in alone[:rows]], dim=-2)
            assert torch.equal(out, single), f"{kind}: output {i} of {rows} rows differs from the rows alone"
    full = run(slice(0, M))
    for out, r in zip(full, ref):
        assert relative_error(out, r) < TOLERANCE[dtype], kind


@needs_triton
@pytest.mark.parametrize("width", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", GEMM_KINDS)
def test_gemm_token_tiles_change_no_bits(kind, dtype, width, monkeypatch):
    """Rows computed in wide token tiles (token_tile) get the bits they get alone, in 16-token tiles: the
    epilogue's sums (a fused norm's rstd, the next norm's partial sums, q/k norms) must not follow the
    tile's layout."""
    M = 100
    run, _ = gemm_case(kind, dtype, K_EVEN, M, gemm_configs()["split3"])
    alone = [run(slice(m, m + 1)) for m in range(M)]
    monkeypatch.setattr(ops(), "token_tile", lambda rows: width)
    for rows in (3, 24, M):
        for i, out in enumerate(run(slice(0, rows))):
            single = torch.cat([a[i] for a in alone[:rows]], dim=-2)
            assert torch.equal(out, single), f"{kind}: output {i} of {rows} rows in {width}-token tiles differs"


@needs_triton
def test_split_k_counters_are_left_at_zero():
    """Every split-K and split-KV launch leaves the arrival counters it used at zero (the next launch
    and every CUDA graph replay count from zero)."""
    from specdec.models import triton_ops

    run, _ = gemm_case("qkv", torch.float16, K_EVEN, 5, gemm_configs()["split3"])
    run(slice(0, 5))
    k = randn(1, KV_HEADS, 64, HEAD_DIM, dtype=torch.float16, seed=8)
    q = randn(3, HEADS * HEAD_DIM, dtype=torch.float16, seed=9)
    triton_ops.attention(q, k, k, torch.tensor([50], device=DEVICE), 3, config=triton_ops.AttentionConfig(16, 16), programs=2)
    assert all(int(buf.abs().sum()) == 0 for bufs in triton_ops._COUNTERS.values() for buf in bufs)


@needs_triton
def test_each_counter_lane_has_counters_of_its_own():
    """Kernels of a prompt read on its own stream (step.prefill_stream) may run while a step's run: their
    split-K and split-KV arrivals must not count into the step's counters."""
    from specdec.models import triton_ops
    from specdec.models.kernels import counter_lane

    device = torch.device(DEVICE)
    main = triton_ops.counters(device, 8)
    with counter_lane("prefill"):
        prefill = triton_ops.counters(device, 8)
        assert triton_ops.counters(device, 8) is prefill
    assert prefill.data_ptr() != main.data_ptr() and triton_ops.counters(device, 8) is main


# --------------------------------------------------------------------------------------------- attention

S_MAX = 192


def random_tree(T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An ancestor mask [T, T] (node i sees itself and its ancestors; parents come first) and depths [T]."""
    seen = torch.eye(T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.long)
    for i in range(1, T):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        seen[i] |= seen[parent]
        depth[i] = depth[parent] + 1
    return seen, depth


def attention_case(kind: str, B: int, T: int, seed: int):
    """Cache lengths [B], positions [B, T], tree mask [B, T, W] or None for a block of T new tokens.
    "tree-wide": W = T + 3, the first 3 tree nodes written by an earlier forward (as a drafter grows a
    tree level by level)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.tensor([70, 5, 130][:B])  # committed chain before the window
    if kind in ("causal", "window"):
        return prefix, prefix[:, None] + torch.arange(T), None
    W = T + 3 if kind == "tree-wide" else T
    trees = [random_tree(W, gen) for _ in range(B)]
    mask = torch.stack([seen[W - T:] for seen, _ in trees])  # [B, T, W]
    positions = torch.stack([prefix[b] + depth[W - T:] for b, (_, depth) in enumerate(trees)])
    return prefix + (W - T), positions, mask


def reference_attention(q, k_cache, v_cache, lengths, T, mask, positions, window):
    B, Hkv, S, Dh = k_cache.shape
    H = q.shape[1] // Dh
    slots = lengths[:, None] + torch.arange(T, device=q.device)
    visible = build_attention_mask(lengths, slots, positions, mask, window, S)
    qq = q.float().view(B, T, H, Dh).transpose(1, 2)
    out = F.scaled_dot_product_attention(qq, k_cache.float(), v_cache.float(), attn_mask=visible, enable_gqa=True)
    return out.transpose(1, 2).reshape(B * T, H * Dh)


def chain_alone(q_row, k_row, v_row, lengths, T, mask_row, position, window, t, config=None):
    """Token t of one batch row computed alone (T = 1) as the chain it stands for: the slots it sees in
    the last W moved to consecutive slots after the committed prefix, itself last."""
    ops_ = ops()
    W = T if mask_row is None else mask_row.shape[-1]
    start = int(lengths) + T - W
    seen = torch.arange(t + W - T + 1, device=DEVICE) if mask_row is None else mask_row[t].nonzero()[:, 0]
    k, v = k_row.clone(), v_row.clone()
    k[:, :, start:start + len(seen)] = k_row[:, :, start + seen]
    v[:, :, start:start + len(seen)] = v_row[:, :, start + seen]
    length = torch.tensor([start + len(seen) - 1], device=DEVICE)
    return ops_.attention(q_row, k, v, length, 1, None, position, window, config=config)[0]


def attention_configs():
    """The default tiling (blocks of 64, chunks of 128: up to two chunks in S_MAX), and blocks of 16 in
    chunks of 32 (up to six chunks: the split-KV combine, chunks per program > 1 and idle programs)."""
    from specdec.models.triton_ops import AttentionConfig

    return {"default": None, "chunk32": AttentionConfig(block_s=16, chunk=32)}


@needs_triton
@pytest.mark.parametrize("config", ["default", "chunk32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kind", ["causal", "tree", "tree-wide", "window"])
def test_attention_tokens_are_invariant_and_right(kind, B, dtype, config):
    """Every token of a block (causal, tree, tree grown over two forwards, sliding window; GQA; batch rows
    of different lengths) gets the bits it gets computed alone as its chain, whatever number of programs
    share its chunks, and the right values."""
    ops_ = ops()
    cfg = attention_configs()[config]
    Dh, group = HEAD_DIM, HEADS // KV_HEADS
    k_cache = randn(B, KV_HEADS, S_MAX, Dh, dtype=dtype, seed=11)
    v_cache = randn(B, KV_HEADS, S_MAX, Dh, dtype=dtype, seed=12)
    window = 9 if kind == "window" else None
    for T in BLOCK_TOKENS[:3] if INTERPRET else BLOCK_TOKENS:
        lengths, positions, mask = attention_case(kind, B, T, seed=T)
        lengths, positions = lengths.to(DEVICE), positions.to(DEVICE)
        mask = None if mask is None else mask.to(DEVICE)
        q = randn(B * T, HEADS * Dh, dtype=dtype, seed=13 + T)
        visible = None if mask is None else visible_order(mask)
        out = ops_.attention(q, k_cache, v_cache, lengths, T, visible, positions, window, config=cfg)
        ref = reference_attention(q, k_cache, v_cache, lengths, T, mask, positions, window)
        assert relative_error(out, ref) < TOLERANCE[dtype], f"T={T}"
        for programs in (1, 2, 5):
            again = ops_.attention(q, k_cache, v_cache, lengths, T, visible, positions, window, config=cfg, programs=programs)
            assert torch.equal(again, out), f"T={T}: {programs} programs per token change the bits"
        for b in range(B):
            for t in range(T):
                m = b * T + t
                alone = chain_alone(q[m:m + 1], k_cache[b:b + 1], v_cache[b:b + 1], lengths[b], T,
                                    None if mask is None else mask[b], positions[b:b + 1, t:t + 1].contiguous(), window, t, cfg)
                assert torch.equal(out[m], alone), f"T={T}, row {b}, token {t} (group of {group} heads)"


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_rows_are_invariant_and_right(dtype):
    """The final norm (rms_norm) and a fused norm's input (prenorm: x ⊙ w and partial sums of x²) per row."""
    x, w = randn(max(ROWS), 576, dtype=dtype, seed=21), randn(576, dtype=dtype, seed=22, scale=0.2) + 1
    out = ops().rms_norm(x, w, 1e-6)
    normed = ops().prenorm(x, w, 1e-6)
    for rows in ROWS:
        assert torch.equal(ops().rms_norm(x[:rows].contiguous(), w, 1e-6), out[:rows])
        again = ops().prenorm(x[:rows].contiguous(), w, 1e-6)
        assert torch.equal(again.x, normed.x[:rows]) and torch.equal(again.sq, normed.sq[:rows])
    assert relative_error(out, rms(x, w)) < TOLERANCE[dtype]
    assert torch.equal(normed.x, (x.float() * w.float()).to(dtype))
    assert relative_error(normed.sq, part_squares(x)) < 1e-5


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ranks", [2, 4])
def test_add_partials_sums_in_rank_order_per_row(dtype, ranks):
    """Tensor parallelism's sum of the ranks' float32 partial products (tensor_parallel.py): h = residual +
    parts[0] + ... + parts[N-1] in that order, rounded once, and the next norm's input from h, bitwise the
    same for a row alone as among any number of rows."""
    M, D = max(ROWS), 576
    parts = randn(ranks, M, D, seed=31)  # float32
    residual, w = randn(M, D, dtype=dtype, seed=32), randn(D, dtype=dtype, seed=33, scale=0.2) + 1
    h, normed = ops().add_partials(parts, residual, (w, 1e-6))
    expected = residual.float()
    for r in range(ranks):
        expected = expected + parts[r]
    assert torch.equal(h, expected.to(dtype))
    assert torch.equal(normed.x, (h.float() * w.float()).to(dtype))
    assert relative_error(normed.sq, part_squares(h)) < 1e-5
    for rows in ROWS:
        again, again_normed = ops().add_partials(parts[:, :rows].contiguous(), residual[:rows].contiguous(), (w, 1e-6))
        assert torch.equal(again, h[:rows]) and torch.equal(again_normed.sq, normed.sq[:rows])
    last, same = ops().add_partials(parts, residual, (None, 0.0))  # the last layer: no norm follows
    assert torch.equal(last, h) and same is last


# ----------------------------------------------------------------------------------------- model level

PROMPT = 20


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """conftest's tiny random Llama (no logit sharpening: near-ties are common)."""
    return save_hf(build_hf("llama", seed=0), tmp_path_factory.mktemp("exact") / "llama-0")


def tokens(n: int, seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (rows, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def prefilled(model, rows: int = 1, prompt: torch.Tensor | None = None, length: int = PROMPT):
    prompt = tokens(length, seed=1, rows=rows) if prompt is None else prompt
    cache = model.new_cache(rows, prompt.shape[1] + 108)
    model(prompt, torch.arange(prompt.shape[1], device=DEVICE).expand(rows, -1), cache)
    return cache


def one_at_a_time(model, block: torch.Tensor, cache, start: int) -> list:
    outs = []
    for i in range(block.shape[1]):
        outs.append(model(block[:, i:i + 1], torch.tensor([[start + i]], device=DEVICE), cache))
    return outs


def block_mismatches(model, length: int = PROMPT) -> list[str]:
    """Where a verify block of T = 1..17 tokens after a `length`-token prompt disagrees with feeding its
    tokens one at a time."""
    new = tokens(17, seed=2)
    cache = prefilled(model, length=length)
    singles = one_at_a_time(model, new, cache, length)
    bad = []
    for T in (1, 5, 17) if INTERPRET else range(1, 18):
        cache.trim(torch.tensor([length], device=DEVICE))
        out = model(new[:, :T], torch.arange(length, length + T, device=DEVICE)[None], cache)
        for t in range(T):
            if not (torch.equal(out.logits[0, t], singles[t].logits[0, 0]) and torch.equal(out.hidden[0, t], singles[t].hidden[0, 0])):
                bad.append(f"T={T} token {t}")
    return bad


def batch_mismatches(model, rows: int) -> list[str]:
    """Where rows of a batch (prompts of different lengths, then a 3-token block) disagree with each row alone."""
    prompts = tokens(PROMPT, seed=3, rows=rows)
    lengths = torch.tensor([PROMPT - (r % 7) for r in range(rows)], device=DEVICE)
    new = tokens(3, seed=4, rows=rows)
    cache = prefilled(model, rows, prompts)
    cache.trim(lengths)
    positions = lengths[:, None] + torch.arange(3, device=DEVICE)
    out = model(new, positions, cache)
    bad = []
    for r in range(rows):
        one = prefilled(model, 1, prompts[r:r + 1])
        one.trim(lengths[r:r + 1])
        alone = model(new[r:r + 1], positions[r:r + 1], one)
        if not (torch.equal(out.logits[r], alone.logits[0]) and torch.equal(out.hidden[r], alone.hidden[0])):
            bad.append(f"row {r}")
    return bad


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def exact_model(request, tiny_folder):
    if triton_skip_reason() is not None:
        pytest.skip(triton_skip_reason())
    model = load_model(str(tiny_folder), dtype=request.param, device=DEVICE, kernels="exact")
    assert kernel_path(model).name == "triton-exact"
    return model


@needs_triton
def test_verify_blocks_equal_single_steps(exact_model):
    assert block_mismatches(exact_model) == []


@needs_triton
def test_batch_rows_equal_rows_alone(exact_model):
    assert batch_mismatches(exact_model, 5 if INTERPRET else 32) == []


@needs_triton
def test_tree_nodes_equal_their_chains(exact_model):
    """A tree forward (ancestor mask, depth positions) gives each node the bits of its path fed as a
    chain one token at a time: tree verification is as exact as chain verification."""
    gen = torch.Generator().manual_seed(5)
    T = 7 if INTERPRET else 15
    seen, depth = random_tree(T, gen)
    nodes = tokens(T, seed=6)
    cache = prefilled(exact_model)
    tree = exact_model(nodes, PROMPT + depth[None].to(DEVICE), cache, mask=seen[None].to(DEVICE))
    for i in range(T):
        cache.trim(torch.tensor([PROMPT], device=DEVICE))
        path = seen[i].nonzero()[:, 0].to(DEVICE)
        last = one_at_a_time(exact_model, nodes[:, path], cache, PROMPT)[-1]
        assert torch.equal(tree.logits[0, i], last.logits[0, 0]) and torch.equal(tree.hidden[0, i], last.hidden[0, 0]), f"node {i}"


@needs_triton
def test_one_position_per_row_is_spread_over_the_block(exact_model):
    """An EAGLE tree level passes one position per row ([B, 1]) for its F sibling nodes: the forward must
    give the bits of those positions written out per token ([B, F]). The kernels read a position per
    token; a [B, 1] tensor was read past its end (the next rows' positions, then whatever memory lay
    beyond: wrong RoPE for every sibling but row 0's first, and an illegal address on an H200 at 32 rows)."""
    rows, F = 3, 4
    prompts = tokens(PROMPT, seed=3, rows=rows)
    lengths = torch.tensor([PROMPT - 2 * r for r in range(rows)], device=DEVICE)
    siblings = tokens(F, seed=4, rows=rows)
    mask = torch.eye(F, dtype=torch.bool, device=DEVICE).expand(rows, F, F)  # each node sees only itself
    outs = []
    for positions in (lengths[:, None], lengths[:, None].expand(rows, F)):  # [B, 1], [B, F]
        cache = prefilled(exact_model, rows, prompts)
        cache.trim(lengths)
        outs.append(exact_model(siblings, positions, cache, mask=mask))
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
    # a power check: the position matters (shifting it changes the bits)
    cache = prefilled(exact_model, rows, prompts)
    cache.trim(lengths)
    assert not torch.equal(exact_model(siblings, lengths[:, None] + 1, cache, mask=mask).logits, outs[1].logits)


@needs_triton
def test_graphed_forward_equals_eager(exact_model):
    """The exact path captures into a CUDA graph over a static cache and replays the eager bits."""
    if not ON_CUDA:
        pytest.skip("CUDA graphs")
    from specdec.graphs import GraphedModel

    new = tokens(4, seed=7)
    eager = exact_model(new, torch.arange(PROMPT, PROMPT + 4, device=DEVICE)[None], prefilled(exact_model))
    cache = exact_model.new_cache(1, 128, static=True)
    exact_model(tokens(PROMPT, seed=1), torch.arange(PROMPT, device=DEVICE)[None], cache)
    graphed = GraphedModel(exact_model, cache)
    for _ in range(2):  # capture, then replay
        cache.trim(torch.tensor([PROMPT], device=DEVICE))
        out = graphed(new, torch.arange(PROMPT, PROMPT + 4, device=DEVICE)[None], cache)
    assert torch.equal(out.logits, eager.logits) and torch.equal(out.hidden, eager.hidden)


@pytest.mark.skipif(not ON_CUDA or torch.cuda.device_count() < 2, reason="needs CUDA and a second GPU")
def test_a_model_on_another_gpu_runs_from_a_fresh_thread(tiny_folder):
    """Triton launches on the current device; a model on cuda:1 driven from a thread that never chose one
    (the server's decode thread) must still run there, with cuda:0's bits."""
    import threading

    if triton_problem() is not None:
        pytest.skip(triton_problem())
    new, positions = tokens(PROMPT, seed=1).cpu(), torch.arange(PROMPT)[None]
    outs = {}

    def forward(device: str) -> None:
        model = load_model(str(tiny_folder), dtype=torch.float32, device=device, kernels="exact")
        outs[device] = model(new.to(device), positions.to(device), model.new_cache(1, 128)).logits.cpu()

    for device in ("cuda:0", "cuda:1"):
        thread = threading.Thread(target=forward, args=(device,))
        thread.start()
        thread.join()
    assert torch.equal(outs["cuda:0"], outs["cuda:1"])

@needs_triton
@pytest.mark.parametrize("vocab,k", [(8192, 4), (3000, 1), (1100, 8), (3, 4)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_log_softmax_matches_a_stable_sort(vocab, k, dtype):
    """The draft top-k kernels: torch's log_softmax and a stable sort's first k (the lower index first among
    equal values), with ties planted across the vocabulary slices, a vocabulary that is no multiple of a
    slice and one shorter than k."""
    from specdec.models.triton_topk import topk_log_softmax

    x = randn(2, 3, vocab, dtype=dtype, seed=vocab)
    x[0, 0, [7 % vocab, 2000 % vocab, vocab - 1]] = 9.0  # three equal maxima, in different slices
    x[1, 2, :] = 0.0  # every entry equal
    values, index = topk_log_softmax(x, k)
    ref = x.float().log_softmax(-1)
    order = ref.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    k_real = min(k, vocab)
    assert torch.equal(index[..., :k_real], order[..., :k_real])
    torch.testing.assert_close(values[..., :k_real], ref.gather(-1, order[..., :k_real]), rtol=0, atol=1e-4)
    assert index.max().item() < vocab  # never an id past the vocabulary, even where it has fewer than k entries
    # drafting passes the head's logits in their own dtype (EagleHead.draft_logits): the same as converting first
    values32, index32 = topk_log_softmax(x.float(), k)
    assert torch.equal(values, values32) and torch.equal(index, index32)


@needs_triton
def test_the_checks_catch_a_block_dependent_kernel(exact_model, monkeypatch):
    """The checks above have the power to fail: with an LM head whose tiling depends on the number of
    rows (split-K for blocks, as cuBLAS picks per shape), they find differences."""
    from specdec.models import kernels, triton_ops

    def logits_by_rows(lm_head, h):
        B, T, D = h.shape
        split = 2 if B * T > 3 else 1  # a token alone or a 3-token row: 1; a longer block or the batch: 2
        config = triton_ops.GemmConfig(block_n=64, block_k=16, split_k=split, num_stages=2)
        return triton_ops.linear(h.reshape(B * T, D).contiguous(), lm_head.weight, out_dtype=torch.float32,
                                 config=config).view(B, T, -1)

    monkeypatch.setattr(kernels, "logits_exact", kernels.on_tensor_device(logits_by_rows))  # as the one it replaces
    assert block_mismatches(exact_model) != []
    assert batch_mismatches(exact_model, 3) != []


def random_llama(dtype: torch.dtype, **dims):
    """A native Llama with random weights (normal, std 0.02) built on DEVICE; tiny unless dims say otherwise."""
    from specdec.models.llama import ModelConfig, random_llama as build

    c = ModelConfig(**{**dict(model_type="llama", vocab_size=TINY["vocab_size"], hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                              rope_scaling=None, max_position_embeddings=512), **dims})
    return build(c, DEVICE, dtype)


@needs_triton
def test_an_eagle3_layer_runs_the_exact_stack(exact_model):
    """EAGLE-3's layer ([embedding ; h] in, its two norms side by side as the q/k/v input) on the Triton
    stack: the library path's values on a tree block (within the dtype's tolerance), and a causal block's
    tokens bit for bit as fed one at a time."""
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.models.kernels import runs_triton

    target, dtype, (P, T) = exact_model, exact_model.norm.weight.dtype, (6, 5)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target.config, target.config.vocab_size)).attach(target, kernels=False)
    layer, D = head.layers[0], target.config.hidden_size
    with torch.no_grad():  # norms of their own (ones would hide which norm reads which half)
        for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(1, P + T, D, device=DEVICE).to(dtype)
    ids = tokens(P + T, seed=5)
    positions = torch.arange(P + T, device=DEVICE)[None]
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool, device=DEVICE)[None]  # [1, T, T]: nodes 1 and 2 siblings

    @torch.no_grad()  # as drafting runs (the Triton stack has no backward)
    def run(kernels: str, mask: torch.Tensor | None, steps: list[int]) -> torch.Tensor:
        layer.kernels = kernels
        cache = head.new_cache(1, 32)
        outs = [head.features(hidden[:, :P], ids[:, :P], positions[:, :P], cache)]
        for a, b in zip(steps, steps[1:]):
            outs.append(head.features(hidden[:, a:b], ids[:, a:b], positions[:, a:b], cache, mask=mask))
        return torch.cat(outs, dim=1)

    layer.kernels = "exact"
    assert runs_triton(layer, torch.device(DEVICE), dtype)
    exact, library = run("exact", tree, [P, P + T]), run("library", tree, [P, P + T])
    assert ((exact.float() - library.float()).norm() / library.float().norm()).item() < TOLERANCE[dtype]
    assert torch.equal(run("exact", None, [P, P + T]), run("exact", None, list(range(P, P + T + 1))))


@pytest.mark.skipif(not ON_CUDA, reason="the library path's variance is cuBLAS/SDPA's, on CUDA")
def test_library_path_is_not_invariant_in_bf16():
    """The benchmark's whole-forward comparison has the power to fail: on a default-model-shaped random
    bf16 model (SmolLM2-135M's dimensions), the library path (cuBLAS picks other kernels for 1 row than
    for 4, SDPA too) gives a 4-token block other bits than 4 single steps, where the exact path does not."""
    from specdec.models.kernels import use_kernels

    model = random_llama(torch.bfloat16, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    assert use_kernels(model, "library").name == "cublas"
    assert not block_equals_steps(model)
    if triton_skip_reason() is None:
        assert use_kernels(model, "exact").name == "triton-exact"
        assert block_equals_steps(model)


@needs_triton
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_exact_path_matches_the_library_path(model_type, tmp_path):
    """The exact kernels compute the same model as the library path (float32, up to rounding), Qwen3's
    per-head q/k norm and RoPE scaling included, and stay block-invariant there."""
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}  # attention factor != 1
    folder = save_hf(build_hf(model_type, seed=0, head_dim=32, rope_scaling=yarn), tmp_path / model_type)
    exact = load_model(str(folder), dtype="float32", device=DEVICE, kernels="exact")
    library = load_model(str(folder), dtype="float32", device=DEVICE, kernels="library")
    assert kernel_path(exact).name == "triton-exact"
    prompt = tokens(PROMPT, seed=8)
    positions = torch.arange(PROMPT, device=DEVICE)[None]
    out = exact(prompt, positions, exact.new_cache(1, 64))
    ref = library(prompt, positions, library.new_cache(1, 64))
    assert relative_error(out.logits, ref.logits) < 1e-4 and relative_error(out.hidden, ref.hidden) < 1e-4
    if model_type == "qwen3":
        assert block_mismatches(exact) == []


@pytest.mark.skipif(not ON_CUDA or triton_skip_reason() is not None, reason="CUDA with triton")
def test_exact_refuses_uncovered_features(tmp_path):
    folder = save_hf(build_hf("llama", head_dim=24), tmp_path / "llama-24")
    with pytest.raises(UserError, match="head_dim 24.*kernels='library'"):
        load_model(str(folder), dtype="bfloat16", device=DEVICE, kernels="exact")
    assert kernel_path(load_model(str(folder), dtype="bfloat16", device=DEVICE)).name == "cublas"  # auto


# ---------------------------------------------------------------------------------------- the CPU suite


def test_visible_order_lists_seen_slots_first():
    """visible_order equals a stable sort (seen slots first, each kind in slot order) at a few rows and at
    thousands. On CUDA it runs compiled (dynamic sizes, first compiled at small shapes), where the cumsum
    version it replaces read ranks out of range at 3000 rows (a device-side assert on an H200)."""
    g = torch.Generator().manual_seed(0)
    with fused.fusing():
        for B, T, W in [(1, 1, 2), (2, 3, 6), (3000, 2, 2), (64, 25, 25), (6000, 3, 6), (5, 4, 64)]:
            mask = (torch.rand(B, T, W, generator=g) < 0.5).to(DEVICE)
            mask[0, 0] = False  # a token that sees nothing, and one that sees everything
            mask[-1, -1] = True
            order, count = visible_order(mask)
            assert torch.equal(order.long(), torch.argsort((~mask).int(), dim=-1, stable=True)), (B, T, W)
            assert torch.equal(count.long(), mask.sum(-1)), (B, T, W)
            assert order.dtype == count.dtype == torch.int32


def test_exact_on_cpu_needs_no_triton(tmp_path):
    """`import specdec` and kernels="exact" on the CPU (the C kernels) work where triton is not installed."""
    folder = save_hf(build_hf("llama", seed=0), tmp_path / "llama")
    script = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now fails
        "import torch, specdec\n"
        "from specdec.models.kernels import kernel_path\n"
        "from specdec.models.cpu_gemm import build_status\n"
        f"model = specdec.load_model({str(folder)!r}, dtype='float32', device='cpu', kernels='exact')\n"
        "cache = model.new_cache(1, 8)\n"
        "out = model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache)\n"
        "assert out.logits.shape == (1, 3, 96)\n"
        "print(kernel_path(model).name, build_status()['available'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_TRITON_INTERPRET", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    if "could not be built" in done.stderr:
        pytest.skip("no C compiler here: kernels='exact' is refused on the CPU, as it should be")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["cpu-exact", "True"]


def test_library_and_unknown_kernels_on_cpu(tmp_path):
    folder = save_hf(build_hf("llama", seed=0), tmp_path / "llama")
    model = load_model(str(folder), dtype="float32", device="cpu", kernels="library")
    assert kernel_path(model).name == "mkl" and not kernel_path(model).exact
    assert model.layers[0].self_attn.o_proj.packed is None
    assert set(kernel_path(model).to_dict()) == {"name", "exact", "detail", "weights"}
    with pytest.raises(UserError, match="unknown kernels"):
        load_model(str(folder), dtype="float32", device="cpu", kernels="fast")

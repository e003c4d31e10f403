"""The exact (Triton) kernels against the library path (cuBLAS + SDPA + torch.compile) on one GPU, in one call:

(a) invariance on the real shapes (default model and Llama-3-8B, bf16): every GEMM kind's rows
    (M = 1..64) and every attention token (blocks of 1..16, a tree, 3 batch rows, any number of programs
    per token) bitwise equal to the row / token computed alone: PASS or FAIL per kernel;
(b) GEMM time per weight shape at M = 1 and 16, measured *in place*: a CUDA graph of back-to-back calls
    cycling through copies of the weight (200 MB or more in all, so no weight is served from L2, as in a
    forward), divided by the number of calls, each kernel fused as in the forward (q/k/v and gate_up
    take a NormedRows input, o_proj and down add the residual and write the next norm's input): the
    exact kernel (its current tiling) vs F.linear (cuBLAS), us and % of the copy bandwidth; ablations
    (the paired gate_up / qkv weights run as a plain GEMM: what the fusion costs);
(c) a sweep of tilings per shape (M = 1, then M = 16 for the best);
(d) attention at context 512 and 2048 (T = 1 and 16), in place: the exact kernel vs SDPA with the
    library's mask, and (T = 1) other (block_s, chunk) tilings;
(e) whole forwards replayed from CUDA graphs after a 512-token context, default-model shape and 8B shape
    (random bf16 weights): exact (the shipped tilings), exact-tuned (each of the sweep's best tilings
    tried alone in the whole forward, then those that make it faster together: the TUNED_GEMM entries
    the forward supports), exact without PDL and without the L2 weight prefetch (default model),
    library; k = 1, 2, 4, 8, 11, 16 new tokens: ms, the verify ratio r(k) = t(k) / t(1), plain
    decoding's forwards per second against the weight-reading floor, the engine's plain decoding
    tokens/s, a 4-token block vs 4 single steps after 64- and 512-token prefixes (bitwise), and a kernel
    profile of one eager forward.

Results go to OUT/kernels.json as each part finishes; a compact table is printed at the end.

    python benchmarks/kernels.py --out OUT [--quick] [--skip-8b] [--tp2] [--sweep-seconds 100]
    python benchmarks/kernels.py --asm     # no GPU: the sm_90 code of every kernel (smem, registers, MMA kind)

About 2 minutes on an H200 (--budget caps the optional parts); --quick skips the sweep, the attention
tilings and the tuned / no-PDL forwards (about a minute).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import LLAMA3_8B, decode_rate  # noqa: E402
from specdec.costs import copy_bandwidth, weight_bytes_per_forward  # noqa: E402
from specdec.graphs import GraphedModel  # noqa: E402
from specdec.models.kernels import block_equals_steps, kernel_path, use_kernels  # noqa: E402
from specdec.models.llama import ModelConfig, build_attention_mask, random_llama  # noqa: E402

DEFAULT = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # SmolLM2-135M
LLAMA3_8B_TP2 = dataclasses.replace(LLAMA3_8B, num_heads=16, num_kv_heads=4, intermediate_size=7168, vocab_size=64128)
# one rank's weights of the 8B shape at TP=2 (specdec/models/tensor_parallel.py): half the heads and MLP features
# (q/k/v, gate_up), half the inputs of o_proj and down, half the vocabulary. Its forward is a rank's compute
# without the communication and the partial sums' kernels (tensor_parallel.py times those on 2 GPUs).
MODELS = {"default": DEFAULT, "8b": LLAMA3_8B, "8b-tp2": LLAMA3_8B_TP2}
ROWS = (1, 2, 5, 11, 16, 33, 64)
BENCH_ROWS = (1, 16)
KS = (1, 2, 4, 8, 11, 16)
CONTEXT = 512
DTYPE = torch.bfloat16
STREAM_BYTES = 200 << 20  # weight copies per timed graph: more than 3x an H200's L2


def ops():
    from specdec.models import triton_ops

    return triton_ops


def gemm_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """kind -> weight (N, K) of one decoder layer and the LM head."""
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return {"qkv": (qkv, c.hidden_size), "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def tuning_key(kind: str, c: ModelConfig) -> tuple:
    """triton_ops.TUNED_GEMM's key for this weight: (kernel kind, rows per accumulator, K, dtype)."""
    N, K = gemm_shapes(c)[kind]
    if kind == "qkv":
        return ("qkv", N // 2, K, DTYPE)
    if kind == "gate_up":
        return ("silu", N // 2, K, DTYPE)
    return ("plain", N, K, DTYPE)


class GemmCase:
    """One weight of one model shape (with copies to stream through), inputs for up to 64 rows, run
    through its exact kernel as the forward runs it: q/k/v and gate_up take their RMSNorm as NormedRows
    (made once, outside the timed calls: in a forward the GEMM before writes them), o_proj and down add
    the residual and write the next norm's NormedRows. "as_plain": the same weight through the plain
    kernel (no norm, no fusion)."""

    def __init__(self, c: ModelConfig, kind: str, device: torch.device, copies: int = 1, as_plain: bool = False) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.c, self.kind, self.as_plain = c, kind, as_plain
        N, K = gemm_shapes(c)[kind]
        self.weights = [(torch.randn(N, K, device=device, generator=gen) * K ** -0.5).to(DTYPE) for _ in range(copies)]
        self.weight = self.weights[0]
        self.x = torch.randn(max(ROWS), K, device=device, generator=gen).to(DTYPE)
        self.norm = (1 + 0.1 * torch.randn(K, device=device, generator=gen)).to(DTYPE)
        self.next_norm = (1 + 0.1 * torch.randn(N, device=device, generator=gen)).to(DTYPE)
        self.residual = torch.randn(max(ROWS), N, device=device, generator=gen).to(DTYPE)
        self.inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=device).float() / c.head_dim)
        self.positions = torch.arange(CONTEXT, CONTEXT + max(ROWS), device=device)[None]  # [1, 64]
        self.k_cache = torch.zeros(1, c.num_kv_heads, CONTEXT + max(ROWS), c.head_dim, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.lengths = torch.full((1,), CONTEXT, device=device)
        self.normed: dict[tuple[int, int], object] = {}

    def rows(self, rows: slice):
        """x[rows], as NormedRows for the kinds that fuse a norm (cached: made outside timed graphs)."""
        if self.as_plain or self.kind not in ("qkv", "gate_up"):
            return self.x[rows]
        key = (rows.start or 0, rows.stop)
        if key not in self.normed:
            self.normed[key] = ops().prenorm(self.x[rows], self.norm, 1e-5)
        return self.normed[key]

    def run(self, rows: slice, config=None, weight=None) -> tuple[torch.Tensor, ...]:
        o, x, c = ops(), self.rows(rows), self.c
        w = self.weight if weight is None else weight
        M = self.x[rows].shape[0]
        if self.as_plain:
            return (o.linear(x, w, config=config),)
        if self.kind == "qkv":
            lengths = self.lengths if rows.start == 0 else self.lengths + rows.start  # no extra kernel in timed graphs
            q = o.qkv_rope_write(x, w, None, self.positions[:, rows], self.inv_freq, 1.0, self.k_cache,
                                 self.v_cache, lengths, M, c.num_heads, c.num_kv_heads, config=config)
            slots = slice(CONTEXT + rows.start, CONTEXT + rows.start + M)
            return q, self.k_cache[0, :, slots], self.v_cache[0, :, slots]
        if self.kind == "gate_up":
            return (o.silu_linear(x, w, None, config),)
        if self.kind == "lm_head":
            return (o.linear(x, w, out_dtype=torch.float32, config=config),)
        y, normed = o.linear(x, w, residual=self.residual[rows], config=config, next_norm=(self.next_norm, 1e-5))
        return y, normed.x, normed.sq

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def copies_for(c: ModelConfig, kind: str) -> int:
    N, K = gemm_shapes(c)[kind]
    return max(2, min(400, math.ceil(STREAM_BYTES / (N * K * 2))))


def rows_invariant(case: GemmCase) -> bool:
    alone = [tuple(t.clone() for t in case.run(slice(m, m + 1))) for m in range(max(ROWS))]
    for rows in ROWS:
        for i, out in enumerate(case.run(slice(0, rows))):
            if not torch.equal(out, torch.cat([a[i] for a in alone[:rows]], dim=-2)):
                return False
    return True


def attention_invariant(c: ModelConfig, device: torch.device) -> dict[str, bool]:
    """Tokens of causal blocks (T = 1..16) and of a 16-node tree, over 3 batch rows of different
    lengths, against each token computed alone as the chain it stands for, and the same tokens with
    1 and 3 programs per token."""
    o = ops()
    gen = torch.Generator(device=device).manual_seed(1)
    B, S = 3, 1024
    k_cache = torch.randn(B, c.num_kv_heads, S, c.head_dim, device=device, generator=gen).to(DTYPE)
    v_cache = torch.randn(B, c.num_kv_heads, S, c.head_dim, device=device, generator=gen).to(DTYPE)
    lengths = torch.tensor([CONTEXT, 37, 700], device=device)
    result = {}
    for name, T in [("causal", t) for t in (1, 2, 5, 11, 16)] + [("tree", 16)]:
        mask, positions = None, lengths[:, None] + torch.arange(T, device=device)
        if name == "tree":
            parents = [max(0, i - 1 - (i % 3)) for i in range(T)]  # a few branches
            seen = torch.eye(T, dtype=torch.bool)
            depth = torch.zeros(T, dtype=torch.long)
            for i in range(1, T):
                seen[i] |= seen[parents[i]]
                depth[i] = depth[parents[i]] + 1
            mask, positions = seen.expand(B, T, T).to(device), lengths[:, None] + depth.to(device)
        q = torch.randn(B * T, c.num_heads * c.head_dim, device=device, generator=gen).to(DTYPE)
        visible = None if mask is None else o.visible_order(mask)
        out = o.attention(q, k_cache, v_cache, lengths, T, visible, positions)
        ok = all(torch.equal(out, o.attention(q, k_cache, v_cache, lengths, T, visible, positions, programs=p)) for p in (1, 3))
        for b in range(B):
            for t in range(T):
                seen_t = torch.arange(t + 1, device=device) if mask is None else mask[b, t].nonzero()[:, 0]
                start = int(lengths[b])
                k, v = k_cache[b:b + 1].clone(), v_cache[b:b + 1].clone()
                k[:, :, start:start + len(seen_t)] = k_cache[b:b + 1, :, start + seen_t]
                v[:, :, start:start + len(seen_t)] = v_cache[b:b + 1, :, start + seen_t]
                alone = o.attention(q[b * T + t:b * T + t + 1], k, v, torch.tensor([start + len(seen_t) - 1], device=device),
                                    1, None, positions[b:b + 1, t:t + 1].contiguous())
                ok &= torch.equal(alone[0], out[b * T + t])
        result[f"attention {name} T={T}"] = ok
    return result


def check_invariance(device: torch.device) -> dict[str, bool]:
    checks = {}
    for model, c in MODELS.items():
        for kind in gemm_shapes(c):
            checks[f"{model} gemm {kind}"] = rows_invariant(GemmCase(c, kind, device))
        checks.update({f"{model} {k}": v for k, v in attention_invariant(c, device).items()})
        x = torch.randn(max(ROWS), c.hidden_size, device=device).to(DTYPE)
        w = torch.ones(c.hidden_size, device=device, dtype=DTYPE)
        full = ops().rms_norm(x, w, 1e-5)
        checks[f"{model} rms_norm"] = all(torch.equal(ops().rms_norm(x[:r].contiguous(), w, 1e-5), full[:r]) for r in ROWS)
        normed = ops().prenorm(x, w, 1e-5)
        checks[f"{model} prenorm"] = all(torch.equal(again.x, normed.x[:r]) and torch.equal(again.sq, normed.sq[:r])
                                         for r in ROWS for again in [ops().prenorm(x[:r].contiguous(), w, 1e-5)])
        torch.cuda.empty_cache()
    return checks


def graph_us(calls: list, replays: int = 7) -> float:
    """Median us per call of `calls` run back to back, captured once into a CUDA graph (in place: no
    host overhead, each call's launch and ramp-up included as in a forward)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, warm up
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(samples)


def time_exact(case: GemmCase, M: int, config=None) -> float:
    return graph_us([lambda w=w: case.run(slice(0, M), config, w) for w in case.weights])


def time_cublas(case: GemmCase, M: int) -> float:
    x = case.x[:M]
    return graph_us([lambda w=w: F.linear(x, w) for w in case.weights])


def gemm_times(device: torch.device, bandwidth: float) -> list[dict]:
    rows = []
    cases = [(m, k, False) for m, c in MODELS.items() for k in gemm_shapes(c)]
    cases += [(m, k, True) for m in MODELS for k in ("qkv", "gate_up")]  # ablation: the paired weights as a plain GEMM
    for model, kind, as_plain in cases:
        c = MODELS[model]
        case = GemmCase(c, kind, device, copies_for(c, kind), as_plain)
        for M in BENCH_ROWS:
            exact, lib = time_exact(case, M), time_cublas(case, M)
            pct = lambda us: 100 * case.weight_bytes() / (us * 1e-6) / bandwidth  # noqa: E731
            rows.append({"model": model, "kind": kind + (" as plain" if as_plain else ""), "N_K": gemm_shapes(c)[kind], "M": M,
                         "exact_us": exact, "cublas_us": lib, "exact_pct_copy": pct(exact), "cublas_pct_copy": pct(lib),
                         "config": str(current_config(c, kind, as_plain))})
        del case
        torch.cuda.empty_cache()
    return rows


def current_config(c: ModelConfig, kind: str, as_plain: bool = False):
    o = ops()
    N, K = gemm_shapes(c)[kind]
    if as_plain:
        return o.pick_gemm_config("plain", N, K, DTYPE)
    key = tuning_key(kind, c)
    return o.pick_gemm_config(key[0], key[1], key[2], DTYPE)


def candidate_configs(kind: str, c: ModelConfig) -> list:
    """A few tilings around the heuristic's: K steps of 64/128 (small K) or 128/256, split-K 1, the
    heuristic's, half and twice it, and the split that about fills the GPU (what the heuristic picks for
    weights above SPLIT_MIN_BYTES per program), the most pipeline stages that fit; for weights with more
    64-row tiles than SMs also 128-row tiles (8 warps: two wgmma groups)."""
    o = ops()
    key = tuning_key(kind, c)
    _, rows, K, _ = key
    base = o.pick_gemm_config(key[0], rows, K, DTYPE)
    tiles = 1 if key[0] == "plain" else 2
    configs = [base]
    widths = (64, 128) if -(-rows // 64) > o.SMS else (64,)
    for block_n in widths:
        for block_k in ((64, 128) if K <= 1024 else (128, 256)):
            k_blocks, n_tiles = -(-K // block_k), -(-rows // block_n)
            fill = max(1, min(o.SMS // n_tiles, k_blocks // 3))
            splits = {1, base.split_k, 2 * base.split_k, max(1, base.split_k // 2), fill} if block_n == 64 else {1}
            for split in sorted(splits):
                if split > k_blocks or (split > 1 and n_tiles * split > 3 * o.SMS):
                    continue
                stage = (tiles * block_n + o.BLOCK_T) * block_k * 2
                budget = 216 * 1024 if n_tiles * split <= o.SMS else 110 * 1024
                stages = max(2, min(6, budget // stage, -(-k_blocks // split) + 1))
                config = o.GemmConfig(block_n, block_k, split, 4 if block_n == 64 else 8, stages)
                if config not in configs:
                    configs.append(config)
                if block_n == 64 and split == base.split_k and block_k == base.block_k and stages > 3:
                    fewer = o.GemmConfig(block_n, block_k, split, 4, 3)  # fewer stages: two programs per SM
                    if fewer not in configs:
                        configs.append(fewer)
    return configs


def sweep(device: torch.device, seconds: float) -> list[dict]:
    """Tilings per shape at M = 1 (decode) then M = 16 (verify) for each; best = least M=1 time + M=16
    time / 8 (decode dominates)."""
    deadline, results = time.perf_counter() + seconds, []
    for model, c in MODELS.items():  # the default model first (its target comes first)
        for kind in gemm_shapes(c):
            case = GemmCase(c, kind, device, copies_for(c, kind))
            for config in candidate_configs(kind, c):
                if time.perf_counter() > deadline:
                    return results
                try:
                    t1, t16 = time_exact(case, 1, config), time_exact(case, 16, config)
                except Exception as e:  # out of shared memory, a compiler refusal: record it, go on
                    results.append({"model": model, "kind": kind, "config": vars(config), "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                results.append({"model": model, "kind": kind, "config": vars(config), "us_m1": t1, "us_m16": t16,
                                "pct_copy_m1": 100 * case.weight_bytes() / (t1 * 1e-6) / results_bandwidth[0]})
            del case
            torch.cuda.empty_cache()
    return results


results_bandwidth = [1.0]


def best_tilings(sweep_rows: list[dict]) -> dict:
    """(model, kind) -> the best sweep row."""
    best = {}
    for r in sweep_rows:
        if "us_m1" not in r:
            continue
        key, score = (r["model"], r["kind"]), r["us_m1"] + r["us_m16"] / 8
        if key not in best or score < best[key]["score"]:
            best[key] = {**r, "score": score}
    return best


def swept_entries(best: dict) -> dict[str, dict]:
    """model -> {TUNED_GEMM key: GemmConfig} of the sweep's best tilings (tried in the whole forward by
    whole_forwards' exact-tuned; TUNED_GEMM itself is left as shipped)."""
    o, entries = ops(), {}
    for (model, kind), r in best.items():
        entries.setdefault(model, {})[tuning_key(kind, MODELS[model])] = o.GemmConfig(**r["config"])
    return entries


ATTENTION_PROGRAMS = (1, 2, 3, 5, 9)
ATTENTION_CANDIDATES = [(64, 128, 4, 2), (64, 256, 4, 2), (32, 128, 4, 2), (128, 256, 4, 2), (64, 64, 4, 2)]  # block_s, chunk, warps, stages


def attention_times(device: torch.device, tilings: bool) -> list[dict]:
    """Exact kernel (current tiling) vs SDPA, in place; at T = 1 also the candidate tilings (us)."""
    o, rows = ops(), []
    for model, c in MODELS.items():
        layers = 32  # caches to cycle through (like a forward's layers)
        for context in (512, 2048):
            S = context + 64
            caches = [(torch.randn(1, c.num_kv_heads, S, c.head_dim, device=device, dtype=DTYPE),
                       torch.randn(1, c.num_kv_heads, S, c.head_dim, device=device, dtype=DTYPE)) for _ in range(layers)]
            for T in (1, 16):
                lengths = torch.tensor([context], device=device)
                positions = lengths[:, None] + torch.arange(T, device=device)
                q = torch.randn(T, c.num_heads * c.head_dim, device=device, dtype=DTYPE)
                exact = graph_us([lambda k=k, v=v: o.attention(q, k, v, lengths, T, None, positions) for k, v in caches])
                mask = build_attention_mask(lengths, positions, positions, None, None, S)
                qq = q.view(1, T, c.num_heads, c.head_dim).transpose(1, 2)
                lib = graph_us([lambda k=k, v=v: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True)
                                for k, v in caches])
                row = {"model": model, "context": context, "T": T, "exact_us": exact, "sdpa_us": lib}
                if T == 1 and tilings:
                    row["tilings"] = {str(t): graph_us([lambda k=k, v=v, t=t: o.attention(q, k, v, lengths, T, None, positions,
                                                                                         config=o.AttentionConfig(*t))
                                                        for k, v in caches]) for t in ATTENTION_CANDIDATES}
                if T == 1 and tilings:  # programs per (token, KV head): the work split, not the bits
                    row["programs"] = {str(P): graph_us([lambda k=k, v=v, P=P: o.attention(q, k, v, lengths, T, None, positions, programs=P)
                                                         for k, v in caches]) for P in ATTENTION_PROGRAMS}
                rows.append(row)
            del caches
    return rows


def graph_forward_ms(model, ks=KS, repeats: int = 20) -> dict[int, float]:
    """Median ms of one graph replay per k new tokens after a CONTEXT-token prefix (static cache)."""
    device = next(model.parameters()).device
    cache = model.new_cache(1, 1024, static=True)
    ids = torch.randint(0, model.config.vocab_size, (1, CONTEXT + max(ks)), device=device)
    model(ids[:, :CONTEXT], torch.arange(CONTEXT, device=device)[None], cache)
    graphed = GraphedModel(model, cache)
    times = {}
    for k in ks:
        block, positions = ids[:, CONTEXT:CONTEXT + k], torch.arange(CONTEXT, CONTEXT + k, device=device)[None]
        cache.lengths.fill_(CONTEXT)
        graphed(block, positions, cache)  # capture
        graph = graphed.graphs[(k, None)].graph
        samples = []
        for _ in range(repeats):
            cache.lengths.fill_(CONTEXT)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times[k] = statistics.median(samples)
    del graphed
    return times


def kernel_profile(model, top: int = 12) -> dict:
    """Device time by kernel name of one eager decode forward (1 token after CONTEXT): where time goes."""
    from collections import defaultdict

    device = next(model.parameters()).device
    cache = model.new_cache(1, 1024)
    ids = torch.randint(0, model.config.vocab_size, (1, CONTEXT + 1), device=device)
    model(ids[:, :CONTEXT], torch.arange(CONTEXT, device=device)[None], cache)
    model(ids[:, CONTEXT:], torch.tensor([[CONTEXT]], device=device), cache)  # warm
    cache.lengths.fill_(CONTEXT)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(ids[:, CONTEXT:], torch.tensor([[CONTEXT]], device=device), cache)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:50]].append(e.device_time)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels": sum(len(v) for v in by_name.values()), "kernel_us": sum(sum(v) for v in by_name.values()),
            "top": [{"name": n, "count": len(v), "us": sum(v)} for n, v in ranked]}


def whole_forwards(name: str, c: ModelConfig, device: torch.device, bandwidth: float, variants: list[str],
                   swept: dict | None = None, time_left=lambda: 1e9) -> dict:
    """Graph-replayed forwards of a random model of shape c, per variant: exact (the shipped tilings:
    the heuristic and triton_ops.TUNED_GEMM), exact-heuristic (no table), exact-tuned (see below),
    exact-nopdl, exact-noprefetch, library. exact-tuned: each of the sweep's best tilings for this
    model (`swept`: key -> GemmConfig) that differs from the shipped one is tried alone in the whole
    forward (t(1), t(16), against the shipped forward measured before and after); those that make t(1)
    faster by more than 0.3 % are kept ("supported_entries": the TUNED_GEMM lines the forward supports)
    and measured together."""
    o = ops()
    model = random_llama(c, device)
    floor_ms = weight_bytes_per_forward(model) / bandwidth * 1e3
    prompt = torch.randint(0, c.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {"floor_ms": floor_ms, "weight_bytes": weight_bytes_per_forward(model)}
    shipped = dict(o.TUNED_GEMM)

    def configure(variant: str, extra: dict | None = None) -> None:
        o.TUNED_GEMM.clear()
        if variant != "exact-heuristic":
            o.TUNED_GEMM.update(shipped)
        o.TUNED_GEMM.update(extra or {})
        o.PDL = variant != "exact-nopdl"
        o.PREFETCH = variant != "exact-noprefetch"
        use_kernels(model, "library" if variant == "library" else "exact")

    for variant in variants:
        if variant not in ("exact", "library") and time_left() < 45:
            print(f"  {name} {variant}: skipped (time budget)", flush=True)
            continue
        t0 = time.perf_counter()
        extra = None
        try:
            if variant == "exact-tuned":
                extra, out["tuned_entries"] = validate_entries(model, swept or {}, shipped, configure, time_left)
                out["supported_entries"] = [entry_record(k, v) for k, v in extra.items()]
                if not extra:
                    print(f"  {name} {variant}: no entry helps the forward ({time.perf_counter() - t0:.0f} s)", flush=True)
                    continue
            configure(variant, extra)
            ks = KS if variant in ("exact", "library") else (1, 16)
            ms = graph_forward_ms(model, ks)
            entry = {"kernel_path": kernel_path(model).name, "forward_ms": ms, "verify_ratio": {k: t / ms[1] for k, t in ms.items()},
                     "forwards_per_s": 1e3 / ms[1], "pct_of_floor": 100 * floor_ms / ms[1]}
            if variant in ("exact", "library", "exact-tuned"):
                entry["engine_tokens_per_s"] = decode_rate(model, prompt)
                entry["block_equals_steps"] = block_equals_steps(model, contexts=(64, CONTEXT))
                entry["profile"] = kernel_profile(model)
        except Exception as e:  # keep the other variants' results
            entry = {"error": f"{type(e).__name__}: {e}"[:500]}
        entry["seconds"] = time.perf_counter() - t0
        out[variant] = entry
        print(f"  {name} {variant}: {time.perf_counter() - t0:.0f} s", flush=True)
        torch.cuda.empty_cache()
    o.TUNED_GEMM.clear()
    o.TUNED_GEMM.update(shipped)
    o.PDL = o.PREFETCH = True
    del model
    torch.cuda.empty_cache()
    return out


def entry_record(key: tuple, config) -> dict:
    """A TUNED_GEMM line as JSON (load_entries reads it back)."""
    kind, rows, K, dtype = key
    return {"kind": kind, "rows": rows, "K": K, "dtype": str(dtype).removeprefix("torch."), "config": vars(config)}


def load_entries(path: str | Path) -> dict:
    """The TUNED_GEMM lines a kernels.json's whole forwards supported (every model's), for another
    benchmark to run with: {(kind, rows, K, dtype): GemmConfig}."""
    o, entries = ops(), {}
    results = json.loads(Path(path).read_text())
    for name, part in results.items():
        if name.startswith("forward_") and isinstance(part, dict):
            for e in part.get("supported_entries", []):
                entries[(e["kind"], e["rows"], e["K"], getattr(torch, e["dtype"]))] = o.GemmConfig(**e["config"])
    return entries


def validate_entries(model, swept: dict, shipped: dict, configure, time_left) -> tuple[dict, dict]:
    """Try each swept tiling alone in the whole forward (see whole_forwards); returns (the entries that
    make t(1) faster by more than 0.3 %, every entry's effect)."""
    o = ops()
    configure("exact")
    candidates = {key: config for key, config in swept.items() if o.pick_gemm_config(*key) != config}
    if not candidates:
        return {}, {}
    before = graph_forward_ms(model, (1, 16))
    effects, tried = {}, {}
    for key, config in candidates.items():
        if time_left() < 30:
            break
        configure("exact", {key: config})
        tried[key] = graph_forward_ms(model, (1, 16))
    configure("exact")
    after = graph_forward_ms(model, (1, 16))
    base = {k: (before[k] + after[k]) / 2 for k in before}
    helped = {}
    for key, ms in tried.items():
        delta = {k: 100 * (ms[k] / base[k] - 1) for k in ms}
        effects[str(key)] = {"config": vars(candidates[key]), "forward_ms": ms, "delta_pct": delta,
                             "shipped_ms": base, "shipped_noise_pct": 100 * abs(before[1] - after[1]) / base[1]}
        if delta[1] < -0.3:
            helped[key] = candidates[key]
    return helped, effects


def asm_report() -> list[dict]:
    """Compile every kernel of both model shapes (bf16, M = 1, heuristic tilings, PDL on) for sm_90 on
    this machine, no GPU needed, and report what the code is: shared memory, registers, spills, MMA
    instructions (wgmma / mma.sync), async copies, griddepcontrol. Uses Triton's bundled cuobjdump."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    o = ops()
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    compiled = []

    class Launcher:  # stands in for kernel[grid]: compile with the JIT's own specialisation, run nothing
        def __init__(self, fn, grid):
            self.fn, self.grid = fn, grid

        def __call__(self, *args, **kwargs):
            bound, spec, options = create_function_from_signature(self.fn.signature, self.fn.params, backend)(*args, **kwargs)
            options, signature, constexprs, attrs = self.fn._pack_args(backend, kwargs, bound, spec, options)
            compiled.append((self.fn.__name__, self.grid, triton.compile(ASTSource(self.fn, signature, constexprs, attrs),
                                                                         target=target, options=options.__dict__)))

    getitem, launch = JITFunction.__getitem__, o.launch_options
    JITFunction.__getitem__ = lambda self, grid: Launcher(self, grid)
    o.launch_options = lambda device: (True, {"launch_pdl": True})
    rows = []
    try:
        for model, c in MODELS.items():
            z = lambda *shape, dtype=DTYPE: torch.zeros(*shape, dtype=dtype)  # noqa: E731
            D, I, H, Hkv, Dh = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
            pos, lengths, cache = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), z(1, Hkv, 1024, Dh)
            normed = lambda M, D: o.NormedRows(z(M, D), z(M, -(-D // o.NORM_PART), dtype=torch.float32), 1e-5)  # noqa: E731
            calls = {"qkv": lambda: o.qkv_rope_write(normed(1, D), z((H + 2 * Hkv) * Dh, D), None, pos, z(Dh // 2, dtype=torch.float32),
                                                     1.0, cache, cache, lengths, 1, H, Hkv),
                     "o_proj": lambda: o.linear(z(1, H * Dh), z(D, H * Dh), residual=z(1, D), next_norm=(z(D), 1e-5)),
                     "gate_up": lambda: o.silu_linear(normed(1, D), z(2 * I, D)),
                     "down": lambda: o.linear(z(1, I), z(D, I), residual=z(1, D), next_norm=(z(D), 1e-5)),
                     "lm_head": lambda: o.linear(z(1, D), z(c.vocab_size, D), out_dtype=torch.float32),
                     "attention": lambda: o.attention(z(1, H * Dh), cache, cache, lengths, 1, None, pos),
                     "prenorm": lambda: o.prenorm(z(1, D), z(D), 1e-5),
                     "rms_norm": lambda: o.rms_norm(z(1, D), z(D), 1e-5)}
            for name, call in calls.items():
                compiled.clear()
                call()
                kernel_name, grid, k = compiled[-1]
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
                    usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
                regs = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
                ptx = k.asm["ptx"]
                rows.append({"model": model, "kernel": name, "grid": grid, "shared_bytes": k.metadata.shared,
                             "registers": int(regs.group(1)) if regs else None, "spill_bytes": int(regs.group(3)) if regs else None,
                             "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": len(re.findall(r"\bHMMA", sass)),
                             "cp_async": len(re.findall(r"LDGSTS", sass)), "pdl": "griddepcontrol.wait" in ptx,
                             "l2_prefetch": ptx.count("prefetch.global.L2")})
    finally:
        JITFunction.__getitem__, o.launch_options = getitem, launch
    for r in rows:
        print(f"{r['model']:8s}{r['kernel']:10s} grid {str(r['grid']):14s} smem {r['shared_bytes']:6d} regs {r['registers']} spill {r['spill_bytes']} "
              f"wgmma {r['wgmma']} mma.sync {r['mma_sync']} cp.async {r['cp_async']} pdl {r['pdl']} prefetch {r['l2_prefetch']}")
    return rows


def save(out: Path, results: dict) -> None:
    (out / "kernels.json").write_text(json.dumps(results, indent=1, default=str))


def print_table(results: dict) -> None:
    inv = results.get("invariance", {})
    fails = [k for k, ok in inv.items() if not ok]
    print(f"\n== (a) invariance (bf16, real shapes): {sum(inv.values())}/{len(inv)} PASS" + (f"; FAIL: {fails}" if fails else ""))
    print("\n== (b) GEMM in place, us (% of copy bandwidth): exact | cuBLAS   [exact tiling]")
    by = {}
    for r in results.get("gemm", []):
        by.setdefault((r["model"], r["kind"], str(r["N_K"]), r["config"]), {})[r["M"]] = r
    for (model, kind, nk, config), ms in by.items():
        cells = "  ".join(f"M={M:2d} {r['exact_us']:7.1f} ({r['exact_pct_copy']:4.0f}%) | {r['cublas_us']:7.1f} ({r['cublas_pct_copy']:4.0f}%)"
                          for M, r in sorted(ms.items()))
        print(f"{model:8s}{kind:17s}{nk:15s} {cells}   {config.replace('GemmConfig', '')}")
    best = best_tilings(results.get("sweep", []))
    if best:
        print("\n== (c) sweep: best tiling per shape (us at M=1 / M=16, % copy at M=1)")
        for (model, kind), r in best.items():
            print(f"{model:8s}{kind:8s} {r['config']}  {r['us_m1']:.1f} / {r['us_m16']:.1f}  ({r['pct_copy_m1']:.0f}%)")
        print("sweep's best (tried one at a time in the whole forwards below):", results.get("tuned_table"))
    print("\n== (d) attention in place, us: exact | SDPA   [T=1 tilings (block_s, chunk, warps, stages): us; programs per token: us]")
    for r in results.get("attention", []):
        tilings = " ".join(f"{k}:{v:.1f}" for k, v in r.get("tilings", {}).items())
        programs = " ".join(f"P={k}:{v:.1f}" for k, v in r.get("programs", {}).items())
        print(f"{r['model']:8s} context {r['context']:5d} T={r['T']:2d}  {r['exact_us']:7.1f} | {r['sdpa_us']:7.1f}  {tilings}  {programs}")
    print("\n== (e) whole forwards in CUDA graphs (context 512, batch 1)")
    for name in MODELS:
        f = results.get(f"forward_{name}")
        if not f:
            continue
        for key, e in f.get("tuned_entries", {}).items():
            print(f"{name:8s}entry {key} {e['config']}: t(1) {e['delta_pct'][1]:+.2f} %, t(16) {e['delta_pct'][16]:+.2f} % "
                  f"(shipped {e['shipped_ms'][1]:.3f} ms, noise {e['shipped_noise_pct']:.2f} %)")
        if "supported_entries" in f:
            print(f"{name:8s}TUNED_GEMM entries the whole forward supports: {f['supported_entries']}")
        for variant in ("exact", "exact-tuned", "exact-heuristic", "exact-nopdl", "exact-noprefetch", "library"):
            p = f.get(variant)
            if not p:
                continue
            if "error" in p:
                print(f"{name:8s}{variant:12s} ERROR {p['error'][:300]}")
                continue
            ratios = " ".join(f"{k}:{v:.2f}" for k, v in p["verify_ratio"].items())
            engine = f"engine {p['engine_tokens_per_s']:7.1f} tok/s" if "engine_tokens_per_s" in p else ""
            same = {True: "block==steps", False: "BLOCK!=STEPS"}.get(p.get("block_equals_steps"), "")
            print(f"{name:8s}{variant:12s} t(1)={p['forward_ms'][1]:.3f} ms {p['forwards_per_s']:7.1f} fwd/s "
                  f"{p['pct_of_floor']:5.1f}% of floor ({f['floor_ms']:.3f} ms)  {engine}  {same}  r(k) {ratios}")
            prof = p.get("profile")
            if prof:
                print(f"{'':20s}eager forward: {prof['kernels']} kernels, {prof['kernel_us']:.0f} us: "
                      + ", ".join(f"{k['name'][:24]} {k['count']}x {k['us']:.0f}" for k in prof["top"][:6]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="skip the sweep, the attention tilings and the tuned / no-PDL forwards")
    ap.add_argument("--skip-8b", action="store_true", help="leave out the 8B shape (not 8b-tp2)")
    ap.add_argument("--tp2", action="store_true", help="also one rank's shapes of the 8B target at TP=2 (8b-tp2)")
    ap.add_argument("--sweep-seconds", type=float, default=100)
    ap.add_argument("--budget", type=float, default=280, help="seconds: the sweep and the optional forwards shrink to fit")
    ap.add_argument("--asm", action="store_true", help="no GPU: compile every kernel for sm_90 here and report its code")
    args = ap.parse_args()
    if args.skip_8b:
        MODELS.pop("8b")
    if not args.tp2:
        MODELS.pop("8b-tp2")
    if args.asm:
        asm_report()
        return 0
    if not args.out:
        ap.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    results: dict = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__}
    start = time.perf_counter()
    time_left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731

    def step(key: str, fn) -> None:
        t = time.perf_counter()
        try:
            results[key] = fn()
        except Exception as e:  # keep the other parts' results
            results[key + "_error"] = f"{type(e).__name__}: {e}"
            print(f"{key}: FAILED {results[key + '_error'][:500]}", flush=True)
        print(f"{key}: {time.perf_counter() - t:.0f} s (total {time.perf_counter() - start:.0f} s)", flush=True)
        save(out, results)

    bandwidth = copy_bandwidth(device)
    results_bandwidth[0] = bandwidth
    results["copy_bandwidth_gbs"] = bandwidth / 1e9
    step("invariance", lambda: check_invariance(device))
    step("gemm", lambda: gemm_times(device, bandwidth))
    swept: dict = {}
    if not args.quick:
        step("sweep", lambda: sweep(device, max(0.0, min(args.sweep_seconds, time_left() - 150))))
        swept = swept_entries(best_tilings(results.get("sweep", [])))
        results["tuned_table"] = {str(k): vars(v) for entries in swept.values() for k, v in entries.items()}
    step("attention", lambda: attention_times(device, tilings=not args.quick))
    variants = ["exact", "library"] if args.quick else ["exact", "exact-tuned", "exact-heuristic", "exact-nopdl",
                                                        "exact-noprefetch", "library"]
    if not ops().TUNED_GEMM:  # nothing shipped: exact is the heuristic
        variants = [v for v in variants if v != "exact-heuristic"]
    step("forward_default", lambda: whole_forwards("default", DEFAULT, device, bandwidth, variants, swept.get("default"), time_left))
    for name in [m for m in MODELS if m != "default"]:
        step(f"forward_{name}", lambda name=name: whole_forwards(name, MODELS[name], device, bandwidth,
                                                                 [v for v in variants if v in ("exact", "exact-tuned", "exact-heuristic", "library")],
                                                                 swept.get(name), time_left))
    print_table(results)
    print(f"\n{results['gpu']}, torch {results['torch']}, triton {results['triton']}, copy {results['copy_bandwidth_gbs']:.0f} GB/s; "
          f"total {time.perf_counter() - start:.0f} s; details in {out / 'kernels.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

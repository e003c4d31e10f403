"""Tensor-parallel costs on several GPUs: one rank per GPU, launched by torchrun.

    torchrun --nproc-per-node N benchmarks/tensor_parallel.py --shape 8b|70b --out DIR [--pair runs/.../results.json]

Random-weight targets of real shapes (bf16, batch 1, a 512-token context), sharded over N GPUs
(specdec/models/tensor_parallel.py), CUDA graphs on:

1. plain decoding through SpecEngine: tokens/s and ms per token, against the bandwidth floor (this rank's
   weight bytes over its measured copy bandwidth; every rank holds the same share);
2. the verify ratio r(k) = t(k) / t(1), k = 1..16, from graphed forwards;
3. speculation on top, measured per step (draft and verify device time, CUDA events): ngram (gamma 3)
   and an EAGLE head with random weights (the GPU's default tree, 24 nodes, depth 3). Random weights give
   no acceptance, so the speedup is an ESTIMATE: the acceptance (tau) measured on the default model's
   pair (`--pair`, a `specdec bench` results.json) over this target's measured step cost;
4. greedy speculative output equals plain greedy output on this sharded target (token for token);
5. the drafters run replicated on every rank; the alternative (draft on rank 0, broadcast the proposal)
   would add one broadcast per step: its cost, graphed, is measured here;
6. with --kernels, where a graphed one-token forward's time goes: each kernel's device time per forward
   (torch.profiler), their sum against the forward's wall time (the rest: gaps between kernels).

Rank 0 writes DIR/tp<N>-<shape>.json and prints a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import LLAMA3_8B  # noqa: E402
from kernels import entry_record, load_entries  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.costs import copy_bandwidth, measure_forward_times, verify_ratios, weight_bytes_per_forward  # noqa: E402
from specdec.drafters.eagle import GPU_TOTAL_TOKENS, EagleDrafter, EagleTreeConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models.eagle import EagleConfig, EagleHead  # noqa: E402
from specdec.models.llama import ModelConfig, random_llama  # noqa: E402
from specdec.models.tensor_parallel import join_group  # noqa: E402

SHAPES = {  # Llama-3-8B and Llama-3-70B
    "8b": LLAMA3_8B,
    "70b": dataclasses.replace(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64),
}
GAMMA = 3


def say(shard, *args) -> None:
    if shard.rank == 0:
        print(*args, flush=True)


def decode_rate(engine: SpecEngine, prompt: list[int], short: int = 32, long: int = 160) -> float:
    """Decode-only tokens/s: (long - short) / (time(long) - time(short)), graphs captured beforehand."""
    engine.generate([prompt], SpecConfig(gamma=GAMMA, max_new_tokens=8, stop_at_eos=False))
    times = {}
    for n in (short, long):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate([prompt], SpecConfig(gamma=GAMMA, max_new_tokens=n, stop_at_eos=False))
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - t
    return (long - short) / (times[long] - times[short])


def step_costs(engine: SpecEngine, prompt: list[int], tokens: int = 96) -> dict:
    """Mean draft and verify device time per step of one generation (Stepper.times, CUDA events), and its tokens."""
    engine.generate([prompt], SpecConfig(gamma=GAMMA, max_new_tokens=16, stop_at_eos=False))  # capture
    out = engine.generate([prompt], SpecConfig(gamma=GAMMA, max_new_tokens=tokens, stop_at_eos=False))
    t = out.times
    return {"steps": t.steps, "draft_ms": t.draft_s / t.steps * 1e3, "verify_ms": t.verify_s / t.steps * 1e3,
            "wall_ms_per_step": out.stats.wall_s / t.steps * 1e3, "token_ids": out.rows[0].token_ids}


def random_eagle(target, config: ModelConfig) -> EagleDrafter:
    """An EAGLE head of the target's shape with random weights (32k draft vocabulary), the GPU's default tree."""
    torch.manual_seed(1)  # the same head on every rank
    head = EagleHead(EagleConfig.for_target(config, draft_vocab_size=32000))
    head.d2t = torch.arange(32000)
    head = head.to(device="cuda", dtype=torch.bfloat16)
    return EagleDrafter(target, head, EagleTreeConfig(depth=GAMMA, total_tokens=GPU_TOTAL_TOKENS))


def graphed_us(op, repeats: int = 200) -> float:
    """Median microseconds of one `op` (a collective) replayed from a CUDA graph of 10, timed with events;
    the communicator is warmed outside the capture, and the ranks meet before it."""
    op()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            op()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats // 10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 10 * 1e3)
    return statistics.median(samples)


def broadcast_us(nodes: int = GPU_TOTAL_TOKENS) -> float:
    """One NCCL broadcast of an EAGLE proposal (tokens, parents, depths, int64 [1, nodes] each, and a bool tree
    mask [1, nodes, nodes + 1]): what drafting on rank 0 alone would add to every step."""
    buf = torch.zeros(3 * nodes * 8 + nodes * (nodes + 1), dtype=torch.uint8, device="cuda")
    return graphed_us(lambda: dist.broadcast(buf, src=0))


def all_gather_us(shard, D: int) -> float:
    """One NCCL all-gather of a decode step's float32 partial [1, D]: the communication each row-parallel
    layer adds."""
    from specdec.models.tensor_parallel import Split

    split, part = Split(shard, "rows", D), torch.zeros(1, D, dtype=torch.float32, device="cuda")
    return graphed_us(lambda: split.gather_ranks(part))


def skip_communication(shard) -> None:
    """DIAGNOSTIC ONLY (wrong outputs): every rank's partials stand in for all ranks', so a forward times the
    sharded computation without its communication."""
    from specdec.models.tensor_parallel import Split

    Split.gather_ranks = lambda self, y: y.expand(shard.world, *y.shape)


def kernel_profile(model, prompt: list[int], replays: int = 20) -> dict:
    """Device time per graphed one-token forward, by kernel (torch.profiler), and the forward's wall time
    (CUDA events): how much of a token is kernels and how much the gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    from specdec.costs import Stopwatch
    from specdec.graphs import GraphedModel, bucket

    cache = model.new_cache(1, bucket(len(prompt) + 2), static=True)
    graphed = GraphedModel(model, cache)
    ids = torch.tensor([prompt], device="cuda")
    graphed(ids, torch.arange(len(prompt), device="cuda")[None], cache)
    start = torch.tensor([len(prompt)], device="cuda")
    token, positions = ids[:, :1], start[:, None]

    def forward() -> None:
        cache.trim(start)
        graphed(token, positions, cache)

    for _ in range(3):  # capture and warm up
        forward()
    watch, walls = Stopwatch(torch.device("cuda")), []
    for _ in range(replays):
        watch.mark("start")
        forward()
        watch.mark("end")
        walls.append(watch.seconds("start", "end"))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            forward()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    kernels: dict[str, list[float]] = {}
    for e in events:
        kernels.setdefault(e.name, []).append(e.device_time_total)
    rows = sorted(({"kernel": name[:120], "per_forward": len(t) / replays, "us_per_forward": sum(t) / replays}
                   for name, t in kernels.items()), key=lambda r: -r["us_per_forward"])
    busy = sum(r["us_per_forward"] for r in rows)
    wall = statistics.median(walls) * 1e6
    return {"wall_us": wall, "kernel_us": busy, "gap_us": wall - busy, "kernels_per_forward": len(events) / replays,
            "by_kernel": rows, "first_kernels_in_order": kernel_sequence(events, replays)}


def kernel_sequence(events: list, replays: int, first: int = 60) -> list[dict]:
    """The first kernels of a forward in order, each with its median device time and the median gap before it
    over the replays (events: every replay's kernels, sorted by start; empty if the replays differ in count)."""
    n = len(events) // replays
    if n * replays != len(events):
        return []
    at = [[events[r * n + i] for r in range(replays)] for i in range(min(n, first))]  # [kernel][replay]
    return [{"kernel": same[0].name[:120], "us": statistics.median(e.device_time_total for e in same),
             "gap_before_us": statistics.median(e.time_range.start - before.time_range.end
                                                for e, before in zip(same, at[i - 1])) if i else 0.0}
            for i, same in enumerate(at)]


def pair_tau(path: str | None) -> dict:
    """tau and alpha per drafter of the default model's pair, from a `specdec bench` results.json."""
    if path is None:
        return {}
    results = json.loads(Path(path).read_text())
    out = {}
    for m in results["methods"]:
        if m.get("family") == "specdec" and m.get("drafter") in ("ngram", "eagle") and m.get("gamma") == GAMMA:
            out[m["drafter"]] = {"tau": m["mean_accepted_length"], "alpha": m["acceptance_rate"], "method": m["name"],
                                 "source": f"{path} ({results.get('environment', {}).get('device', '?')}, "
                                           f"{results.get('config', {}).get('dtype', '?')})"}
    return out


def use_tuned(path: str | None) -> dict:
    """Add a kernels.json's supported GEMM tilings to triton_ops.TUNED_GEMM; the entries added."""
    if path is None:
        return {}
    from specdec.models import triton_ops

    entries = load_entries(path)
    triton_ops.TUNED_GEMM.update(entries)
    return entries


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pair", default=None, help="a `specdec bench` results.json of the default model with ngram and eagle at gamma 3")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--skip-drafters", action="store_true")
    ap.add_argument("--compute-only", action="store_true", help="diagnostic: no communication (wrong outputs), times only")
    ap.add_argument("--kernels", action="store_true", help="profile a graphed one-token forward by kernel")
    ap.add_argument("--tuned", default=None, help="a benchmarks/kernels.py kernels.json: run with the GEMM tilings its "
                                                  "whole forwards supported (e.g. --tp2's, for one rank's shapes)")
    args = ap.parse_args()
    shard = join_group(int(os.environ.get("WORLD_SIZE", "1")), "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    config = SHAPES[args.shape]
    t0 = time.perf_counter()
    tuned = use_tuned(args.tuned)
    if args.tuned:
        say(shard, f"GEMM tilings from {args.tuned}: " + (", ".join(f"{k[0]} {k[1]}x{k[2]}" for k in tuned) or "none"))
    if args.compute_only:
        skip_communication(shard)
    model = random_llama(config, "cuda", torch.bfloat16, seed=0, shard=shard)
    prompt = torch.randint(0, config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(1)).tolist()
    weight_bytes, bandwidth = weight_bytes_per_forward(model), copy_bandwidth(torch.device("cuda"))
    say(shard, f"tp {shard.world} {args.shape}: built in {time.perf_counter() - t0:.0f} s; {weight_bytes / 2**30:.2f} GiB of "
               f"weights per rank; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    plain = SpecEngine(model, "none")
    rate = decode_rate(plain, prompt)
    floor = bandwidth / weight_bytes
    say(shard, f"plain: {rate:.1f} tok/s, {1e3 / rate:.2f} ms/token; floor {floor:.1f} tok/s ({rate / floor:.1%})")
    times = measure_forward_times(model, prompt, list(range(1, 17)), repeats=5, graphs=True)
    ratios = verify_ratios(times)
    say(shard, "r(k): " + " ".join(f"{k}:{r:.2f}" for k, r in ratios.items()))
    result = {
        "shape": args.shape, "tp": shard.world, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "dtype": "bfloat16", "context": args.context, "weight_bytes_per_rank": weight_bytes,
        "copy_bandwidth_gbs": bandwidth / 1e9, "floor_tokens_per_s": floor, "plain_tokens_per_s": rate,
        "plain_ms_per_token": 1e3 / rate, "fraction_of_floor": rate / floor,
        "forward_ms": {k: t * 1e3 for k, t in times.items()}, "verify_ratio": ratios,
        "compute_only": args.compute_only, "tuned_entries": [entry_record(k, v) for k, v in tuned.items()],
    }
    if args.kernels:
        result["kernels"] = profiled = kernel_profile(model, prompt)
        say(shard, f"one graphed forward: {profiled['wall_us']:.0f} us wall, {profiled['kernel_us']:.0f} us in "
                   f"{profiled['kernels_per_forward']:.0f} kernels, {profiled['gap_us']:.0f} us between them")
        for row in profiled["by_kernel"][:20]:
            say(shard, f"  {row['us_per_forward']:8.1f} us  x{row['per_forward']:5.1f}  {row['kernel'][:90]}")
        say(shard, "the first kernels of a forward, in order (median us, gap before it):")
        for row in profiled["first_kernels_in_order"][:40]:
            say(shard, f"  {row['us']:7.1f} us  +{row['gap_before_us']:5.1f}  {row['kernel'][:90]}")
    if shard.parallel and not args.compute_only:
        result["all_gather_us"] = all_gather_us(shard, config.hidden_size)
        say(shard, f"one graphed all-gather of a [1, {config.hidden_size}] float32 partial: {result['all_gather_us']:.1f} us; "
                   f"{2 * config.num_layers + 1} per forward")
    if not args.skip_drafters:
        base = step_costs(plain, prompt)
        pair = pair_tau(args.pair)
        result["plain_step"] = {k: v for k, v in base.items() if k != "token_ids"}
        result["drafters"] = {}
        for name, engine in (("ngram", SpecEngine(model, "ngram")), ("eagle", SpecEngine(model, random_eagle(model, config)))):
            cost = step_costs(engine, prompt)
            step_ms = cost["draft_ms"] + cost["verify_ms"]
            entry = {k: v for k, v in cost.items() if k != "token_ids"}
            entry["lossless"] = cost["token_ids"] == base["token_ids"]
            entry["step_cost_in_plain_steps"] = step_ms / (base["draft_ms"] + base["verify_ms"])
            if name in pair:
                entry["estimate"] = {"label": "ESTIMATED speedup: tau of the default model's pair / this target's measured step cost",
                                     **pair[name], "estimated_speedup": pair[name]["tau"] / entry["step_cost_in_plain_steps"]}
            result["drafters"][name] = entry
            say(shard, f"{name}: draft {cost['draft_ms']:.2f} ms + verify {cost['verify_ms']:.2f} ms per step "
                       f"({entry['step_cost_in_plain_steps']:.2f} plain steps); lossless {entry['lossless']}"
                       + (f"; ESTIMATED {entry['estimate']['estimated_speedup']:.2f}x at tau {pair[name]['tau']:.2f}" if name in pair else ""))
        if shard.parallel:
            result["rank0_drafting_broadcast_us"] = broadcast_us()
            say(shard, f"drafting on rank 0 would add a {result['rank0_drafting_broadcast_us']:.1f} us broadcast per step")
    if shard.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"tp{shard.world}-{args.shape}.json").write_text(json.dumps(result, indent=1))
    say(shard, f"total {time.perf_counter() - t0:.0f} s")
    sys.stdout.flush()
    if shard.parallel:
        dist.barrier()
    os._exit(0)  # NCCL's teardown can hang on communicators that CUDA graphs captured; nothing is left to free


if __name__ == "__main__":
    sys.exit(main())

"""The GPU measurements of the speculative step (issue 11), in one call on an H100/H200:

1. `specdec bench` on the default model (bf16, batch 1, 256 tokens), gsm8k-eval and mixed: plain decoding
   and ngram / eagle / medusa / draft_model side by side, interleaved; speedups are medians of per-prompt
   ratios to plain decoding in the same run;
2. the same with sampling (temperature 0.7, top-p 0.95) for plain, eagle and ngram;
3. a profile of the step: device time per step (CUDA events at phase boundaries) against the host's own
   time and its waiting, and a plain step against one graphed target forward;
4. the 8B shape (random weights: cost only): an EAGLE head's tree level captured in a CUDA graph, its
   cost c per level in units of the 8B target's graphed forward, and the speedup ESTIMATED from c, the
   8B r(k) and the default pair's measured tau.

    python benchmarks/step_gpu.py --out DIR [--limit 10] [--max-new-tokens 256] [--skip-8b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.report import format_table, write_outputs  # noqa: E402
from specdec.bench.runner import BenchConfig, run_bench  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.costs import Stopwatch, measure_forward_times, synchronize, verify_ratios  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models import load_model  # noqa: E402
from specdec.models.eagle import EagleConfig, EagleHead  # noqa: E402
from specdec.models.kernels import kernel_path  # noqa: E402

DRAFTERS = ("ngram", "eagle", "medusa", "draft_model")


def bench(task: str, limit: int, max_new: int, sampling: SamplingParams, drafters, gammas, out: Path,
          device: str = "cuda", dtype: str = "bfloat16") -> dict:
    config = BenchConfig(task=task, limit=limit, drafters=drafters, gammas=gammas, peers=(), max_new_tokens=max_new,
                         device=device, dtype=dtype, sampling=sampling)
    results = run_bench(config, progress=False)
    write_outputs(results, out)
    print(format_table(results), flush=True)
    return {m["name"]: {k: m.get(k) for k in ("tokens_per_s", "speedup_vs_plain", "acceptance_rate",
                                               "mean_accepted_length", "cost_coefficient", "verify_ratio", "matches_plain")}
            for m in results["methods"]} | {"notes": results["notes"], "environment": results["environment"]}


def step_profile(model, prompts: list[list[int]], max_new: int) -> dict:
    """Per drafter: wall, device (phases), host and wait seconds per step, at batch 1, after a warm-up."""
    out = {}
    graphs = next(model.parameters()).is_cuda
    t1 = measure_forward_times(model, prompts[0], [1], repeats=20, graphs=graphs)[1]
    out["graphed_forward_ms"] = t1 * 1e3
    for drafter, gamma in (("none", 1), ("ngram", 4), ("eagle", 5)):
        engine = SpecEngine(model, drafter)
        config = SpecConfig(gamma=gamma, max_new_tokens=max_new, stop_at_eos=False)
        engine.generate(prompts[:1], config)  # capture
        rows = []
        for prompt in prompts[1:4]:
            synchronize(next(model.parameters()).device)
            t = time.perf_counter()
            res = engine.generate([prompt], config)
            wall = time.perf_counter() - t
            tm = res.times
            rows.append({"wall_ms": wall / tm.steps * 1e3, "device_ms": (tm.draft_s + tm.verify_s) / tm.steps * 1e3,
                         "draft_ms": tm.draft_s / tm.steps * 1e3, "verify_ms": tm.verify_s / tm.steps * 1e3,
                         "host_ms": tm.host_s / tm.steps * 1e3, "wait_ms": tm.wait_s / tm.steps * 1e3,
                         "tokens_per_s": res.stats.emitted / wall})
        out[drafter] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[drafter]["step_over_forward"] = out[drafter]["wall_ms"] / out["graphed_forward_ms"]
    return out


def eagle_level_cost_8b(tau: float, depth: int) -> dict:
    """An 8B-shaped EAGLE head's tree level (head features over a frontier of 4, draft logits, top-4), in a CUDA
    graph, against the 8B target's graphed forward: c per level, and the ESTIMATED speedup with tau."""
    from benchmarks.gpu import LLAMA3_8B
    from specdec.models.llama import random_llama

    device = torch.device("cuda")
    model = random_llama(LLAMA3_8B, device)
    prompt = torch.randint(0, LLAMA3_8B.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    times = measure_forward_times(model, prompt, [1, 2, 4, 8, 11, 16], repeats=10, graphs=True)
    head = EagleHead(EagleConfig.for_target(LLAMA3_8B, draft_vocab_size=32000)).to(device=device, dtype=torch.bfloat16)
    head.attach(model)
    F = 4
    cache = head.new_cache(1, 1024, static=True)
    cache.lengths.fill_(512)
    feats = torch.randn(1, F, LLAMA3_8B.hidden_size, device=device, dtype=torch.bfloat16)
    tokens = torch.randint(0, 32000, (1, F), device=device)
    positions = torch.full((1, F), 512, device=device)
    mask = torch.eye(F, dtype=torch.bool, device=device)[None]

    def level():
        new = head.features(feats, tokens, positions, cache, mask=mask)
        cache.lengths.fill_(512)
        return head.logits(new).log_softmax(-1).topk(4, dim=-1)

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                level()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            level()
        watch, samples = Stopwatch(device), []
        for _ in range(50):
            watch.mark("a")
            graph.replay()
            watch.mark("b")
            samples.append(watch.seconds("a", "b"))
    c = statistics.median(samples) / times[1]
    r = verify_ratios(times)
    estimated = tau / (1 + depth * c + (c + r[11] - 1))  # a 10-node tree: depth levels, a catch-up, r(11)
    del model, head
    torch.cuda.empty_cache()
    return {"forward_ms": {k: v * 1e3 for k, v in times.items()}, "verify_ratio": r, "level_ms": statistics.median(samples) * 1e3,
            "c_per_level": c, "tau_default_pair": tau, "depth": depth,
            "ESTIMATED_speedup": estimated, "label": "ESTIMATE: 8B-shaped random-weight costs with the default pair's tau"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = load_model("default", dtype=args.dtype, device=args.device)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"
    results = {"gpu": gpu, "dtype": args.dtype, "torch": torch.__version__, "kernels": kernel_path(model).to_dict()}
    prompts = [encode_prompt(model.tokenizer, t.prompt) for t in load_tasks("gsm8k-eval", 4)]
    results["step_profile"] = step_profile(model, prompts, args.max_new_tokens)
    print(json.dumps(results["step_profile"], indent=1), flush=True)
    greedy = SamplingParams()
    results["gsm8k"] = bench("gsm8k-eval", args.limit, args.max_new_tokens, greedy, DRAFTERS, (2, 4, 5), out / "gsm8k",
                             args.device, args.dtype)
    print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    if not args.skip_mixed:
        results["mixed"] = bench("mixed", args.limit, args.max_new_tokens, greedy, DRAFTERS, (2, 4, 5), out / "mixed",
                               args.device, args.dtype)
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    sampled = SamplingParams(temperature=0.7, top_p=0.95, seed=0)
    results["gsm8k_sampled"] = bench("gsm8k-eval", args.limit, args.max_new_tokens, sampled, ("ngram", "eagle"), (4, 5),
                                     out / "gsm8k-sampled", args.device, args.dtype)
    print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    if not args.skip_8b:
        tau = results["gsm8k"].get("specdec/eagle/5", {}).get("mean_accepted_length") or 3.4
        results["eagle_8b"] = eagle_level_cost_8b(tau, 5)
        print(json.dumps(results["eagle_8b"], indent=1), flush=True)
    (out / "step_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU measurements in one call (under 10 minutes on an H100/H200):

1. an 8B-shaped random-weight Llama (Llama-3-8B config), bf16, batch 1, 512-token context: plain
   decoding tokens/s through specdec (CUDA graphs) against the memory-bandwidth floor, and the verify
   ratio r(k) for k = 1..64;
2. the default model (real weights, bf16) on gsm8k-eval: specdec plain vs transformers eager
   `generate`, and the drafters on top, side by side (specdec bench);
3. bf16 honesty: how often and where speculative greedy output differs from plain greedy output in
   bf16, and that float32 stays exact;
4. an ESTIMATE of speedup for the 8B target: its measured r(k) and draft cost c with the acceptance
   measured on the default-model pair.

    python benchmarks/gpu.py --out OUT [--limit 10] [--drafters ngram,eagle,...] [--eagle-head DIR] [--skip-default]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.analysis.speedup import estimated_speedup  # noqa: E402
from specdec.costs import copy_bandwidth, measure_forward_times, verify_ratios, weight_bytes_per_forward  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models.eagle import EagleConfig, EagleHead  # noqa: E402
from specdec.models.llama import ModelConfig, random_llama  # noqa: E402

LLAMA3_8B = ModelConfig(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    max_position_embeddings=131072,
)


def decode_rate(model, prompt: list[int], short: int = 32, long: int = 160) -> float:
    """Decode-only tokens/s of plain decoding: (long - short) / (time(long) - time(short))."""
    engine = SpecEngine(model, "none")
    engine.generate([prompt], SpecConfig(max_new_tokens=8))  # capture graphs
    times = {}
    for n in (short, long):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate([prompt], SpecConfig(max_new_tokens=n, stop_at_eos=False))
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - t
    return (long - short) / (times[long] - times[short])


def draft_step_seconds(head: EagleHead, device: torch.device, repeats: int = 20) -> float:
    """One EAGLE draft step for the 8B shape (head layer on 1 token + top-k read-out), eager."""
    cache = head.new_cache(1, 1024)
    feats = torch.randn(1, 1, head.config.hidden_size, device=device, dtype=torch.bfloat16)
    tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    samples = []
    for _ in range(repeats + 3):
        cache.lengths.fill_(512)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = head.features(feats, tok, cache.lengths[:, None], cache)
            head.logits(out).topk(4)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return sorted(samples[3:])[repeats // 2]


def measure_8b(device: torch.device, out: Path) -> dict:
    model = random_llama(LLAMA3_8B, device)
    prompt = torch.randint(0, LLAMA3_8B.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    weight_bytes, bandwidth = weight_bytes_per_forward(model), copy_bandwidth(device)
    rate = decode_rate(model, prompt)
    ks = list(range(1, 65))
    times = measure_forward_times(model, prompt, ks, repeats=5, graphs=True)
    head = EagleHead(EagleConfig.for_target(LLAMA3_8B, draft_vocab_size=32000)).to(device=device, dtype=torch.bfloat16)
    head.embed_tokens = model.embed_tokens
    head.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach()[:32000].clone(), requires_grad=False)
    c = draft_step_seconds(head, device) / times[1]
    del model, head
    torch.cuda.empty_cache()
    return {
        "weight_bytes": weight_bytes, "copy_bandwidth_gbs": bandwidth / 1e9, "floor_ms": weight_bytes / bandwidth * 1e3,
        "floor_tokens_per_s": bandwidth / weight_bytes, "plain_tokens_per_s": rate,
        "fraction_of_floor": rate / (bandwidth / weight_bytes), "forward_ms": {k: t * 1e3 for k, t in times.items()},
        "verify_ratio": verify_ratios(times), "eagle_draft_c": c,
    }


def honesty(model_name: str, drafters: list[tuple[str, dict]], prompts: list[list[int]], dtype: str, device: str,
            max_new: int) -> dict:
    """Per drafter: outputs equal to plain greedy decoding, and where the first difference falls."""
    from specdec.drafters import DrafterOptions
    from specdec.models import load_model

    target = load_model(model_name, dtype=dtype, device=device)
    config = SpecConfig(gamma=4, max_new_tokens=max_new)
    plain = [SpecEngine(target, "none").generate([p], config).rows[0].token_ids for p in prompts]
    report = {}
    for name, extra in drafters:
        engine = SpecEngine(target, name, DrafterOptions(extra=extra))
        diffs = []
        for p, ref in zip(prompts, plain):
            ids = engine.generate([p], config).rows[0].token_ids
            diffs.append(next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), None if len(ids) == len(ref) else min(len(ids), len(ref))))
        report[name] = {"prompts": len(prompts), "equal": sum(d is None for d in diffs),
                        "first_differences": [d for d in diffs if d is not None]}
    return report


def plot_ratios(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    r = results["llama3_8b"]["verify_ratio"]
    ax.plot(list(r), list(r.values()), "o-", ms=3)
    ax.set(xlabel="tokens per forward (k)", ylabel="r(k) = t(k) / t(1)",
           title=f"Verify ratio, Llama-3-8B shape, bf16, {results['gpu']}")
    fig.tight_layout()
    fig.savefig(out / "verify_ratio_8b.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eagle-head", default=None, help="an EAGLE head folder (default: the one shipped for the default model)")
    ap.add_argument("--drafters", default="ngram,eagle,medusa,draft_model", help="drafters benched on the default model")
    ap.add_argument("--skip-default", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    t = time.perf_counter()
    results["llama3_8b"] = measure_8b(device, out)
    print(f"8B: {results['llama3_8b']['plain_tokens_per_s']:.1f} tok/s, floor {results['llama3_8b']['floor_tokens_per_s']:.1f}"
          f" ({results['llama3_8b']['fraction_of_floor']:.1%}); {time.perf_counter() - t:.0f} s", flush=True)
    plot_ratios(results, out)
    if not args.skip_default:
        from specdec.api import encode_prompt
        from specdec.bench.report import format_table, write_outputs
        from specdec.bench.runner import BenchConfig, run_bench
        from specdec.bench.tasks import load_tasks
        from specdec.models import load_model

        extra = {"eagle_path": args.eagle_head} if args.eagle_head else {}  # default: the shipped heads
        config = BenchConfig(task="gsm8k-eval", limit=args.limit, drafters=tuple(args.drafters.split(",")),
                             gammas=(2, 4, 6), peers=("hf",), max_new_tokens=args.max_new_tokens, device="cuda",
                             dtype="bfloat16", drafter_extra=extra)
        bench = run_bench(config, progress=False)
        write_outputs(bench, out / "bench-default-bf16")
        print(format_table(bench), flush=True)
        results["default_bench"] = {m["name"]: {k: m.get(k) for k in ("tokens_per_s", "speedup_vs_plain", "speedup_vs_hf",
                                                                      "acceptance_rate", "mean_accepted_length")}
                                    for m in bench["methods"]}
        tok = load_model("default", dtype="float32", device="cpu").tokenizer
        prompts = [encode_prompt(tok, t.prompt) for t in load_tasks("gsm8k-eval", args.limit)]
        pairs = [("ngram", {}), ("eagle", extra)]
        results["honesty_bf16"] = honesty("default", pairs, prompts, "bfloat16", "cuda", args.max_new_tokens)
        results["honesty_fp32"] = honesty("default", pairs, prompts, "float32", "cuda", args.max_new_tokens)
        best = max((m for m in bench["methods"] if m["family"] == "specdec" and m["drafter"] != "none"),
                   key=lambda m: m["tokens_per_s"]["median"])
        r8 = {int(k): v for k, v in results["llama3_8b"]["verify_ratio"].items()}
        alpha = best["acceptance_rate"]
        c = results["llama3_8b"]["eagle_draft_c"] if best["drafter"] == "eagle" else 0.0
        results["estimate_8b"] = {
            "label": "ESTIMATE (not measured): 8B r(k) and c with the default model's acceptance",
            "drafter": best["name"], "alpha": alpha, "c": c,
            "estimated_speedup_by_gamma": {g: estimated_speedup(alpha, g, c, r8[g + 1]) for g in range(1, 9)},
        }
    (out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps({k: v for k, v in results.items() if k != "llama3_8b"} | {"llama3_8b": {
        k: v for k, v in results["llama3_8b"].items() if k not in ("forward_ms", "verify_ratio")}}, indent=1, default=str))
    print(f"total {time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plain decoding on the CPU in float32 and in bfloat16, on the exact C kernels and (with --kernels
exact,library) on PyTorch's own (MKL), alternating prompt by prompt in one process (issue 12: bfloat16
>= 1.6x float32 on 2 cores; the exact path's cost against the library's), with the path each ran.

    python benchmarks/cpu_dtypes.py [--limit 6] [--max-new-tokens 128] [--rounds 2] [--kernels exact] [--out DIR]

Prints tokens/s per configuration (median over prompts and rounds) and medians of per-prompt ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models import load_model  # noqa: E402
from specdec.models.kernels import kernel_path  # noqa: E402

DTYPES = ("float32", "bfloat16")


def ratio(rates: dict[tuple[str, str], list[float]], a: tuple[str, str], b: tuple[str, str]) -> float:
    """Median over prompts of rates[a] / rates[b]."""
    return statistics.median(x / y for x, y in zip(rates[a], rates[b]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kernels", default="exact", help="comma-separated: exact, library")
    ap.add_argument("--out", default=None, help="write cpu_dtypes.json here")
    args = ap.parse_args()
    configs = [(d, k) for k in args.kernels.split(",") for d in DTYPES]
    engines = {(d, k): SpecEngine(load_model("default", dtype=d, device="cpu", kernels=k), "none") for d, k in configs}
    tokenizer = engines[configs[0]].target.tokenizer
    prompts = [encode_prompt(tokenizer, t.prompt) for t in load_tasks("gsm8k-eval", args.limit)]
    config = SpecConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    for engine in engines.values():
        engine.generate(prompts[:1], SpecConfig(max_new_tokens=8))  # warm up
    rates: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for c in configs if (r + i) % 2 == 0 else configs[::-1]:
                t = time.perf_counter()
                out = engines[c].generate([prompt], config)
                rates[c].append(out.stats.emitted / (time.perf_counter() - t))
    result = {"configs": [{"dtype": d, "kernels": k, "tokens_per_s_median": statistics.median(rates[d, k]),
                           "kernel_path": kernel_path(engines[d, k].target).to_dict()} for d, k in configs],
              "runs": {"prompts": len(prompts), "rounds": args.rounds, "max_new_tokens": args.max_new_tokens}}
    for c in result["configs"]:
        print(f"{c['dtype']:9s} {c['kernels']:8s} {c['tokens_per_s_median']:6.1f} tok/s  ({c['kernel_path']['name']}: "
              f"{c['kernel_path']['detail']})")
    ratios = {}
    for k in args.kernels.split(","):
        ratios[f"bfloat16/float32 ({k})"] = ratio(rates, ("bfloat16", k), ("float32", k))
    if "library" in args.kernels.split(",") and "exact" in args.kernels.split(","):
        for d in DTYPES:
            ratios[f"exact/library ({d})"] = ratio(rates, (d, "exact"), (d, "library"))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x (median of {len(prompts) * args.rounds} per-prompt ratios)")
    result["ratios"] = ratios
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_dtypes.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

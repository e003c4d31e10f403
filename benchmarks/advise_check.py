"""Does `specdec advise` pick well off GSM8K? Issue 14's target: on held-out prompt sets of other kinds, the
configuration advise picks is within 10 % of the best one a full `bench` sweep finds on the same prompts,
and where no drafter beats plain by more than the noise, advise says don't speculate.

Per category of a task set (default: heldout's qa, rag, translation, summarisation, chat):
  --phase split    write one .jsonl per category under --work
  --phase advise   `specdec advise` on it (its default budget), pages under --work/<category>/advise
  --phase bench    a full `specdec bench` sweep on the same prompts: every drafter x gammas 1,2,3,4,6
  --phase compare  the pick's measured speedup in the sweep against the sweep's best; prints a table and
                   writes advise_check.json
The advise and bench phases take one category each (--category), so categories can run side by side,
each pinned to its own cores (taskset) with --threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DRAFTERS = "ngram,lookahead,layer_skip,quantized,draft_model,medusa,eagle"
GAMMAS = "1,2,3,4,6"


def split(task: str, work: Path) -> list[str]:
    from specdec.bench.tasks import resolve_spec

    path, _ = resolve_spec(task)
    by_category: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            by_category.setdefault(json.loads(line).get("category") or "all", []).append(line)
    for category, lines in by_category.items():
        (work / category).mkdir(parents=True, exist_ok=True)
        (work / category / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return sorted(by_category)


def specdec(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "specdec.cli", *args], check=True)


def compare(work: Path, categories: list[str]) -> list[dict]:
    rows = []
    for category in categories:
        config = json.loads((work / category / "advise" / "config.json").read_text())
        advised = json.loads((work / category / "advise" / "measurements.json").read_text())
        results = json.loads((work / category / "bench" / "results.json").read_text())
        speed = {m["name"]: m["speedup_vs_plain"]["median"] for m in results["methods"] if m["family"] == "specdec"}
        best_name = max(speed, key=speed.get)
        pick = "specdec/none" if config["drafter"] == "none" else f"specdec/{config['drafter']}/{config['gamma']}"
        rows.append({
            "category": category, "advised": pick, "advise_prompts": advised["num_prompts"],
            "advise_seconds": advised["elapsed_s"], "advise_noise": advised["noise"],
            "bench_prompts": results["num_prompts"], "best": best_name, "best_speedup": speed[best_name],
            "pick_speedup": speed.get(pick), "pick_vs_best": speed[pick] / speed[best_name] if pick in speed else None,
        })
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", required=True, choices=("split", "advise", "bench", "compare"))
    p.add_argument("--task", default="heldout")
    p.add_argument("--category", default=None)
    p.add_argument("--work", default="runs/advise_check")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", default=DRAFTERS, help="bench phase: drafters swept")
    p.add_argument("--gammas", default=GAMMAS, help="bench phase: gammas swept")
    p.add_argument("--limit", default="100", help="bench phase: first N prompts of the category")
    args = p.parse_args()
    work = Path(args.work)
    common = ["--model", "default", "--device", args.device, "--threads", str(args.threads),
              "--max-new-tokens", str(args.max_new_tokens), "--peers", ""]
    if args.phase == "split":
        print(" ".join(split(args.task, work)))
    elif args.phase == "advise":
        folder = work / args.category
        specdec("advise", "--task", str(folder / "prompts.jsonl"), *common, "--out", str(folder / "advise"))
    elif args.phase == "bench":
        folder = work / args.category
        specdec("bench", "--task", str(folder / "prompts.jsonl"), "--limit", args.limit, *common, "--drafters", args.drafters,
                "--gammas", args.gammas, "--out", str(folder / "bench"))
    else:
        categories = sorted(d.name for d in work.iterdir() if (d / "bench" / "results.json").exists())
        rows = compare(work, categories)
        (work / "advise_check.json").write_text(json.dumps(rows, indent=1))
        print(f"{'category':<14} {'advised':<22} {'its speedup':>11} {'best in sweep':<22} {'best':>6} {'pick/best':>9} "
              f"{'prompts a/b':>11} {'advise s':>8}")
        for r in rows:
            ratio = "-" if r["pick_vs_best"] is None else f"{r['pick_vs_best']:.2f}"
            pick = "-" if r["pick_speedup"] is None else f"{r['pick_speedup']:.2f}x"
            print(f"{r['category']:<14} {r['advised']:<22} {pick:>11} {r['best']:<22} {r['best_speedup']:>5.2f}x "
                  f"{ratio:>9} {r['advise_prompts']:>5}/{r['bench_prompts']:<5} {r['advise_seconds']:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

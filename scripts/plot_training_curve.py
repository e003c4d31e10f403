"""Held-out top-1 agreement (the greedy acceptance of a first draft token) of trained EAGLE heads
against training data size and steps, from their metrics.json files.

    python scripts/plot_training_curve.py --out runs/training-curve runs/eagle-*

Writes curve.png and curve.json: one series per data source at a fixed step count (size sweep) and
one per data size (step sweep).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_runs(folders: list[Path]) -> list[dict]:
    runs = []
    for folder in folders:
        path = folder / "metrics.json"
        if path.exists():
            m = json.loads(path.read_text())
            if m["steps"] > 1:  # a steps-1 run only collected features
                runs.append({"run": folder.name, "data": m["data"], "tokens": m["tokens"], "steps": m["steps"],
                             "held_out_top1": m["held_out_top1"], "seconds": m.get("seconds")})
    return runs


def plot(runs: list[dict], out: Path) -> None:
    by_size, by_steps = defaultdict(list), defaultdict(list)
    for r in runs:
        by_size[(r["data"], r["steps"])].append(r)
        by_steps[(r["data"], r["tokens"])].append(r)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for (data, steps), rs in sorted(by_size.items()):
        if len(rs) >= 2:
            rs.sort(key=lambda r: r["tokens"])
            a.plot([r["tokens"] for r in rs], [r["held_out_top1"] for r in rs], "o-", label=f"{data}, {steps} steps")
    for (data, tokens), rs in sorted(by_steps.items()):
        if len(rs) >= 2:
            rs.sort(key=lambda r: r["steps"])
            b.plot([r["steps"] for r in rs], [r["held_out_top1"] for r in rs], "o-", label=f"{data}, {tokens} tokens")
    for r in (r for r in runs if len(by_size[(r["data"], r["steps"])]) < 2):  # single runs: marked points
        a.plot(r["tokens"], r["held_out_top1"], "*", ms=10, label=f"{r['data']}, {r['steps']} steps")
    a.set(xscale="log", xlabel="training tokens", ylabel="held-out top-1 agreement", title="data size")
    b.set(xlabel="optimiser steps", ylabel="held-out top-1 agreement", title="training steps")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/training-curve"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = sorted(read_runs(args.folders), key=lambda r: (r["data"], r["tokens"], r["steps"]))
    (args.out / "curve.json").write_text(json.dumps(runs, indent=1))
    plot(runs, args.out)
    for r in runs:
        print(f"{r['run']:<22} {r['data']:<5} {r['tokens']:>7} tokens {r['steps']:>5} steps  top-1 {r['held_out_top1']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

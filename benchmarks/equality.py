"""Greedy equality table (issue 12): how many speculative outputs equal plain greedy decoding of the same
target, token for token, per drafter x gamma x batch size, dtype and task set.

    python benchmarks/equality.py --out DIR [--dtypes bfloat16,float16] [--tasks gsm8k-eval,mixed] [--limit 20]
        [--max-new-tokens 256] [--drafters ngram,draft_model,eagle,medusa,lookahead,layer_skip]
        [--gammas 1,2,4,8] [--batches 1,4,32] [--kernels auto] [--budget-s 540]

Plain greedy decoding runs once per (dtype, task) at batch 1; each drafter x gamma x batch then decodes the
same prompts in batches of that size. Writes equality.json and prints a table; a run out of --budget-s
stops where it is and says what it did not reach.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.drafters import DrafterOptions  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models import load_model  # noqa: E402
from specdec.models.kernels import kernel_path  # noqa: E402


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def decode_all(engine: SpecEngine, prompts: list[list[int]], config: SpecConfig, batch: int) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        out += [r.token_ids for r in engine.generate(prompts[i : i + batch], config).rows]
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", type=csv(str), default=["bfloat16"])
    ap.add_argument("--tasks", type=csv(str), default=["gsm8k-eval", "mixed"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--drafters", type=csv(str), default=["ngram", "draft_model", "eagle", "medusa", "lookahead", "layer_skip"])
    ap.add_argument("--gammas", type=csv(int), default=[1, 2, 4, 8])
    ap.add_argument("--batches", type=csv(int), default=[1, 4, 32])
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=540)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
               "torch": torch.__version__, "limit": args.limit, "max_new_tokens": args.max_new_tokens, "cells": []}
    skipped = []
    for dtype in args.dtypes:
        target = load_model("default", dtype=dtype, device=args.device, kernels=args.kernels)
        results.setdefault("kernels", {})[dtype] = kernel_path(target).to_dict()
        for task in args.tasks:
            prompts = [encode_prompt(target.tokenizer, t.prompt) for t in load_tasks(task, args.limit)]
            config = SpecConfig(gamma=1, max_new_tokens=args.max_new_tokens)
            plain = decode_all(SpecEngine(target, "none"), prompts, config, 1)
            for drafter in args.drafters:
                engine = SpecEngine(target, drafter, DrafterOptions())
                for gamma in args.gammas:
                    for batch in args.batches:
                        if time.perf_counter() - t0 > args.budget_s:
                            skipped.append(f"{dtype} {task} {drafter} gamma {gamma} batch {batch}")
                            continue
                        t = time.perf_counter()
                        spec = decode_all(engine, prompts, SpecConfig(gamma=gamma, max_new_tokens=args.max_new_tokens), batch)
                        diffs = [first_difference(a, b) for a, b in zip(spec, plain)]
                        cell = {"dtype": dtype, "task": task, "drafter": drafter, "gamma": gamma,
                                "depth": engine.drafter.shape(gamma).depth, "batch": batch, "prompts": len(prompts),
                                "equal": sum(d is None for d in diffs),
                                "first_differences": [d for d in diffs if d is not None], "seconds": time.perf_counter() - t}
                        results["cells"].append(cell)
                        print(f"{dtype:9} {task:11} {drafter:12} g{gamma} depth {cell['depth']} b{batch:<3} "
                              f"{cell['equal']}/{cell['prompts']} equal  {cell['seconds']:.1f} s", flush=True)
                        (out / "equality.json").write_text(json.dumps(results | {"not_run": skipped}, indent=1))
            del plain
        del target
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    results["not_run"] = skipped
    (out / "equality.json").write_text(json.dumps(results, indent=1))
    cells = results["cells"]
    print(f"\n{sum(c['equal'] for c in cells)}/{sum(c['prompts'] for c in cells)} outputs equal to plain greedy "
          f"over {len(cells)} cells; {len(skipped)} cells not run (budget); {time.perf_counter() - t0:.0f} s")
    for c in cells:
        if c["equal"] < c["prompts"]:
            print(f"  UNEQUAL {c['dtype']} {c['task']} {c['drafter']} g{c['gamma']} b{c['batch']}: {c['first_differences']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

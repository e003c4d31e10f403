"""What a step that drafts nothing costs under a drafter and a policy, against a plain engine's: engines
alternated in one process, rounds after a warm-up, the median tokens/s of each.

    python benchmarks/plain_step_cost.py [--device cuda] [--task heldout] [--categories qa,translation]
        [--drafters eagle] [--limit 64] [--max-new-tokens 128] [--rounds 3]

Rows: `none` under the fixed policy and under `cost` (the policy's host work over plain steps), then each
drafter with every step forced to gamma 0 under the fixed policy and under `cost` (the policy chooses, then
the step runs plain: what the drafter's state costs at gamma 0), then each drafter under `cost` as it
chooses. On an H200 (bf16, default model) EAGLE's gamma-0 steps ran at 0.954x plain while its head was fed
at every commit, 0.991x once fed lazily (docs/design.md, "Lazy drafter state").
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec.adaptive as adaptive  # noqa: E402
from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.drafters import DrafterOptions  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models.loading import load_model  # noqa: E402

CHOOSE = adaptive.GammaPolicy.choose


def choose_then_stay_plain(policy: adaptive.GammaPolicy, b: int) -> int:
    """The policy's own choice is made (its host work), then a plain step runs."""
    CHOOSE(policy, b)
    return 0


def tokens_per_s(engine: SpecEngine, prompts: list[list[int]], config: SpecConfig, plain_only: bool) -> float:
    adaptive.GammaPolicy.choose = choose_then_stay_plain if plain_only else CHOOSE
    try:
        tokens, start = 0, time.perf_counter()
        for prompt in prompts:
            tokens += len(engine.generate([prompt], config).rows[0].token_ids)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return tokens / (time.perf_counter() - start)
    finally:
        adaptive.GammaPolicy.choose = CHOOSE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--task", default="heldout")
    ap.add_argument("--categories", default="qa,translation", help="comma-separated; empty: every prompt")
    ap.add_argument("--drafters", default="eagle")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    target = load_model("default", device=args.device)
    kinds = set(filter(None, args.categories.split(",")))
    tasks = [t for t in load_tasks(args.task, args.limit) if not kinds or t.category in kinds]
    if not tasks:
        sys.exit(f"no prompt of {args.task} is in the categories {args.categories}")
    prompts = [encode_prompt(target.tokenizer, t.prompt) for t in tasks]
    fixed = SpecConfig(gamma=4, max_new_tokens=args.max_new_tokens)
    cost = SpecConfig(gamma=4, gamma_policy="cost", max_new_tokens=args.max_new_tokens)
    rows = {"none, fixed": ("none", fixed, False), "none, cost": ("none", cost, False)}
    for name in args.drafters.split(","):
        rows |= {f"{name}, gamma 0, fixed": (name, fixed, True), f"{name}, gamma 0, cost": (name, cost, True),
                 f"{name}, cost": (name, cost, False)}
    engines = {name: SpecEngine(target, name, DrafterOptions()) for name in {d for d, _, _ in rows.values()}}
    seen: dict[str, list[float]] = {row: [] for row in rows}
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.rounds} rounds after a warm-up, {args.device}")
    for round_ in range(args.rounds + 1):  # round 0 warms up: captures and compiles
        for row, (drafter, config, plain_only) in rows.items():
            speed = tokens_per_s(engines[drafter], prompts, config, plain_only)
            if round_:
                seen[row].append(speed)
    base = statistics.median(seen["none, fixed"])
    for row, speeds in seen.items():
        median = statistics.median(speeds)
        print(f"{row:28s} {median:8.1f} tok/s  {median / base:.3f}x  {[round(s) for s in speeds]}")


if __name__ == "__main__":
    main()

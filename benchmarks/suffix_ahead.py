"""How many tokens a `suffix` step gives when steps are pipelined as on a GPU, on a repeated-request
workload, pass by pass: drafting ahead with the n-gram lookup (the default), ahead without it, and reading
the step in flight first. Pipelining is forced, so this runs on a CPU too: the drafts and so the tokens per
step do not depend on the hardware (times do, and are not reported).

    python benchmarks/suffix_ahead.py [--task benchmarks/repeat50.jsonl] [--prompts 10] [--gamma 16] [--tokens 128]

Default model, greedy, the prompts asked twice through one engine (the second pass drafts from the first).
Prints one JSON line per configuration and pass: decode steps, tokens per step, draft tokens per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specdec.step as step_module  # noqa: E402
from specdec import SpecConfig  # noqa: E402
from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.drafters import DrafterOptions  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models import load_model  # noqa: E402

CONFIGS = (("ahead, lookup 8", {"ahead": 1}), ("ahead, no lookup", {"ahead": 1, "lookup": 0}), ("read first", {"ahead": 0}))


def pipelined(stepper, gamma: int) -> bool:
    """Stepper.pipelines as with CUDA graphs, on any device."""
    return step_module.overlaps(stepper.drafter, gamma)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="benchmarks/repeat50.jsonl")
    parser.add_argument("--prompts", type=int, default=10, help="the first N prompts, each asked twice")
    parser.add_argument("--gamma", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    step_module.Stepper.pipelines = pipelined
    target = load_model("default", device="cpu")
    prompts = [encode_prompt(target.tokenizer, t.prompt) for t in load_tasks(args.task)[: args.prompts]]
    config = SpecConfig(gamma=args.gamma, gamma_policy="fixed", max_new_tokens=args.tokens)
    for label, extra in CONFIGS:
        engine = SpecEngine(target, "suffix", DrafterOptions(extra=extra))
        for repeat in (1, 2):
            steps = emitted = drafted = 0
            for prompt in prompts:
                stats = engine.generate([prompt], config).rows[0].stats
                steps, emitted, drafted = steps + stats.decode_steps, emitted + stats.decode_emitted, drafted + stats.drafted
            print(json.dumps({"config": label, "gamma": args.gamma, "pass": repeat, "steps": steps,
                              "tokens_per_step": round(emitted / steps, 2), "drafted_per_step": round(drafted / steps, 2)}),
                  flush=True)


if __name__ == "__main__":
    main()

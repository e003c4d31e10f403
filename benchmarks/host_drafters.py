"""What a host drafter's steps cost the engine (suffix, lookahead: drafters whose state is Python on the
host), against plain decoding of the same target in one process.

    python benchmarks/host_drafters.py [--device cuda] [--prompts 6] [--tokens 128] [--repeats 3] [--out FILE]

Random weights of SmolLM2-135M's shape (bf16 on CUDA, float32 on the CPU) and random prompts of 100 tokens:
costs only, never acceptance (a random net repeats itself, so `suffix` finds long matches). Per method:
tokens/s of one-prompt `generate` calls (median over prompts x repeats, synchronised) and the tokens drafted.
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

from eager_forward import SMOLLM2_135M  # noqa: E402
from specdec import SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models.llama import random_llama  # noqa: E402

METHODS = (("none", "fixed", 1), ("suffix", "cost", 4), ("suffix", "fixed", 4), ("lookahead", "cost", 4))


def measure(target, prompts: list[list[int]], name: str, policy: str, gamma: int, tokens: int, repeats: int) -> dict:
    engine = SpecEngine(target, name)
    config = SpecConfig(gamma=gamma, gamma_policy=policy, max_new_tokens=tokens, stop_at_eos=False)
    sync = torch.cuda.synchronize if target.lm_head.weight.is_cuda else (lambda: None)
    engine.generate([prompts[0]], config)  # warm-up: kernels compiled, step shapes captured
    rates, drafted = [], 0
    for _ in range(repeats):
        for prompt in prompts:
            sync()
            t = time.perf_counter()
            out = engine.generate([prompt], config)
            sync()
            rates.append(len(out.rows[0].token_ids) / (time.perf_counter() - t))
            drafted += out.stats.drafted
    return dict(drafter=name, policy=policy, gamma=gamma, tok_s=round(statistics.median(rates), 1), drafted=drafted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = random_llama(SMOLLM2_135M, args.device, dtype, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SMOLLM2_135M.vocab_size, (100,), generator=g).tolist() for _ in range(args.prompts)]
    rows = []
    for method in METHODS + METHODS[:1]:  # plain again last: the drift over the run
        rows.append(measure(target, prompts, *method, args.tokens, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "dtype": str(dtype), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

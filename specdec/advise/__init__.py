"""`specdec advise`: measure the speculative-decoding family on the user's prompts and hardware within a
time budget, then answer with a comparison matrix, a decision tree, a verdict and the flags to use.

measure.py runs the measurements, decide.py holds the decision tree (the verdict is its walk),
render.py writes the pages, survey.py holds the family's descriptions and published figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.advise.measure import AdviseConfig, measure
from specdec.advise.render import format_terminal, headline, write_outputs


def run_advise(args: argparse.Namespace) -> int:
    from specdec.config import SamplingParams

    config = AdviseConfig(
        task=args.task, limit=args.limit, model=args.model, device=args.device, dtype=args.dtype, kernels=args.kernels, gguf=args.gguf,
        drafters=args.drafters, peers=tuple(args.peers), concurrency=tuple(args.concurrency), budget_s=args.budget_s,
        max_new_tokens=args.max_new_tokens, threshold_ms=args.threshold_ms, chat=not args.raw,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed),
    )
    m = measure(config, progress=not args.json)
    tree, files = write_outputs(m, Path(args.out))
    if args.json:
        print(json.dumps({"measurements": m.to_dict(), "config": json.loads((Path(args.out) / "config.json").read_text())}))
        return 0
    print(format_terminal(m, tree))
    print(f"\n{headline(m, tree)}")
    print(f"wrote {', '.join(f.name for f in files)} to {args.out}", file=sys.stderr)
    return 0


__all__ = ["AdviseConfig", "measure", "run_advise", "write_outputs"]

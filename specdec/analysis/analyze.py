"""`specdec analyze`: run a task set through the engine with a RejectionRecorder and write the analysis.

Python: `analyze_rejections(target, prompts, drafter, options, config, ...)` -> (Analysis, records).
CLI: cli.py parses `specdec analyze` and dispatches to `run_analyze(args)`.
Prompts run one at a time (chat template applied with specdec.api.encode_prompt), so rows never wait
for each other. Outputs under --out: analysis.json (schema in rejections.ANALYSIS_SCHEMA),
records.jsonl (one DraftTokenRecord a line), analysis.md and the PNG plots it embeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from specdec.analysis.rejections import Analysis, DraftTokenRecord, RejectionRecorder, build_analysis
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import DrafterOptions
from specdec.engine import SpecEngine
from specdec.errors import UserError
from specdec.metrics import SpecStats


def run_analyze(args: argparse.Namespace) -> int:
    from specdec.analysis.rejection_report import format_summary, require_matplotlib, write_outputs
    from specdec.api import encode_prompt
    from specdec.cli import check_drafter_args, drafter_extra, spec_config
    from specdec.bench.tasks import load_tasks
    from specdec.models import load_model

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)
    config = spec_config(args, sampling)
    if args.drafter == "none":
        raise UserError("--drafter none drafts nothing, so nothing is rejected: pick another drafter")
    check_drafter_args(args)
    extra = drafter_extra(args)
    tasks = load_tasks(args.task, args.limit)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    require_matplotlib()
    target = load_model(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf)
    if target.tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer files: analyze needs one to encode prompts and name tokens")
    options = DrafterOptions(draft_model=args.draft_model, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                             extra=extra)
    prompts = [encode_prompt(target.tokenizer, t.prompt, chat=not args.raw) for t in tasks]
    run = {
        "model": args.model, "drafter": args.drafter, "draft_model": args.draft_model, "gamma": args.gamma,
        "task": args.task, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
        "min_p": sampling.min_p, "seed": sampling.seed, "greedy": sampling.greedy,
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
    }
    analysis, records = analyze_rejections(
        target, prompts, args.drafter, options, config, lambda ids: target.tokenizer.decode(ids), run
    )
    write_outputs(analysis, records, out)
    print(json.dumps(analysis.to_dict()) if args.json else format_summary(analysis, out))
    return 0


def analyze_rejections(
    target, prompts: list[list[int]], drafter: str, options: DrafterOptions, config: SpecConfig, decode, run: dict,
    progress: bool = True,
) -> tuple[Analysis, list[DraftTokenRecord]]:
    """Decode each token-id prompt with the drafter, recording every verification step; aggregate.
    `decode(ids) -> str` names tokens (the tokenizer's decode); `run` is stored as the analysis' run info."""
    engine = SpecEngine(target, drafter, options)
    recorder = RejectionRecorder(config.sampling, decode)
    total = SpecStats()
    bar = tqdm(prompts, desc="analyze", unit="prompt", disable=None if progress else True)
    for ids in bar:
        stats = engine.generate([ids], config, observer=recorder).stats
        total.merge(stats)
        total.wall_s, total.draft_s, total.target_s = (
            total.wall_s + stats.wall_s, total.draft_s + stats.draft_s, total.target_s + stats.target_s,
        )  # prompts run one after another: their times add
        bar.set_postfix(acceptance=f"{total.acceptance_rate or 0:.2f}")
    analysis = build_analysis(recorder.records, recorder.not_reached, config.gamma, run, total.to_dict())
    return analysis, recorder.records

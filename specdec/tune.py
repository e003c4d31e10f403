"""`specdec tune layer-skip`: choose which target layers the self-speculative draft keeps.

On a few calibration prompts (gsm8k-train by default: never the eval set) the target writes short
greedy continuations; then, teacher-forced on that text, each candidate layer set's top-1 agreement
with the target estimates its acceptance alpha, and its cost c = t(draft step) / t(target step)
follows from measured times (t0: embeddings + final norm + LM head alone; each layer adds
(t(1) - t0) / L). The estimated speedup max over gamma of the chain formula ranks the candidates:
structured sets first (the first n layers, the first a and last b, every k-th), then one round of
adding or removing single layers around the best. The best set is written as JSON for
`--drafter layer_skip --layers ...` (or `--layer-skip-config`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.analysis.speedup import estimated_speedup
from specdec.costs import measure_forward_times, verify_ratios
from specdec.api import encode_prompt
from specdec.bench.tasks import load_tasks
from specdec.config import SpecConfig
from specdec.engine import SpecEngine
from specdec.models.views import layer_subset


@dataclass
class Candidate:
    layers: list[int]
    alpha: float  # top-1 agreement with the target on the calibration text
    c: float  # draft step cost / target step cost
    gamma: int  # the gamma with the best estimated speedup
    estimated_speedup: float


@dataclass
class Calibration:
    ids: torch.Tensor  # [B, T] calibration sequences (prompt + target continuation), right-padded
    scored: torch.Tensor  # [B, T] positions whose next token is the target's continuation
    target_next: torch.Tensor  # [B, T] the target's argmax after each position
    t0: float  # seconds: a 1-token forward through no layer
    t_layer: float  # seconds per decoder layer
    ratios: dict[int, float]  # verify ratio r(k)


@torch.inference_mode()
def calibrate(target, prompts: list[list[int]], new_tokens: int, max_gamma: int) -> Calibration:
    rows = SpecEngine(target, "none").generate(prompts, SpecConfig(max_new_tokens=new_tokens)).rows
    seqs = [p + r.token_ids for p, r in zip(prompts, rows)]
    T = max(len(s) for s in seqs)
    dev = next(target.parameters()).device
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs], device=dev)
    scored = torch.zeros_like(ids, dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        scored[b, len(p) - 1 : len(s) - 1] = True
    times = measure_forward_times(target, seqs[0], list(range(1, max_gamma + 2)))
    t0 = measure_forward_times(layer_subset_none(target), seqs[0], [1])[1]
    return Calibration(ids, scored, next_tokens(target, ids), t0, (times[1] - t0) / target.config.num_layers,
                       verify_ratios(times))


def layer_subset_none(target):
    """The target with no decoder layer: embeddings, final norm and LM head (the cost floor of a draft)."""
    model = layer_subset(target, [0])
    model.layers = torch.nn.ModuleList()
    return model


def next_tokens(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] argmax after each position, teacher-forced."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(ids, positions, cache).logits.argmax(-1)


def evaluate(target, layers: list[int], cal: Calibration) -> Candidate:
    draft = layer_subset(target, layers)
    agree = (next_tokens(draft, cal.ids) == cal.target_next) & cal.scored
    alpha = float(agree.sum() / cal.scored.sum())
    c = (cal.t0 + len(layers) * cal.t_layer) / (cal.t0 + target.config.num_layers * cal.t_layer)
    gamma = max(range(1, max(cal.ratios)), key=lambda g: estimated_speedup(min(alpha, 0.999), g, c, cal.ratios[g + 1]))
    return Candidate(layers, alpha, c, gamma, estimated_speedup(min(alpha, 0.999), gamma, c, cal.ratios[gamma + 1]))


def structured_candidates(L: int) -> list[list[int]]:
    sets = [list(range(n)) for n in range(1, L)]
    sets += [list(range(a)) + list(range(L - b, L)) for a in range(1, L // 2) for b in range(1, 4) if a + b < L]
    sets += [list(range(0, L, k)) for k in (2, 3, 4)]
    unique = {tuple(s) for s in sets}
    return [list(s) for s in sorted(unique, key=lambda s: (len(s), s))]


def neighbours(layers: list[int], L: int) -> list[list[int]]:
    drop = [[i for i in layers if i != j] for j in layers if len(layers) > 1]
    add = [sorted(layers + [j]) for j in range(L) if j not in layers]
    return drop + add


def tune_layer_skip(target, task: str = "gsm8k-train", limit: int = 4, new_tokens: int = 96, max_gamma: int = 8,
                    progress: bool = True) -> tuple[Candidate, list[Candidate]]:
    """The best layer set and every candidate evaluated (best first)."""
    prompts = [encode_prompt(target.tokenizer, t.prompt) for t in load_tasks(task, limit)]
    cal = calibrate(target, prompts, new_tokens, max_gamma)
    L = target.config.num_layers
    seen: dict[tuple[int, ...], Candidate] = {}

    def run(sets: list[list[int]], desc: str) -> None:
        for layers in tqdm(sets, desc=desc, disable=not progress, leave=False):
            if tuple(layers) not in seen:
                seen[tuple(layers)] = evaluate(target, layers, cal)

    run(structured_candidates(L), "structured sets")
    best = max(seen.values(), key=lambda c: c.estimated_speedup)
    run(neighbours(best.layers, L), "refine")
    ranked = sorted(seen.values(), key=lambda c: -c.estimated_speedup)
    return ranked[0], ranked


def write_layer_skip_config(best: Candidate, ranked: list[Candidate], path: Path, model: str, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "layers": best.layers, "best": asdict(best), "seconds": seconds,
                                "candidates": [asdict(c) for c in ranked]}, indent=1))


def format_candidates(ranked: list[Candidate], top: int = 10) -> str:
    lines = [f"{'layers kept':<40} {'alpha':>6} {'c':>6} {'gamma':>5} {'est. speedup':>12}"]
    for c in ranked[:top]:
        shown = ",".join(map(str, c.layers))
        lines.append(f"{shown[:40]:<40} {c.alpha:6.3f} {c.c:6.3f} {c.gamma:5d} {c.estimated_speedup:11.2f}x")
    return "\n".join(lines)


def run_tune(args) -> int:
    from specdec.errors import UserError
    from specdec.models import load_model

    if args.limit < 1 or args.max_new_tokens < 1 or args.max_gamma < 1:
        raise UserError("--limit, --max-new-tokens and --max-gamma must be >= 1")
    target = load_model(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf)
    if target.tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer: tuning needs one to encode its prompts")
    t = time.perf_counter()
    best, ranked = tune_layer_skip(target, args.task, args.limit, args.max_new_tokens, args.max_gamma)
    seconds = time.perf_counter() - t
    write_layer_skip_config(best, ranked, Path(args.out), args.model, seconds)
    print(format_candidates(ranked))
    print(f"\nbest: layers {best.layers} (alpha {best.alpha:.3f}, c {best.c:.3f}, estimated {best.estimated_speedup:.2f}x "
          f"at gamma {best.gamma}); {len(ranked)} candidates in {seconds:.0f} s; wrote {args.out}")
    return 0

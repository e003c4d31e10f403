"""`specdec train eagle3`: train an EAGLE-3 head (Li et al. 2025) with training-time test.

Data. The examples of `specdec train eagle` (train/common.py, train/data.py: --data text|self,
--prompts, or --features from an earlier run, whose final hidden states are not used). The target's
low/mid/high-layer states would be 3x the final ones on disk (several GB for gsm8k-train), so each
batch runs one target forward (no gradient) that returns them (aux [B, T, 3D], llama.py `aux_layers`)
and the final hidden states, whose LM-head rows d2t give the target's draft-vocabulary distribution.

Training-time test (TTT), K steps (`--ttt-steps`, 7 as the reference). Step 0 reads, at each position
t, (g_t = fc(aux_t), x_{t+1}) at RoPE position t, causally, and gives h^0_t; step k > 0 reads
(h^{k-1}_t, x_{t+k+1}) at position t + k and gives h^k_t: the head consumes its own output, one token
further each step, along the teacher-forced tokens. Step k at index t attends to step 0's entries
0..t and to steps 1..k's entries at t (`ttt_mask`): what a chain drafted from position t sees (the
committed pairs, then its own ancestors; tests/test_eagle3.py checks the outputs against the drafter's
cache path). h^k_t predicts x_{t+k+2}; its loss is the cross-entropy against the target's
distribution at position t+k+1 over the draft vocabulary, on response positions whose next token
exists, weighted 0.8^k (the reference's). No feature regression.

Start. fc, the layer and the norms fresh (seeded); lm_head = the target's LM-head rows d2t and norm =
the target's final norm (`Eagle3Head.start_from`). Everything but the borrowed embeddings trains
(AdamW, linear warm-up, cosine decay).

Held-out metrics (`evaluate_chain`, which also measures an EAGLE-1/2 head on the same examples:
`--compare-eagle DIR`): per step k, top-1 agreement (the head's argmax through d2t equals the target's
argmax over its whole vocabulary at t+k+1); and chain drafting along the teacher-forced tokens from
every anchor whose K positions count: the accepted length a_t = the leading steps that agree,
acceptance by depth P(a > k | a >= k) and tau by depth d, 1 + E[min(a, d)]. The head runs through its
drafting code (a KV cache and a tree mask), not the training unroll.

Written to --out: the head (save_eagle3_head, float16, facts in config.json), metrics.json,
checkpoint.pt (`--resume`; the same seed gives the same weights either way).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from specdec.batch import eos_ids
from specdec.errors import UserError
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3_head
from specdec.models.linear import float_weight
from specdec.models.rope import rope_cos_sin
from specdec.train.common import (
    CHECKPOINT,
    Checkpoint,
    PaddedBatch,
    batch_schedule,
    command_line,
    frequent_vocab,
    learning_rate,
    pad_batch,
    plan_batches,
    resume_from,
    save_checkpoint,
    split_held_out,
    training_data,
    training_features,
)
from specdec.train.data import Features

DEFAULT_LR = 5e-4
STEP_WEIGHT = 0.8  # loss weight ratio between consecutive TTT steps (the reference's)


@dataclass(frozen=True)
class Eagle3TrainConfig:
    steps: int = 2000
    batch_tokens: int = 2048
    lr: float = DEFAULT_LR
    seed: int = 0
    draft_vocab: int = 8192
    intermediate_size: int | None = None  # None: the target's
    ttt_steps: int = 7  # K
    feature_layers: tuple[int, ...] | None = None  # None: [2, L // 2, L - 3]
    held_out: float = 0.05
    warmup: int = 100  # at most a tenth of the run
    clip: float = 0.5
    evaluations: int = 4
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_tokens < 2 or self.lr <= 0 or self.ttt_steps < 1:
            raise UserError(f"need --steps >= 1, --batch-tokens >= 2, --lr > 0, --ttt-steps >= 1 (got {self.steps}, "
                            f"{self.batch_tokens}, {self.lr}, {self.ttt_steps})")

    def resume_key(self, features: Features) -> dict:
        keep = {k: v for k, v in asdict(self).items() if k not in ("steps", "evaluations", "checkpoint_every")}
        keep["feature_layers"] = list(self.feature_layers) if self.feature_layers else None
        return {**keep, "examples": len(features.tokens), "data_tokens": features.num_tokens, "source": features.source,
                "data_key": features.key}


@dataclass
class TargetBatch:
    """One batch's target side: the tapped layers and the draft-vocabulary distribution at every position."""

    aux: Tensor  # [B, T, 3D] float32 (the head's features; EAGLE-1/2's final hidden states for a head that reads those)
    p: Tensor  # [B, T, Vd] softmax of the target's logits over d2t
    argmax: Tensor  # [B, T] the target's argmax over its whole vocabulary


@dataclass
class ChainMetrics:
    top1: list[float]  # per TTT step k: head argmax (via d2t) == target argmax at t+k+1
    acceptance: list[float]  # per depth k: P(a > k | a >= k) along the teacher-forced tokens
    tau: list[float]  # per chain depth d = 1..K: 1 + E[min(a, d)]
    positions: int  # (b, t) positions of step 0 counted
    anchors: int  # anchors whose K positions all count


@dataclass
class TrainResult:
    head: Eagle3Head
    step: int
    train_loss: float
    held_out: ChainMetrics
    history: list[dict] = field(default_factory=list)


def ttt_mask(T: int, k: int, device: torch.device | str = "cpu") -> Tensor:
    """[T, T*(k+1)] bool: what step k's entry at index t sees among the entries of steps 0..k (step m's
    entries at slots m*T .. m*T + T-1): step 0's at indices <= t, and each later step's at index t."""
    j = torch.arange(T * (k + 1), device=device)  # [S]
    t = torch.arange(T, device=device)[:, None]  # [T, 1]
    step, index = j // T, j % T  # [S]
    return torch.where(step == 0, index <= t, index == t)


def shifted(tokens: Tensor, by: int) -> Tensor:
    """[B, T]: tokens[:, t + by], 0 past the end."""
    out = torch.zeros_like(tokens)
    out[:, : max(tokens.shape[1] - by, 0)] = tokens[:, by:]
    return out


def unroll(head: Eagle3Head, g: Tensor, tokens: Tensor, K: int) -> list[Tensor]:
    """Training-time test: the head's outputs h^0..h^{K-1} [B, T, D] from g [B, T, D] (fc of the tapped
    layers) along tokens [B, T] (see the module docstring), differentiable."""
    B, T, _ = g.shape
    layer, positions = head.layers[0], torch.arange(T, device=g.device).expand(B, T)
    h, past, outs = g, None, []
    for k in range(K):
        cos, sin = rope_cos_sin(positions + k, head.inv_freq, 1.0, g.dtype)
        mask = ttt_mask(T, k, g.device)[None, None]  # [1, 1, T, T(k+1)]
        h, past = layer.unrolled(head.inputs(h, shifted(tokens, k + 1)), cos, sin, past, mask)
        outs.append(h)
    return outs


@torch.no_grad()
def unroll_drafting(head, g: Tensor, tokens: Tensor, K: int) -> list[Tensor]:
    """What `unroll` computes, through the head's drafting path (`features` over a KV cache, a tree mask per
    step), for an EAGLE-3 head or an EAGLE-1/2 one (g: its input features, project()ed)."""
    B, T, _ = g.shape
    cache = head.new_cache(B, T * K)
    positions = torch.arange(T, device=g.device).expand(B, T)
    h, outs = g, []
    for k in range(K):
        mask = None if k == 0 else ttt_mask(T, k, g.device).expand(B, -1, -1)  # [B, T, T(k+1)]
        h = head.features(h, shifted(tokens, k + 1), positions + k, cache, mask=mask)
        outs.append(h)
    return outs


def valid_positions(batch: PaddedBatch, K: int) -> Tensor:
    """[B, T, K] bool: step k at index t counts when u = t+k+1 is a response position whose next token exists."""
    t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)[None, :, None]  # [1, T, 1]
    u = t + 1 + torch.arange(K, device=t.device)  # [1, T, K]
    return (u >= batch.response_start[:, None, None]) & (u <= batch.lengths[:, None, None] - 2)


@torch.no_grad()
def target_side(target, batch: PaddedBatch, rows: Tensor, feature_layers: tuple[int, ...] | None) -> TargetBatch:
    """One target forward over the batch: its tapped layers (or final hidden states, feature_layers None) and,
    from the final hidden states, the distribution over the LM-head rows `rows` [Vd, D] and the argmax."""
    B, T = batch.tokens.shape
    positions = torch.arange(T, device=batch.tokens.device).expand(B, T)
    out = target(batch.tokens, positions, target.new_cache(B, T), aux_layers=feature_layers)
    hidden = out.hidden.float()  # [B, T, D]
    full = float_weight(target.lm_head).detach()  # [V, D]
    argmax = torch.cat([(h.to(full.dtype) @ full.T).argmax(-1) for h in hidden.flatten(0, 1).split(512)]).view(B, T)
    features = (out.aux if feature_layers is not None else out.hidden).float().clone()  # a tensor autograd may save
    return TargetBatch(features, (hidden @ rows.T).softmax(-1), argmax)


def ttt_loss(head: Eagle3Head, outs: list[Tensor], side: TargetBatch, valid: Tensor) -> Tensor:
    """sum_k 0.8^k CE(target p at t+k+1, head at h^k_t), each step's mean over its valid positions."""
    total = outs[0].new_zeros(())
    for k, h in enumerate(outs):
        mask = valid[..., k]  # [B, T]
        if not mask.any():
            continue
        p = shifted_rows(side.p, k + 1)[mask]  # [N, Vd]
        log_q = head.logits(h[mask]).log_softmax(-1)  # [N, Vd]
        total = total + STEP_WEIGHT ** k * -(p * log_q).sum(-1).mean()
    return total


def shifted_rows(x: Tensor, by: int) -> Tensor:
    """[B, T, ...]: x[:, t + by], zeros past the end."""
    out = torch.zeros_like(x)
    out[:, : max(x.shape[1] - by, 0)] = x[:, by:]
    return out


def draft_rows(target, d2t: Tensor) -> Tensor:
    """[Vd, D] float32: the target's LM-head rows of the draft vocabulary."""
    return float_weight(target.lm_head).detach()[d2t].float()


@torch.no_grad()
def evaluate_chain(head, target, features: Features, examples: list[int], batch_tokens: int, K: int) -> ChainMetrics:
    """Held-out top-1 per step and chain acceptance and tau by depth (module docstring) of an EAGLE-3 or an
    EAGLE-1/2 head (attached, no grad)."""
    device = head.d2t.device
    rows = draft_rows(target, head.d2t)
    agree, counted = torch.zeros(K), torch.zeros(K)
    accepted: list[Tensor] = []
    for batch_examples in plan_batches([len(features.tokens[i]) for i in examples], batch_tokens, seed=0, epoch=0):
        batch = pad_batch(features, [examples[i] for i in batch_examples], device)
        side = target_side(target, batch, rows, head.feature_layers)
        dtype = head.layers[0].post_attention_layernorm.weight.dtype
        outs = unroll_drafting(head, head.project(side.aux.to(dtype)), batch.tokens, K)
        valid = valid_positions(batch, K)  # [B, T, K]
        hits = torch.stack([head.d2t[head.logits(h).argmax(-1)] == shifted(side.argmax, k + 1)
                            for k, h in enumerate(outs)], dim=-1)  # [B, T, K]
        agree += (hits & valid).sum((0, 1)).float().cpu()
        counted += valid.sum((0, 1)).float().cpu()
        full = valid.all(-1)  # [B, T] anchors whose K positions count
        accepted.append(hits[full].long().cumprod(-1).sum(-1).cpu())  # [n] leading agreements
    a = torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.long)
    acceptance = [float((a > k).sum() / max(int((a >= k).sum()), 1)) for k in range(K)]
    tau = [1 + float(a.clamp(max=d).float().mean()) if len(a) else 1.0 for d in range(1, K + 1)]
    return ChainMetrics((agree / counted.clamp(min=1)).tolist(), acceptance, tau, int(counted[0]), len(a))


def init_head(target, d2t: Tensor, config: Eagle3TrainConfig) -> Eagle3Head:
    """A fresh head (seeded, float32, attached without CPU kernels) reading out like the target."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        head = Eagle3Head(Eagle3Config.for_target(target.config, len(d2t), config.intermediate_size, config.feature_layers))
    head.d2t = d2t.clone()
    head.attach(target, kernels=False).float()
    head.start_from(target)
    return head


def trainable_parameters(head: Eagle3Head) -> list[torch.nn.Parameter]:
    """Everything but the borrowed embeddings."""
    return [p for name, p in head.named_parameters() if not name.startswith("embed_tokens.")]


def trainable_state(head: Eagle3Head) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in head.state_dict().items() if not k.startswith("embed_tokens.")}


def train_step(head: Eagle3Head, target, optimizer: torch.optim.Optimizer, batch: PaddedBatch, rows: Tensor, lr: float,
               config: Eagle3TrainConfig) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    side = target_side(target, batch, rows, head.feature_layers)
    outs = unroll(head, head.project(side.aux), batch.tokens, config.ttt_steps)
    loss = ttt_loss(head, outs, side, valid_positions(batch, config.ttt_steps))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable_parameters(head), config.clip)
    optimizer.step()
    return loss.item()


def train_eagle3(target, features: Features, config: Eagle3TrainConfig, out: Path, resume: bool = False,
                 progress: bool = True) -> TrainResult:
    """Train (or, with resume, continue training) a head on `features`; checkpoints go to `out`."""
    train, held = split_held_out(len(features.tokens), config.held_out, config.seed)
    d2t = frequent_vocab(features, train, min(config.draft_vocab, target.config.vocab_size), target.config.vocab_size,
                         eos_ids(target))
    head = init_head(target, d2t, config)
    optimizer = torch.optim.AdamW(trainable_parameters(head), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    key = config.resume_key(features)
    start, log = 0, {"losses": [], "history": []}
    if resume:
        start, log = resume_from(out, key, head, optimizer, config.steps)
    warmup = max(1, min(config.warmup, config.steps // 10))
    evals = {round(config.steps * (i + 1) / (config.evaluations + 1)) for i in range(config.evaluations)}
    device, rows = head.d2t.device, draft_rows(target, d2t.to(head.d2t.device))
    losses, history = log["losses"], log["history"]
    bar = tqdm(total=config.steps, initial=min(start, config.steps), desc="train eagle3", unit="step", disable=not progress)
    lengths = [len(features.tokens[i]) for i in train]
    for step, batch_examples in batch_schedule(lengths, config.batch_tokens, config.seed, start, config.steps):
        batch = pad_batch(features, [train[i] for i in batch_examples], device)
        losses.append(train_step(head, target, optimizer, batch, rows, learning_rate(step, config.steps, config.lr, warmup), config))
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        done = step + 1
        if done in evals:
            history.append(log_entry(done, losses, history, evaluate_chain(head, target, features, held, config.batch_tokens,
                                                                           config.ttt_steps)))
            if progress:
                bar.write(f"step {done}: train loss {history[-1]['train_loss']:.4f}, held-out top-1 "
                          f"{history[-1]['held_out_top1'][0]:.4f}, tau {history[-1]['held_out_tau'][-1]:.2f}")
        if done % config.checkpoint_every == 0 or done == config.steps:
            save_checkpoint(out, Checkpoint(trainable_state(head), optimizer.state_dict(), done, key, log))
    bar.close()
    held_out = evaluate_chain(head, target, features, held, config.batch_tokens, config.ttt_steps)
    if not history or history[-1]["step"] != config.steps:
        history.append(log_entry(config.steps, losses, history, held_out))
    tail = losses[-max(1, len(losses) // 10):]
    return TrainResult(head, config.steps, sum(tail) / max(1, len(tail)), held_out, history)


def log_entry(step: int, losses: list[float], history: list[dict], held: ChainMetrics) -> dict:
    since = losses[history[-1]["step"] if history else 0 : step]
    return {"step": step, "train_loss": sum(since) / len(since) if since else None, "held_out_top1": held.top1,
            "held_out_acceptance": held.acceptance, "held_out_tau": held.tau}


def config_from_args(args: argparse.Namespace) -> Eagle3TrainConfig:
    return Eagle3TrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr or DEFAULT_LR, seed=args.seed,
                             draft_vocab=args.draft_vocab, intermediate_size=args.intermediate_size,
                             ttt_steps=args.ttt_steps, feature_layers=tuple(args.feature_layers) if args.feature_layers else None)


def rounded(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


def run(args: argparse.Namespace) -> int:
    """`specdec train eagle3`: collect or load the examples, train, save the head and report."""
    from specdec.models import load_model
    from specdec.models.eagle import load_eagle_head

    config = config_from_args(args)
    out = Path(args.out)
    if args.resume and not (out / CHECKPOINT).exists():
        raise UserError(f"--resume: no checkpoint in {args.out}")
    if args.compare_eagle is not None and not (Path(args.compare_eagle) / "config.json").exists():
        raise UserError(f"--compare-eagle {args.compare_eagle}: not an EAGLE head folder")
    data = training_data(args)
    started = time.perf_counter()
    target = load_model(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf)
    features = training_features(args, target, data)
    collected = time.perf_counter()
    result = train_eagle3(target, features, config, out, resume=args.resume)
    trained = time.perf_counter()
    held = result.held_out
    facts = {
        "trained_with": command_line(args), "data": features.source, "tokens": features.num_tokens,
        "examples": len(features.tokens), "steps": result.step, "ttt_steps": config.ttt_steps,
        "held_out_top1": rounded(held.top1), "held_out_acceptance": rounded(held.acceptance),
        "held_out_tau": rounded(held.tau), "held_out_positions": held.positions, "held_out_anchors": held.anchors,
        "train_loss": round(result.train_loss, 4), "target": args.model,
    }
    save_eagle3_head(result.head, out, extra=facts, dtype=torch.float16)
    metrics = {**facts, "history": result.history, "config": asdict(config),
               "seconds": {"features": round(collected - started, 1), "training": round(trained - collected, 1)}}
    if args.compare_eagle is not None:  # today's EAGLE head on the same held-out examples
        eagle = load_eagle_head(args.compare_eagle).attach(target, kernels=False).float()
        _, held_examples = split_held_out(len(features.tokens), config.held_out, config.seed)
        theirs = evaluate_chain(eagle, target, features, held_examples, config.batch_tokens, config.ttt_steps)
        metrics["eagle"] = {"head": args.compare_eagle, "held_out_top1": rounded(theirs.top1),
                            "held_out_acceptance": rounded(theirs.acceptance), "held_out_tau": rounded(theirs.tau)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(format_report(metrics, out))
    return 0


def format_report(metrics: dict, out: Path) -> str:
    rows = [
        ("data / tokens / examples", f"{metrics['data']} / {metrics['tokens']} / {metrics['examples']}"),
        ("steps (TTT steps)", f"{metrics['steps']} ({metrics['ttt_steps']})"),
        ("train loss (last tenth)", metrics["train_loss"]),
        ("held-out top-1 by step", " ".join(f"{v:.3f}" for v in metrics["held_out_top1"])),
        ("held-out tau by depth", " ".join(f"{v:.2f}" for v in metrics["held_out_tau"])),
    ]
    if "eagle" in metrics:
        rows += [("EAGLE head: top-1 by step", " ".join(f"{v:.3f}" for v in metrics["eagle"]["held_out_top1"])),
                 ("EAGLE head: tau by depth", " ".join(f"{v:.2f}" for v in metrics["eagle"]["held_out_tau"]))]
    rows += [("seconds: features / training", f"{metrics['seconds']['features']} / {metrics['seconds']['training']}"),
             ("head", f"{out}/model.safetensors (use: --drafter eagle3 --eagle3-head {out})")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

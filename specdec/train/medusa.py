"""`specdec train medusa`: Medusa heads by self-distillation on the target's features (Medusa-2 style).

Head k at position t reads the target's feature x_t and learns the target's own distribution for
the token k+2 places ahead: p = softmax(lm_head(x_{t+k+1})) restricted to the draft vocabulary
(d2t, the most frequent response tokens), loss = cross-entropy(p, q_k(x_t)), over response positions
(t from the prompt's last position on; the target's LM head stays frozen). The residual blocks start
at zero (identity), so an untrained head repeats the target's next-token guess.

Measured on held-out examples before and after training, per head: loss, top-1 agreement (head k's
best token equals the target's full-vocabulary argmax at t+k+1: its acceptance estimate under greedy
decoding) and rank accuracies (how often its rank-r token is the argmax), from which the candidate
tree is built (`sparse_tree`) and stored with the heads, with its estimated tau = 1 + sum over nodes
of the product of their rank accuracies.

Writes to --out: config.json + model.safetensors (the heads, see specdec.models.medusa),
report.json (what was measured, the command), checkpoint.pt (weights, optimizer, step: --resume),
features-<data>.safetensors (reusable with --features).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from specdec.batch import eos_ids
from specdec.drafters.medusa import DEFAULT_TREE, sparse_tree
from specdec.errors import UserError
from specdec.models import load_model
from specdec.models.medusa import MedusaConfig, MedusaHeads, save_medusa_heads
from specdec.train.common import (
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

LR = 1e-3  # Medusa's learning rate for heads on a frozen target
HELD_OUT = 0.05  # fraction of examples held out for the measurements
CHECKPOINT_EVERY = 100  # steps
RANKS = 10  # rank accuracies measured per head (the tree's candidates)


@dataclass
class Labels:
    """The target's distributions at a batch's label positions (response tokens s >= response start)."""

    row: Tensor  # [B, T] row of each position in p, -1 where there is no label
    p: Tensor  # [m, Vd] softmax(lm_head(x_s)) over the draft vocabulary, one row per label position
    hidden: Tensor  # [m, D] the target's features x_s there


@dataclass
class HeadPairs:
    """Head k's pairs in a batch: the feature x_t and the label at t+k+1."""

    x: Tensor  # [n, D] target features at t
    label: Tensor  # [n] rows of Labels for t+k+1
    valid: Tensor  # [B, T-k-1] bool: which positions t of the batch the n pairs are


@torch.no_grad()
def target_labels(heads: MedusaHeads, batch: PaddedBatch) -> Labels:
    """Computed once per batch and shared by the heads (head k's label at t is the one at t+k+1)."""
    t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)[None, :]  # [1, T]
    has_label = (t >= batch.response_start[:, None]) & (t < batch.lengths[:, None])  # [B, T]
    row = torch.full(has_label.shape, -1, dtype=torch.long, device=t.device)
    row[has_label] = torch.arange(int(has_label.sum()), device=t.device)
    hidden = batch.hidden[has_label]  # [m, D]
    return Labels(row, heads.lm_head(hidden).float().softmax(-1), hidden)


def head_pairs(batch: PaddedBatch, labels: Labels, k: int) -> HeadPairs:
    """Response positions t (t >= response start - 1) whose t+k+1 lies inside the example."""
    T = batch.tokens.shape[1]
    t = torch.arange(max(T - k - 1, 0), device=batch.tokens.device)  # [T-k-1]
    valid = (t[None, :] >= batch.response_start[:, None] - 1) & (t[None, :] + k + 1 < batch.lengths[:, None])  # [B, T-k-1]
    return HeadPairs(batch.hidden[:, : T - k - 1][valid], labels.row[:, k + 1 :][valid], valid)


def head_loss(heads: MedusaHeads, k: int, pairs: HeadPairs, labels: Labels) -> Tensor:
    """Soft cross-entropy of head k against the target's distribution over the draft vocabulary."""
    log_q = heads.lm_head(heads.medusa_head[k](pairs.x)).float().log_softmax(-1)  # [n, Vd]
    return -(labels.p[pairs.label] * log_q).sum(-1).mean()


def train_step(heads: MedusaHeads, optimizer: torch.optim.Optimizer, batch: PaddedBatch, lr: float) -> list[float]:
    """One AdamW step on the mean of the heads' losses; returns each head's loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    labels = target_labels(heads, batch)
    losses = [head_loss(heads, k, head_pairs(batch, labels, k), labels) for k in range(heads.config.num_heads)]
    optimizer.zero_grad(set_to_none=True)
    torch.stack(losses).mean().backward()
    optimizer.step()
    return [x.item() for x in losses]


@torch.no_grad()
def evaluate(heads: MedusaHeads, target, features: Features, examples: list[int], batch_tokens: int) -> dict:
    """On `examples`, per head k: loss, top-1 agreement with the target's full-vocabulary argmax at t+k+1
    and the accuracy of each of the first RANKS ranks; and chain_top1[k], how often heads 0..k are all
    right at once (where all K heads have a label), whose sum + 1 is the tau of a top-1 chain."""
    K = heads.config.num_heads
    R = min(RANKS, heads.config.draft_vocab_size)
    loss, count = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    hits, chain, chain_count = torch.zeros(K, R, dtype=torch.float64), torch.zeros(K, dtype=torch.float64), 0
    device = heads.d2t.device
    for batch_ids in plan_batches([len(features.tokens[i]) for i in examples], batch_tokens, 0, 0):
        batch = pad_batch(features, [examples[i] for i in batch_ids], device)
        labels = target_labels(heads, batch)
        greedy = torch.cat([target.lm_head(rows).argmax(-1) for rows in labels.hidden.split(256)])  # [m] full vocabulary
        right = torch.zeros(K, *batch.tokens.shape, dtype=torch.bool, device=device)  # [K, B, T] head k right at t
        for k in range(K):
            pairs = head_pairs(batch, labels, k)
            if len(pairs.x) == 0:
                continue
            loss[k] += head_loss(heads, k, pairs, labels).double().cpu() * len(pairs.x)
            count[k] += len(pairs.x)
            ranked = heads.d2t[heads.lm_head(heads.medusa_head[k](pairs.x)).topk(R, dim=-1).indices]  # [n, R]
            hit = ranked == greedy[pairs.label][:, None]  # [n, R]
            hits[k] += hit.double().sum(0).cpu()
            right[k, :, : pairs.valid.shape[1]][pairs.valid] = hit[:, 0]
        every = head_pairs(batch, labels, K - 1).valid  # [B, T-K] positions where every head has a label
        all_right = right[:, :, : every.shape[1]].cummin(0).values  # [K, B, T-K] heads 0..k all right
        chain += all_right[:, every].double().sum(-1).cpu()
        chain_count += int(every.sum())
    accuracy = hits / count.clamp(min=1)[:, None]  # [K, R]
    chain_top1 = (chain / max(chain_count, 1)).tolist()
    return {"loss": (loss / count.clamp(min=1)).tolist(), "top1": accuracy[:, 0].tolist(),
            "rank_accuracy": accuracy.tolist(), "chain_top1": chain_top1, "chain_tau": 1 + sum(chain_top1),
            "positions": count[0].item()}


def estimated_tau(tree: list[tuple[int, ...]], rank_accuracy: list[list[float]]) -> float:
    """1 + expected accepted nodes, heads taken as independent (the tree construction's model)."""
    total = 1.0
    for path in tree:
        chance = 1.0
        for depth, rank in enumerate(path):
            chance *= rank_accuracy[depth][rank]
        total += chance
    return total


def check_args(args: argparse.Namespace) -> None:
    if args.heads < 1:
        raise UserError(f"--heads must be >= 1, got {args.heads}")
    if args.steps < 1 or args.batch_tokens < 1:
        raise UserError("--steps and --batch-tokens must be >= 1")
    if args.lr is not None and args.lr <= 0:
        raise UserError(f"--lr must be > 0, got {args.lr}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    data = training_data(args)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    target = load_model(args.model, dtype="float32", device=args.device)  # heads train in float32
    features = training_features(args, target, data)
    train_ids, held_ids = split_held_out(len(features.tokens), HELD_OUT, args.seed)
    c = target.config
    d2t = frequent_vocab(features, train_ids, min(args.draft_vocab, c.vocab_size), c.vocab_size, eos_ids(target))
    heads = MedusaHeads(MedusaConfig(c.hidden_size, c.vocab_size, args.heads, len(d2t)))
    heads.d2t = d2t
    heads.attach(target, kernels=False)  # trained weights change: no packed copies
    lr = args.lr or LR
    trainable = [p for name, p in heads.named_parameters() if name.startswith("medusa_head.")]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    meta = {"kind": "medusa", "heads": args.heads, "draft_vocab": len(d2t), "seed": args.seed,
            "batch_tokens": args.batch_tokens, "lr": lr, "data": features.source, "tokens": features.num_tokens,
            "data_key": features.key}
    if args.resume:
        start, log = resume_from(out, meta, heads, optimizer, args.steps)
    else:
        start, log = 0, {"history": [], "before": evaluate(heads, target, features, held_ids, args.batch_tokens)}
    history = log["history"]  # [step][K] training loss per head

    t0 = time.perf_counter()
    lengths = [len(features.tokens[i]) for i in train_ids]
    warmup = max(1, min(100, args.steps // 10))
    bar = tqdm(total=args.steps, initial=start, desc="train medusa", unit="step")
    for step, batch_ids in batch_schedule(lengths, args.batch_tokens, args.seed, start, args.steps):
        batch = pad_batch(features, [train_ids[i] for i in batch_ids], heads.d2t.device)
        losses = train_step(heads, optimizer, batch, learning_rate(step, args.steps, lr, warmup))
        history.append([round(x, 4) for x in losses])
        bar.update()
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.3f}")
        if (step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == args.steps:
            weights = {k: v.detach().clone() for k, v in heads.state_dict().items() if not k.startswith("lm_head.")}
            save_checkpoint(out, Checkpoint(weights, optimizer.state_dict(), step + 1, meta, log))
    bar.close()

    after = evaluate(heads, target, features, held_ids, args.batch_tokens)
    tree = sparse_tree(after["rank_accuracy"], len(DEFAULT_TREE))
    report = {
        "command": command_line(args),
        "data": {"source": features.source, "examples": len(features.tokens), "tokens": features.num_tokens,
                 "response_tokens": features.num_response_tokens, "held_out_examples": len(held_ids)},
        "train_loss": {"first_steps": mean_rows(history[:20]), "last_steps": mean_rows(history[-20:])},
        "held_out_before": log["before"],
        "held_out_after": after,
        "medusa_tree": [list(p) for p in tree],
        "estimated_tau": estimated_tau(tree, after["rank_accuracy"]),
        "train_seconds": time.perf_counter() - t0,
    }
    save_medusa_heads(heads, out, extra={"medusa_tree": report["medusa_tree"], "rank_accuracy": after["rank_accuracy"],
                                         "estimated_tau": report["estimated_tau"], "command": report["command"]})
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(summary(report))
    return 0


def mean_rows(rows: list[list[float]]) -> list[float] | None:
    """Per-head mean of a slice of the loss history [steps][K]."""
    if not rows:
        return None
    return [round(sum(col) / len(col), 4) for col in zip(*rows)]


def summary(report: dict) -> str:
    after, before = report["held_out_after"], report["held_out_before"]
    lines = [f"held-out positions: {after['positions']:.0f}",
             "head  loss(before -> after)  top-1 agreement(before -> after)"]
    for k, (loss, top1) in enumerate(zip(after["loss"], after["top1"])):
        lines.append(f"{k:>4}  {before['loss'][k]:.3f} -> {loss:.3f}  {before['top1'][k]:.3f} -> {top1:.3f}")
    lines.append(f"top-1 chain: heads 0..k all right {[round(x, 3) for x in after['chain_top1']]}, tau {after['chain_tau']:.2f}")
    lines.append(f"tree: {report['medusa_tree']}  estimated tau {report['estimated_tau']:.2f} (heads taken as independent)")
    return "\n".join(lines)

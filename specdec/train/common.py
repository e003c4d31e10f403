"""Helpers every drafter trainer shares: data, batches, vocabulary, schedule and checkpoints.

- `training_data`: --data and --prompts read and checked before the target loads (bad input is one
  UserError line), with the recipe of the data to collect: source, each prompt file's name, size,
  SHA-256 and weight, --limit, --max-tokens, --max-new-tokens (self), --seed and --model.
- `training_features`: the Features a run trains on: the first examples of --features up to
  --max-tokens, or collected from --data and --prompts (up to --max-tokens) and saved to
  --out/features-<source>.safetensors with their recipe, which --resume reads back only when the
  recipe's key is this run's (other prompts, weights or limits are refused, never silently reused).
  Trainers put the features' key in their checkpoint's resume key too.
- `split_held_out`: a seeded split of the examples into training and held-out ones.
- `frequent_vocab`: the reduced draft vocabulary, the most frequent target tokens in the training
  responses, always including the EOS tokens; sorted target ids.
- `plan_batches` / `batch_schedule`: examples grouped into batches of about `batch_tokens` tokens
  (one example per row, right-padded: rows are sorted by length within a shuffled window so padding
  stays small). The batch of step s is a pure function of (seed, s), so a resumed run sees exactly the
  batches the uninterrupted run would have seen.
- `pad_batch`: a batch as padded tensors (tokens, float32 features, lengths, response starts).
- `learning_rate`: linear warm-up, then cosine decay to 10% of the peak at the last step.
- `save_checkpoint` / `load_checkpoint`: weights, optimizer state and step in --out/checkpoint.pt.
- `command_line`: the exact `specdec train ...` command that reproduces a run.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from specdec.errors import UserError
from specdec.train.data import Features, collect_features, recipe_key
from specdec.train.prompts import DEFAULT_PROMPTS, PromptSet, check_answers, parse_prompt_spec, read_prompt_sets

CHECKPOINT = "checkpoint.pt"
SHUFFLE_WINDOW = 64  # examples sorted by length together (less padding, still random batches)


def features_path(out: Path, source: str) -> Path:
    return out / f"features-{source}.safetensors"


@dataclass
class TrainingData:
    """The data a run would collect: its prompt files, read, and the recipe that identifies it."""
    sets: list[PromptSet]
    recipe: dict

    @property
    def key(self) -> str:
        return recipe_key(self.recipe)


def training_data(args: argparse.Namespace) -> TrainingData | None:
    """--prompts (default gsm8k-train) read and checked, with --data text's need for answers; None with
    --features (nothing is collected). Call it before loading the target: bad input fails in a moment."""
    if args.features is not None:
        if args.prompts is not None:
            raise UserError("--features and --prompts: give one (--features trains on features collected before)")
        return None
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sets = read_prompt_sets(parse_prompt_spec(args.prompts or DEFAULT_PROMPTS), args.limit)
    if args.data == "text":
        check_answers(sets)
    recipe = {"source": args.data, "prompts": [s.describe() for s in sets], "limit": args.limit,
              "max_tokens": args.max_tokens, "seed": args.seed, "model": args.model}
    if args.data == "self":
        recipe["max_new_tokens"] = args.max_new_tokens
    return TrainingData(sets, recipe)


def training_features(args: argparse.Namespace, target, data: TrainingData | None, progress: bool = True) -> Features:
    """--features FILE: that file's first examples up to --max-tokens tokens; --resume: the features
    saved in --out, when collected from `data`'s recipe; else collected from `data` and saved in --out."""
    out = Path(args.out)
    if args.features is not None:
        if not Path(args.features).exists():
            raise UserError(f"--features {args.features}: no such file")
        features = first_tokens(Features.load(Path(args.features)), args.max_tokens)
        if features.hidden[0].shape[-1] != target.config.hidden_size:
            raise UserError(f"{args.features}: features of width {features.hidden[0].shape[-1]}, the target's is {target.config.hidden_size}")
        return features
    saved = features_path(out, args.data)
    if args.resume and saved.exists():
        features = Features.load(saved)
        if features.key != data.key:
            changed = sorted(k for k in set(data.recipe) | set(features.recipe) if data.recipe.get(k) != features.recipe.get(k))
            raise UserError(f"--resume: {saved} was collected from other data ({', '.join(changed)}); "
                            f"resume with the settings it was made with, or train into a new --out")
        return features
    features = collect_features(target, args.data, data.sets, max_tokens=args.max_tokens,
                                max_new_tokens=args.max_new_tokens, seed=args.seed, recipe=data.recipe, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    features.save(features_path(out, features.source))
    return features


def first_tokens(features: Features, max_tokens: int | None) -> Features:
    """The first examples of `features` holding at most max_tokens tokens (all when None)."""
    sizes = torch.tensor([len(t) for t in features.tokens]).cumsum(0)
    n = len(features.tokens) if max_tokens is None else int((sizes <= max_tokens).sum())
    if n == 0:
        raise UserError(f"--max-tokens {max_tokens} holds no example (the first has {int(sizes[0])} tokens)")
    return Features(features.tokens[:n], features.hidden[:n], features.response_start[:n], features.source, features.recipe)


def split_held_out(num_examples: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) example indices: a seeded `fraction` of the examples (at least one) held out."""
    if num_examples < 2:
        raise UserError(f"need at least 2 training examples (one is held out), got {num_examples}")
    order = np.random.default_rng([seed, 1]).permutation(num_examples)
    held = max(1, round(num_examples * fraction))
    return sorted(order[held:].tolist()), sorted(order[:held].tolist())


def frequent_vocab(features: Features, examples: list[int], size: int, vocab_size: int, always: tuple[int, ...]) -> Tensor:
    """[size] sorted target ids: the `always` ids (EOS), then the most frequent response tokens of
    `examples` (ties, and ids never seen, by smaller id)."""
    if not 0 < size <= vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{vocab_size}, got {size}")
    if len(always) > size:
        raise UserError(f"--draft-vocab {size} cannot hold the {len(always)} EOS tokens")
    responses = torch.cat([features.tokens[i][features.response_start[i]:] for i in examples])  # [N]
    counts = torch.bincount(responses, minlength=vocab_size).double()  # [V]
    counts[list(always)] = math.inf
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by id
    return order[:size].sort().values


def plan_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch: every example once, in batches whose padded size (rows x longest) is at most
    batch_tokens (an example longer than that is a batch alone). Same (seed, epoch), same batches."""
    rng = np.random.default_rng([seed, 2, epoch])
    order = rng.permutation(len(lengths)).tolist()
    batches: list[list[int]] = []
    for w in range(0, len(order), SHUFFLE_WINDOW):
        window = sorted(order[w : w + SHUFFLE_WINDOW], key=lambda i: lengths[i])
        current: list[int] = []
        for i in window:  # ascending lengths: the newest example is the longest
            if current and (len(current) + 1) * lengths[i] > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        batches += [current] if current else []
    return [batches[i] for i in rng.permutation(len(batches))]


def batch_schedule(lengths: list[int], batch_tokens: int, seed: int, start: int, steps: int) -> Iterator[tuple[int, list[int]]]:
    """(step, positions into `lengths`) for steps start .. steps-1, epoch after epoch."""
    step, epoch = 0, 0
    while step < steps:
        for batch in plan_batches(lengths, batch_tokens, seed, epoch):
            if step >= steps:
                return
            if step >= start:
                yield step, batch
            step += 1
        epoch += 1


@dataclass
class PaddedBatch:
    tokens: Tensor  # [B, T] int64, right-padded with 0
    hidden: Tensor  # [B, T, D] float32 target features, zero-padded
    lengths: Tensor  # [B]
    response_start: Tensor  # [B]

    def positions_before(self, end: Tensor) -> Tensor:
        """[B, T] bool: positions t < end[b] (end [B])."""
        return torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :] < end[:, None]


def pad_batch(features: Features, examples: list[int], device: torch.device | str = "cpu") -> PaddedBatch:
    T = max(len(features.tokens[i]) for i in examples)
    D = features.hidden[examples[0]].shape[-1]
    tokens = torch.zeros(len(examples), T, dtype=torch.long)
    hidden = torch.zeros(len(examples), T, D)
    for row, i in enumerate(examples):
        n = len(features.tokens[i])
        tokens[row, :n] = features.tokens[i]
        hidden[row, :n] = features.hidden[i].float()
    lengths = torch.tensor([len(features.tokens[i]) for i in examples])
    starts = torch.tensor([features.response_start[i] for i in examples])
    return PaddedBatch(tokens.to(device), hidden.to(device), lengths.to(device), starts.to(device))


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0.1 x peak at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Checkpoint:
    weights: dict[str, Tensor]  # trainable (and identifying) tensors, float32
    optimizer: dict  # torch.optim state_dict
    step: int  # optimiser steps done
    meta: dict  # what the run must match to resume (config, seed, data)
    log: dict  # the run's record so far (losses, evaluations), continued by the resumed run


def save_checkpoint(out: Path, checkpoint: Checkpoint) -> None:
    """--out/checkpoint.pt, replaced atomically (an interrupted save leaves the previous one)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save({"weights": checkpoint.weights, "optimizer": checkpoint.optimizer, "step": checkpoint.step,
                "meta": checkpoint.meta, "log": checkpoint.log}, tmp)
    tmp.replace(out / CHECKPOINT)


def load_checkpoint(out: Path, meta: dict) -> Checkpoint:
    """The checkpoint in `out`; UserError when there is none or it was made by a different run."""
    path = out / CHECKPOINT
    if not path.exists():
        raise UserError(f"--resume: no checkpoint in {out}")
    data = torch.load(path, map_location="cpu", weights_only=True)
    changed = sorted(k for k in set(meta) | set(data["meta"]) if meta.get(k) != data["meta"].get(k))
    if changed:
        raise UserError(f"--resume: the checkpoint in {out} was made with other settings ({', '.join(changed)})")
    return Checkpoint(data["weights"], data["optimizer"], data["step"], data["meta"], data["log"])


def resume_from(out: Path, meta: dict, head: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> tuple[int, dict]:
    """Load the checkpoint in `out` into head and optimizer (`--resume`): (the step it reached, its log)."""
    checkpoint = load_checkpoint(out, meta)
    head.load_state_dict(checkpoint.weights, strict=False)
    optimizer.load_state_dict(checkpoint.optimizer)
    if checkpoint.step > steps:
        raise UserError(f"--resume: the checkpoint is at step {checkpoint.step}, beyond --steps {steps}")
    return checkpoint.step, checkpoint.log


def command_line(args: argparse.Namespace) -> str:
    """`specdec train KIND --option value ...` with every option of `args` (defaults included)."""
    words = ["specdec", "train", args.kind]
    for name, value in vars(args).items():
        if name in ("command", "kind", "resume") or value is None or value is False:
            continue
        words += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return shlex.join(words)


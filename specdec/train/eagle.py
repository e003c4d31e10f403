"""`specdec train eagle`: train an EAGLE head (Li et al. 2024) on the target's own features; export it.

Task. For every example (token ids x_0..x_{T-1} and the target's final hidden states f_0..f_{T-1}) the
head reads the pairs (f_t, x_{t+1}) causally and predicts f_{t+1}. Loss, over the positions u = t+1
whose feature drafting uses (response positions, u = response start .. T-2, where the next token
exists): SmoothL1(f̂_u, f_u) + w * CE(p_u, q_u), with p_u = softmax of the target's logits at f_u
restricted to the draft vocabulary (computed on the fly from the LM head rows, no stored logits) and
q_u = the head's draft-vocabulary distribution at f̂_u; w = 0.1 as in EAGLE. Input features get
uniform noise U(-a, a) x their RMS (EAGLE's robustness trick: drafting feeds the head its own,
imperfect features). Batches: one example per row, right-padded (causal attention never reads the
padding), about --batch-tokens tokens per step (specdec.train.common). AdamW on fc.weight and the
decoder layer (fc.bias is kept at zero: vLLM's EAGLE layer has none); linear warm-up, cosine decay.

Start. fc passes the feature through (fc.weight = [0 | I], fc.bias = 0) and the decoder layer is
freshly initialised (PyTorch's default, seeded), as in EAGLE. Copying the target's last layer instead
measured worse on SmolLM2-135M (held-out top-1 after 60 steps: 0.04 copied, 0.21 copied with zeroed
o_proj/down_proj, 0.27 fresh): that layer expects the unnormalised residual stream behind its input
norm, and its outputs are on that stream's scale, not on the features'.

Reported. Training loss, and on held-out examples: top-1 agreement (the head's argmax, mapped through
d2t, equals the target's argmax over its full vocabulary at the same position), the draft vocabulary's
coverage of those argmaxes (the ceiling of top-1), and the loss. Written to --out: the head
(save_eagle_head, float16, plus the facts of the run in config.json), metrics.json, checkpoint.pt
(weights, AdamW state, step: `--resume` continues; the same seed gives the same weights either way)
and features-<source>.safetensors (reusable with --features).

Reference layout (`export_reference` / `import_reference`): the folder SafeAILab/EAGLE (EAGLE-1/2,
`eagle/model/cnets1.py`, `use_eagle3=False`) loads. (vLLM and SGLang read every *.safetensors file of a
folder, and this layout's draft_vocab.safetensors would stop vLLM's loader: `specdec export eagle
--layout vllm|sglang` writes theirs, specdec/interop/.) config.json, a Llama config with num_hidden_layers 1, "bias" (EAGLE's fc-bias flag)
and architectures ["LlamaForCausalLM"] (vLLM prefixes "Eagle"); model.safetensors (float16) with
    specdec name                          reference name
    fc.weight [D, 2D]                     fc.weight   (columns: [embedding(t+1) | feature(t)], as both)
    fc.bias [D]                           fc.bias     (only when nonzero; then "bias": true)
    layers.0.self_attn.qkv_proj.weight    layers.0.self_attn.{q,k,v}_proj.weight  (rows split H*Dh, Hkv*Dh, Hkv*Dh)
    layers.0.self_attn.o_proj.weight      layers.0.self_attn.o_proj.weight
    layers.0.mlp.gate_up_proj.weight      layers.0.mlp.{gate,up}_proj.weight      (rows split I, I)
    layers.0.mlp.down_proj.weight         layers.0.mlp.down_proj.weight
    layers.0.post_attention_layernorm     layers.0.post_attention_layernorm.weight
    (none: layer 0 has no input norm)     (none: both skip layers.0.input_layernorm)
    embed_tokens (borrowed)               embed_tokens.weight (the target's, written when the head is
                                          attached: EAGLE's head module owns a copy; vLLM uses the target's)
and draft_vocab.safetensors {"d2t": [Vd] target ids}, which specdec reads back and the reference
loaders ignore (they read out over the full vocabulary through the target's LM head, a superset).
EAGLE's loader tries pytorch_model.bin before model.safetensors (its first releases read only the
.bin: `torch.save(load_file(...), "pytorch_model.bin")` converts); `import_reference` reads either.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from specdec.batch import eos_ids
from specdec.errors import UserError
from specdec.models.checkpoint import read_config, require_keys
from specdec.models.eagle import EagleConfig, EagleHead, save_eagle_head
from specdec.models.linear import float_weight
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

DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class EagleTrainConfig:
    steps: int = 2000
    batch_tokens: int = 2048
    lr: float = DEFAULT_LR
    seed: int = 0
    draft_vocab: int = 8192
    intermediate_size: int | None = None  # None: the target's
    token_weight: float = 0.1  # w, EAGLE's weight of the token cross-entropy
    noise: float = 0.05  # half-width of the uniform input noise, relative to the features' RMS
    held_out: float = 0.05  # fraction of the examples held out
    warmup: int = 100  # steps of linear warm-up (at most a tenth of the run)
    clip: float = 0.5  # gradient-norm clip
    evaluations: int = 4  # held-out evaluations during the run (and one at the end)
    checkpoint_every: int = 50  # steps between checkpoints

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_tokens < 2 or self.lr <= 0:
            raise UserError(f"need --steps >= 1, --batch-tokens >= 2, --lr > 0 (got {self.steps}, {self.batch_tokens}, {self.lr})")

    def resume_key(self, features: Features) -> dict:
        """What a resumed run must share with the run that wrote the checkpoint."""
        keep = {k: v for k, v in asdict(self).items() if k not in ("steps", "evaluations", "checkpoint_every")}
        return {**keep, "examples": len(features.tokens), "data_tokens": features.num_tokens, "source": features.source,
                "data_key": features.key}


@dataclass
class HeldOut:
    top1: float  # head argmax (via d2t) == target argmax
    coverage: float  # target argmax inside the draft vocabulary (top1's ceiling)
    loss: float
    positions: int


@dataclass
class LossParts:
    total: Tensor  # scalar, differentiable
    feature: float  # SmoothL1 of the predicted features
    token: float  # cross-entropy against the target's draft-vocabulary distribution
    positions: int


@dataclass
class TrainResult:
    head: EagleHead
    step: int
    train_loss: float  # mean over the last tenth of the steps
    held_out: HeldOut
    positions_seen: int  # loss positions over all steps
    history: list[dict] = field(default_factory=list)  # {"step", "train_loss", "held_out_top1", ...}


def init_head(target, d2t: Tensor, intermediate_size: int | None, seed: int = 0) -> EagleHead:
    """A head (float32, attached without CPU kernels): a freshly initialised decoder layer (seeded)
    after an fc that passes the feature through."""
    with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's random state
        torch.manual_seed(seed)
        head = EagleHead(EagleConfig.for_target(target.config, len(d2t), intermediate_size))
    head.d2t = d2t.clone()
    D = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, D:] = torch.eye(D)  # [D, 2D]: the feature half passes through
        head.fc.bias.zero_()
    return head.attach(target, kernels=False).float()


def trainable_parameters(head: EagleHead) -> list[torch.nn.Parameter]:
    """fc.weight and the decoder layer; fc.bias stays zero, embeddings and LM head rows are the target's."""
    return [p for name, p in head.named_parameters() if name == "fc.weight" or name.startswith("layers.")]


def loss_mask(batch: PaddedBatch) -> Tensor:
    """[B, T-1] bool: pair t counts when the predicted position u = t+1 is a response position whose
    next token exists (response start <= u <= length - 2)."""
    u = torch.arange(1, batch.tokens.shape[1], device=batch.tokens.device)[None, :]  # [1, T-1]
    return (u >= batch.response_start[:, None]) & (u <= batch.lengths[:, None] - 2)


def predict_features(head: EagleHead, batch: PaddedBatch, noise: float, generator: torch.Generator | None) -> Tensor:
    """[B, T-1, D]: the head's f̂_{t+1} from the pairs (f_t (+ noise), x_{t+1}), causally per row."""
    inputs = batch.hidden[:, :-1]  # [B, T-1, D]
    if noise > 0:
        real = batch.positions_before(batch.lengths)[:, :-1]  # [B, T-1]
        rms = inputs[real].pow(2).mean().sqrt()
        inputs = inputs + (torch.rand(inputs.shape, generator=generator, device=inputs.device) * 2 - 1) * (noise * rms)
    B, T = batch.tokens.shape
    positions = torch.arange(T - 1, device=inputs.device).expand(B, T - 1)
    return head.features(inputs, batch.tokens[:, 1:], positions, cache=None)


def eagle_loss(head: EagleHead, predicted: Tensor, true: Tensor, token_weight: float) -> LossParts:
    """predicted, true [N, D]: the head's and the target's features at the loss positions."""
    feature = F.smooth_l1_loss(predicted, true, reduction="none").mean(-1).mean()
    with torch.no_grad():
        p = head.logits(true).softmax(-1)  # [N, Vd] the target's distribution on the draft vocabulary
    token = -(p * head.logits(predicted).log_softmax(-1)).sum(-1).mean()
    return LossParts(feature + token_weight * token, feature.item(), token.item(), len(true))


def train_step(head: EagleHead, optimizer: torch.optim.Optimizer, batch: PaddedBatch, lr: float,
               config: EagleTrainConfig, generator: torch.Generator) -> LossParts:
    for group in optimizer.param_groups:
        group["lr"] = lr
    mask = loss_mask(batch)  # [B, T-1]
    predicted = predict_features(head, batch, config.noise, generator)[mask]  # [N, D]
    parts = eagle_loss(head, predicted, batch.hidden[:, 1:][mask], config.token_weight)
    optimizer.zero_grad(set_to_none=True)
    parts.total.backward()
    torch.nn.utils.clip_grad_norm_(trainable_parameters(head), config.clip)
    optimizer.step()
    return parts


@torch.no_grad()
def evaluate(head: EagleHead, target, features: Features, examples: list[int], batch_tokens: int,
             token_weight: float = 0.1) -> HeldOut:
    """Top-1 agreement, coverage and loss of `head` on `examples` of `features` (no noise)."""
    device = head.fc.weight.device
    lm_head = float_weight(target.lm_head).detach()  # [V, D]
    in_vocab = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=device)
    in_vocab[head.d2t] = True
    agree = covered = positions = 0
    loss_sum = 0.0
    for batch_examples in plan_batches([len(features.tokens[i]) for i in examples], batch_tokens, seed=0, epoch=0):
        batch = pad_batch(features, [examples[i] for i in batch_examples], device)
        mask = loss_mask(batch)  # [B, T-1]
        predicted = predict_features(head, batch, 0.0, None)[mask]  # [N, D]
        true = batch.hidden[:, 1:][mask]  # [N, D]
        drafted = head.d2t[head.logits(predicted).argmax(-1)]  # [N] target ids
        wanted = torch.cat([F.linear(rows.to(lm_head.dtype), lm_head).argmax(-1) for rows in true.split(256)])  # [N]
        agree += int((drafted == wanted).sum())
        covered += int(in_vocab[wanted].sum())
        loss_sum += eagle_loss(head, predicted, true, token_weight).total.item() * len(true)
        positions += len(true)
    n = max(positions, 1)
    return HeldOut(agree / n, covered / n, loss_sum / n, positions)


def train_eagle(target, features: Features, config: EagleTrainConfig, out: Path, resume: bool = False,
                progress: bool = True) -> TrainResult:
    """Train (or, with resume, continue training) a head on `features`; checkpoints go to `out`."""
    train, held = split_held_out(len(features.tokens), config.held_out, config.seed)
    d2t = frequent_vocab(features, train, min(config.draft_vocab, target.config.vocab_size),
                         target.config.vocab_size, eos_ids(target))
    head = init_head(target, d2t, config.intermediate_size, config.seed)
    optimizer = torch.optim.AdamW(trainable_parameters(head), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    key = config.resume_key(features)
    start, log = 0, {"losses": [], "history": [], "positions_seen": 0}
    if resume:
        start, log = resume_from(out, key, head, optimizer, config.steps)
    warmup = max(1, min(config.warmup, config.steps // 10))
    evals = {round(config.steps * (i + 1) / (config.evaluations + 1)) for i in range(config.evaluations)}
    device = head.fc.weight.device
    losses, history = log["losses"], log["history"]
    bar = tqdm(total=config.steps, initial=min(start, config.steps), desc="train eagle", unit="step", disable=not progress)
    lengths = [len(features.tokens[i]) for i in train]
    for step, batch_examples in batch_schedule(lengths, config.batch_tokens, config.seed, start, config.steps):
        batch = pad_batch(features, [train[i] for i in batch_examples], device)
        generator = torch.Generator(device=device).manual_seed(config.seed * 1_000_003 + step)
        parts = train_step(head, optimizer, batch, learning_rate(step, config.steps, config.lr, warmup), config, generator)
        losses.append(parts.total.item())
        log["positions_seen"] += parts.positions
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", feature=f"{parts.feature:.3f}", token=f"{parts.token:.2f}")
        done = step + 1
        if done in evals:
            history.append(log_entry(done, losses, history, evaluate(head, target, features, held, config.batch_tokens,
                                                                      config.token_weight), log["positions_seen"]))
            if progress:
                bar.write(f"step {done}: train loss {history[-1]['train_loss']:.4f}, held-out top-1 {history[-1]['held_out_top1']:.4f}")
        if done % config.checkpoint_every == 0 or done == config.steps:
            save_checkpoint(out, Checkpoint(trainable_state(head), optimizer.state_dict(), done, key, log))
    bar.close()
    held_out = evaluate(head, target, features, held, config.batch_tokens, config.token_weight)
    if not history or history[-1]["step"] != config.steps:
        history.append(log_entry(config.steps, losses, history, held_out, log["positions_seen"]))
    tail = losses[-max(1, len(losses) // 10):]
    return TrainResult(head, config.steps, sum(tail) / max(1, len(tail)), held_out, log["positions_seen"], history)


def log_entry(step: int, losses: list[float], history: list[dict], held_out: HeldOut, seen: int) -> dict:
    """Mean training loss since the previous entry, and the held-out measures at `step`."""
    since = losses[history[-1]["step"] if history else 0 : step]
    return {"step": step, "train_loss": sum(since) / len(since) if since else None, "held_out_top1": held_out.top1,
            "held_out_coverage": held_out.coverage, "held_out_loss": held_out.loss, "positions_seen": seen}


def trainable_state(head: EagleHead) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in head.state_dict().items() if k.startswith(("fc.", "layers.", "d2t"))}


def config_from_args(args: argparse.Namespace) -> EagleTrainConfig:
    return EagleTrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr or DEFAULT_LR, seed=args.seed,
                            draft_vocab=args.draft_vocab, intermediate_size=args.intermediate_size)


def check_paths(args: argparse.Namespace) -> None:
    """Fail on missing files before spending seconds loading the target."""
    if args.resume and not (Path(args.out) / CHECKPOINT).exists():
        raise UserError(f"--resume: no checkpoint in {args.out}")
    if args.features is not None and not Path(args.features).exists():
        raise UserError(f"--features {args.features}: no such file")
    if args.draft_vocab < 1:
        raise UserError(f"--draft-vocab must be >= 1, got {args.draft_vocab}")


def run(args: argparse.Namespace) -> int:
    """`specdec train eagle`: collect or load features, train, save the head and report."""
    from specdec.models import load_model

    config = config_from_args(args)
    out = Path(args.out)
    check_paths(args)
    data = training_data(args)
    started = time.perf_counter()
    target = load_model(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf)
    features = training_features(args, target, data)
    collected = time.perf_counter()
    result = train_eagle(target, features, config, out, resume=args.resume)
    trained = time.perf_counter()
    facts = {
        "trained_with": command_line(args), "data": features.source, "tokens": features.num_tokens,
        "examples": len(features.tokens), "steps": result.step, "held_out_top1": round(result.held_out.top1, 4),
        "held_out_coverage": round(result.held_out.coverage, 4), "held_out_positions": result.held_out.positions,
        "train_loss": round(result.train_loss, 4), "target": args.model,
    }
    save_eagle_head(result.head, out, extra=facts, dtype=torch.float16)
    metrics = {**facts, "history": result.history, "config": asdict(config),
               "seconds": {"features": round(collected - started, 1), "training": round(trained - collected, 1)}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(format_report(metrics, out))
    return 0


def format_report(metrics: dict, out: Path) -> str:
    rows = [
        ("data / tokens / examples", f"{metrics['data']} / {metrics['tokens']} / {metrics['examples']}"),
        ("steps", metrics["steps"]),
        ("train loss (last tenth)", metrics["train_loss"]),
        ("held-out top-1 agreement", f"{metrics['held_out_top1']:.4f} over {metrics['held_out_positions']} positions"),
        ("held-out vocabulary coverage", f"{metrics['held_out_coverage']:.4f}"),
        ("seconds: features / training", f"{metrics['seconds']['features']} / {metrics['seconds']['training']}"),
        ("head", f"{out}/model.safetensors (use: --drafter eagle --eagle-head {out})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


REFERENCE_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def export_reference(head: EagleHead, folder: str | Path) -> None:
    """Write `head` in the layout SafeAILab/EAGLE (EAGLE-1/2) and vLLM load (see the module docstring)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = head.config
    layer = head.layers[0]
    q, k, v = layer.self_attn.qkv_proj.weight.detach().split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])
    gate, up = layer.mlp.gate_up_proj.weight.detach().chunk(2)
    weights = {"fc.weight": head.fc.weight.detach()}
    has_bias = bool(head.fc.bias.detach().abs().max() > 0)
    if has_bias:
        weights["fc.bias"] = head.fc.bias.detach()
    for name, value in zip(REFERENCE_LAYER, (q, k, v, layer.self_attn.o_proj.weight.detach(), gate, up,
                                             layer.mlp.down_proj.weight.detach())):
        weights[f"layers.0.{name}.weight"] = value
    weights["layers.0.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.detach()
    if head.embed_tokens is not None:
        weights["embed_tokens.weight"] = head.embed_tokens.weight.detach()
    save_file({n: w.to(torch.float16).contiguous().cpu() for n, w in weights.items()}, str(folder / "model.safetensors"))
    save_file({"d2t": head.d2t.cpu().contiguous()}, str(folder / "draft_vocab.safetensors"))
    (folder / "config.json").write_text(json.dumps(reference_config(c, has_bias), indent=2))


def reference_config(c: EagleConfig, bias: bool) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "bias": bias, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float16",
    }


def import_reference(folder: str | Path) -> EagleHead:
    """An EagleHead (float32) from a reference-layout folder: ours, or an EAGLE-1/2 release with one
    Llama layer (model.safetensors or pytorch_model.bin); full vocabulary unless draft_vocab.safetensors."""
    folder = Path(folder)
    d = read_config(folder, "an EAGLE head folder")
    require_keys(d, ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"), f"{folder}/config.json")
    if d.get("num_hidden_layers", 1) != 1 or d.get("hidden_act", "silu") != "silu" or d.get("rope_scaling"):
        raise UserError(f"{folder}: specdec's EAGLE head is one Llama layer (silu, no RoPE scaling)")
    weights = read_reference_weights(folder)
    D, heads = d["hidden_size"], d["num_attention_heads"]
    vocab = load_file(str(folder / "draft_vocab.safetensors"))["d2t"] if (folder / "draft_vocab.safetensors").exists() \
        else torch.arange(d["vocab_size"])
    rope = d.get("rope_parameters") or {}
    config = EagleConfig(D, d["intermediate_size"], heads, d.get("num_key_value_heads") or heads,
                         d.get("head_dim") or D // heads, d.get("rms_norm_eps", 1e-6),
                         float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                         d.get("max_position_embeddings", 4096), d["vocab_size"], len(vocab))
    head = EagleHead(config)
    w = lambda name: weights[f"layers.0.{name}.weight"].float()  # noqa: E731
    state = {
        "fc.weight": weights["fc.weight"].float(),
        "fc.bias": weights["fc.bias"].float() if "fc.bias" in weights else torch.zeros(D),
        "layers.0.self_attn.qkv_proj.weight": torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")]),
        "layers.0.self_attn.o_proj.weight": w("self_attn.o_proj"),
        "layers.0.mlp.gate_up_proj.weight": torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]),
        "layers.0.mlp.down_proj.weight": w("mlp.down_proj"),
        "layers.0.post_attention_layernorm.weight": w("post_attention_layernorm"),
        "d2t": vocab.long(),
    }
    head.load_state_dict(state, strict=False)
    return head


def read_reference_weights(folder: Path) -> dict[str, Tensor]:
    if (folder / "model.safetensors").exists():
        weights = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").exists():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{folder}: no model.safetensors or pytorch_model.bin")
    needed = ["fc.weight"] + [f"layers.0.{n}.weight" for n in REFERENCE_LAYER + ("post_attention_layernorm",)]
    missing = [n for n in needed if n not in weights]
    if missing:
        raise UserError(f"{folder}: not an EAGLE-1/2 head (missing {', '.join(missing[:3])})")
    return weights

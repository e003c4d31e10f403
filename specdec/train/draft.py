"""`specdec train draft`: distil a small draft model from the target, on the target's own distributions.

Model. A Llama-family model of the target's kind (`SharedDraftModel`) with --layers L decoder layers
(default 2), the target's width, attention heads and vocabulary, MLP width --intermediate-size
(default the target's). Its embeddings and LM head are the target's: borrowed at load time, never
stored, so the folder holds L layers and a norm (about 14 MB in float16 for two layers of
SmolLM2-135M). Its read-out covers the --draft-vocab most frequent response tokens (d2t; the
drafter gives every other token q = 0) unless --draft-vocab is the whole vocabulary.

Start. The draft's layers are copies of the target's first L layers, its final norm is the target's:
it starts as the target cut after L layers (an early exit) and learns to make up for the rest. On the
default model (L = 2, --data self, same 250 steps) this beat layers 0 and 29 (evenly spaced) on
unseen problems: top-1 agreement 0.427 vs 0.406, expected acceptance at T=1 0.417 vs 0.391, KL 2.78
vs 2.80; layers 0 and 15, or 27 and 29, were worse still after 100 steps. A narrower MLP
(--intermediate-size) keeps the first units.

Loss. KL(p || q) at response positions t (from the prompt's last position to the second-to-last
token), where p = softmax(lm_head(h_t)) is the target's next-token distribution from its stored
final hidden state h_t, restricted to d2t and renormalised, and q is the draft's over d2t; the draft
runs causally over the whole example without a cache (`run_layers`, cache=None). AdamW on the
decoder layers and the final norm; linear warm-up, cosine decay; gradient norm clipped at 1.

Reported, on held-out examples before and after training: that KL, top-1 agreement (the draft's
argmax equals the target's full-vocabulary argmax: the acceptance estimate for greedy decoding) and
the expected acceptance at temperature 1, the mean of sum_v min(p(v), q(v)) with the full p.

Writes to --out: config.json (an HF config dict of the target's family with num_hidden_layers = L,
plus "specdec_shared_embeddings": true, "specdec_draft_vocab_size" and the facts of the run) and
model.safetensors (float16, HF names: model.layers.{i}.self_attn.q_proj.weight, ..., model.norm.weight,
and d2t [Vd] int64 when the read-out is reduced), report.json, checkpoint.pt (--resume) and
features-<data>.safetensors (reusable with --features). Use: --drafter draft_model --draft-model OUT.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from specdec.batch import eos_ids
from specdec.drafters.draft_model import SharedDraftModel, borrow_target_weights
from specdec.errors import UserError
from specdec.models import load_model
from specdec.models.llama import DecoderLayer, run_layers
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

LR = 5e-4
HELD_OUT = 0.05  # fraction of examples held out for the measurements
CHECKPOINT_EVERY = 50  # steps
CLIP = 1.0
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def init_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """Target layers the draft's layers start from: the first num_layers (see the module docstring)."""
    return list(range(min(num_layers, num_target_layers)))


def init_draft(target, num_layers: int, intermediate_size: int | None, d2t: Tensor | None) -> SharedDraftModel:
    """A float32 draft (no CPU kernels: it is about to be trained) started from the target's layers."""
    c = target.config
    if not 1 <= num_layers <= c.num_layers:
        raise UserError(f"--layers must be in 1..{c.num_layers}, got {num_layers}")
    config = replace(c, num_layers=num_layers, intermediate_size=intermediate_size or c.intermediate_size)
    with torch.device("meta"):  # no embedding or LM head of its own is ever allocated
        draft = SharedDraftModel(config)
    inv_freq = draft.inv_freq  # a real tensor (RoPE is built on the CPU), which to_empty would blank
    draft = draft.to_empty(device=next(target.parameters()).device).float()
    draft.inv_freq = inv_freq
    for layer, source in zip(draft.layers, init_layer_ids(c.num_layers, num_layers)):
        copy_layer(target.layers[source], layer)
    with torch.no_grad():
        draft.norm.weight.copy_(target.norm.weight)
    return borrow_target_weights(draft, target, d2t, kernels=False)


def copy_layer(src: DecoderLayer, dst: DecoderLayer) -> None:
    """src's weights into dst, whose MLP may be narrower (then it keeps src's first units)."""
    width = dst.mlp.down_proj.in_features
    if width > src.mlp.down_proj.in_features:
        raise UserError(f"--intermediate-size must be at most the target's ({src.mlp.down_proj.in_features})")
    source = src.state_dict()
    with torch.no_grad():
        for name, param in dst.state_dict().items():
            value = source[name]
            if name.startswith("mlp.gate_up_proj."):
                value = torch.cat([half[:width] for half in value.chunk(2)])  # [2I, ...]: gate rows, then up rows
            elif name == "mlp.down_proj.weight":
                value = value[:, :width]
            param.copy_(value)


def trainable_parameters(draft: SharedDraftModel) -> list[torch.nn.Parameter]:
    return [*draft.layers.parameters(), *draft.norm.parameters()]


def draft_hidden(draft: SharedDraftModel, tokens: Tensor) -> Tensor:
    """tokens [B, T] -> the draft's final normed hidden states [B, T, D], causally, without a cache."""
    B, T = tokens.shape
    with torch.no_grad():
        x = draft.embed_tokens(tokens)  # [B, T, D] the target's (frozen) embeddings
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    c = draft.config
    return draft.norm(run_layers(draft.layers, x, positions, None, None, draft.inv_freq, draft.rope_attention_factor, c.sliding_window))


def loss_mask(batch: PaddedBatch) -> Tensor:
    """[B, T] bool: positions t whose next token is a response token (response start - 1 <= t <= length - 2)."""
    t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)[None, :]
    return (t >= batch.response_start[:, None] - 1) & (t <= batch.lengths[:, None] - 2)


def distill_loss(draft: SharedDraftModel, batch: PaddedBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(KL(p || q) mean over the loss positions, log q [n, Vd], target hidden [n, D])."""
    mask = loss_mask(batch)  # [B, T]
    h = draft_hidden(draft, batch.tokens)[mask]  # [n, D]
    true = batch.hidden[mask]  # [n, D]
    with torch.no_grad():
        log_p = draft.lm_head(true).float().log_softmax(-1)  # [n, Vd] target on the draft vocabulary
    log_q = draft.lm_head(h).float().log_softmax(-1)  # [n, Vd]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return kl, log_q, true


def train_step(draft: SharedDraftModel, optimizer: torch.optim.Optimizer, batch: PaddedBatch, lr: float) -> float:
    """One AdamW step on the KL (gradient norm clipped); returns the KL."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = distill_loss(draft, batch)[0]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable_parameters(draft), CLIP)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(draft: SharedDraftModel, target, features: Features, examples: list[int], batch_tokens: int) -> dict:
    """Held-out KL (draft vocabulary), top-1 agreement and expected acceptance at temperature 1 (full p)."""
    device = draft.norm.weight.device
    d2t = draft.d2t if draft.d2t is not None else torch.arange(target.config.vocab_size, device=device)
    kl = agree = accept = n = 0.0
    for batch_ids in plan_batches([len(features.tokens[i]) for i in examples], batch_tokens, 0, 0):
        batch = pad_batch(features, [examples[i] for i in batch_ids], device)
        loss, log_q, true = distill_loss(draft, batch)
        kl += loss.item() * len(true)
        for q, h in zip(log_q.exp().split(256), true.split(256)):
            p = target.lm_head(h).float().softmax(-1)  # [m, V] the target's full distribution
            agree += (d2t[q.argmax(-1)] == p.argmax(-1)).sum().item()
            accept += torch.minimum(p[:, d2t], q).sum().item()
        n += len(true)
    n = max(n, 1)
    return {"kl": kl / n, "top1": agree / n, "expected_acceptance_t1": accept / n, "positions": n}


def hf_config(draft: SharedDraftModel, extra: dict) -> dict:
    """The draft's config.json: an HF config of the target's family, plus specdec's keys."""
    c = draft.config
    return {
        "architectures": [ARCHITECTURES[c.model_type]], "model_type": c.model_type, "hidden_act": "silu",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias,
        "tie_word_embeddings": c.tie_word_embeddings, "sliding_window": c.sliding_window,
        "eos_token_id": list(c.eos_token_ids), "torch_dtype": "float16",
        "specdec_shared_embeddings": True,
        "specdec_draft_vocab_size": c.vocab_size if draft.d2t is None else len(draft.d2t),
        **extra,
    }


def hf_weights(draft: SharedDraftModel) -> dict[str, Tensor]:
    """The draft's own weights under HF names (q/k/v and gate/up split again), float16, plus d2t."""
    c = draft.config
    out = {"model.norm.weight": draft.norm.weight}
    for i, layer in enumerate(draft.layers):
        p, attn = f"model.layers.{i}.", layer.self_attn
        sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        for name, w in zip("qkv", attn.qkv_proj.weight.split(sizes)):
            out[f"{p}self_attn.{name}_proj.weight"] = w
        if attn.qkv_proj.bias is not None:
            for name, b in zip("qkv", attn.qkv_proj.bias.split(sizes)):
                out[f"{p}self_attn.{name}_proj.bias"] = b
        out[f"{p}self_attn.o_proj.weight"] = attn.o_proj.weight
        if attn.o_proj.bias is not None:
            out[f"{p}self_attn.o_proj.bias"] = attn.o_proj.bias
        if attn.q_norm is not None:
            out[f"{p}self_attn.q_norm.weight"], out[f"{p}self_attn.k_norm.weight"] = attn.q_norm.weight, attn.k_norm.weight
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate, up
        out[f"{p}mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        if layer.mlp.down_proj.bias is not None:
            out[f"{p}mlp.gate_proj.bias"], out[f"{p}mlp.up_proj.bias"] = layer.mlp.gate_up_proj.bias.chunk(2)
            out[f"{p}mlp.down_proj.bias"] = layer.mlp.down_proj.bias
        out[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight
        out[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    out = {k: v.detach().half().contiguous().cpu() for k, v in out.items()}
    if draft.d2t is not None:
        out["d2t"] = draft.d2t.cpu().long()
    return out


def save_draft(draft: SharedDraftModel, folder: Path, extra: dict | None = None) -> None:
    """folder/config.json + folder/model.safetensors (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hf_weights(draft), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(draft, extra or {}), indent=2))


def check_args(args: argparse.Namespace) -> None:
    if args.steps < 1 or args.batch_tokens < 2:
        raise UserError(f"need --steps >= 1 and --batch-tokens >= 2 (got {args.steps}, {args.batch_tokens})")
    if args.lr is not None and args.lr <= 0:
        raise UserError(f"--lr must be > 0, got {args.lr}")
    if args.intermediate_size is not None and args.intermediate_size < 1:
        raise UserError(f"--intermediate-size must be >= 1, got {args.intermediate_size}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    data = training_data(args)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    target = load_model(args.model, dtype="float32", device=args.device)  # the draft trains in float32
    features = training_features(args, target, data)
    train_ids, held_ids = split_held_out(len(features.tokens), HELD_OUT, args.seed)
    V = target.config.vocab_size
    d2t = frequent_vocab(features, train_ids, min(args.draft_vocab, V), V, eos_ids(target)) if args.draft_vocab < V else None
    draft = init_draft(target, args.layers, args.intermediate_size, d2t)
    lr = args.lr or LR
    optimizer = torch.optim.AdamW(trainable_parameters(draft), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    meta = {"kind": "draft", "layers": args.layers, "intermediate_size": draft.config.intermediate_size,
            "draft_vocab": V if d2t is None else len(d2t), "seed": args.seed,
            "batch_tokens": args.batch_tokens, "lr": lr, "data": features.source, "tokens": features.num_tokens,
            "data_key": features.key}
    if args.resume:
        start, log = resume_from(out, meta, draft, optimizer, args.steps)
    else:
        start, log = 0, {"losses": [], "before": evaluate(draft, target, features, held_ids, args.batch_tokens)}

    t0 = time.perf_counter()
    lengths = [len(features.tokens[i]) for i in train_ids]
    warmup = max(1, min(100, args.steps // 10))
    bar = tqdm(total=args.steps, initial=start, desc="train draft", unit="step")
    for step, batch_ids in batch_schedule(lengths, args.batch_tokens, args.seed, start, args.steps):
        batch = pad_batch(features, [train_ids[i] for i in batch_ids], draft.norm.weight.device)
        loss = train_step(draft, optimizer, batch, learning_rate(step, args.steps, lr, warmup))
        log["losses"].append(round(loss, 4))
        bar.update()
        bar.set_postfix(kl=f"{loss:.3f}")
        if (step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == args.steps:
            weights = {k: v.detach().clone() for k, v in draft.state_dict().items() if k.startswith(("layers.", "norm."))}
            save_checkpoint(out, Checkpoint(weights, optimizer.state_dict(), step + 1, meta, log))
    bar.close()

    after = evaluate(draft, target, features, held_ids, args.batch_tokens)
    losses = log["losses"]
    report = {
        "command": command_line(args),
        "data": {"source": features.source, "examples": len(features.tokens), "tokens": features.num_tokens,
                 "response_tokens": features.num_response_tokens, "held_out_examples": len(held_ids)},
        "init_layers": init_layer_ids(target.config.num_layers, args.layers),
        "train_kl": {"first_steps": mean(losses[:20]), "last_steps": mean(losses[-20:])},
        "held_out_before": log["before"],
        "held_out_after": after,
        "train_seconds": time.perf_counter() - t0,
    }
    save_draft(draft, out, extra={"specdec_init_layers": report["init_layers"], "specdec_trained_with": report["command"],
                                  "specdec_held_out": after})
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(summary(report, out))
    return 0


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def summary(report: dict, out: Path) -> str:
    b, a = report["held_out_before"], report["held_out_after"]
    rows = [
        ("data / examples / tokens", f"{report['data']['source']} / {report['data']['examples']} / {report['data']['tokens']}"),
        ("train KL (first -> last 20 steps)", f"{report['train_kl']['first_steps']} -> {report['train_kl']['last_steps']}"),
        ("held-out KL", f"{b['kl']:.4f} -> {a['kl']:.4f} over {a['positions']:.0f} positions"),
        ("held-out top-1 agreement", f"{b['top1']:.4f} -> {a['top1']:.4f}"),
        ("held-out expected acceptance (T=1)", f"{b['expected_acceptance_t1']:.4f} -> {a['expected_acceptance_t1']:.4f}"),
        ("seconds training", f"{report['train_seconds']:.0f}"),
        ("draft", f"{out} (use: --drafter draft_model --draft-model {out})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

"""Medusa heads (Cai et al. 2024): K extra read-outs of the target's own last feature.

Head k (k = 0 .. K-1) is a residual block x + SiLU(W_k x + b_k) on the target's final (post-norm)
hidden state x_t at position t, read out through the target's LM head. The target's own LM head on
x_t gives token t+1; head k guesses token t+k+2, so K heads guess K tokens beyond the next one.
Here the read-out uses only the rows of the target's LM head for a reduced draft vocabulary
(d2t: draft index -> target token id), borrowed by `MedusaHeads.attach(target)` and never stored.

specdec's own format (`save_medusa_heads` / `load_medusa_heads`): folder/config.json
(MedusaConfig, the candidate tree, training facts) and folder/model.safetensors, float16:
    medusa_head.{k}.{l}.linear.weight [D, D], medusa_head.{k}.{l}.linear.bias [D], d2t [Vd] int64.

Exports (`export_medusa`), for other runtimes; `load_medusa_heads` reads both back:
- layout "medusa", FasterDecoding/Medusa's reference (`MedusaModel.medusa_head`, an nn.ModuleList
  of nn.Sequential(ResBlock * L, nn.Linear(D, V, bias=False))):
    config.json {medusa_num_heads: K, medusa_num_layers: L, base_model_name_or_path, hidden_size, vocab_size}
    medusa_lm_head.safetensors:
        medusa_head.{k}.{l}.linear.weight / .bias  ->  {k}.{l}.linear.weight / .bias
        the target's full LM head [V, D]            ->  {k}.{L}.weight (one copy per head)
  The reference has no reduced vocabulary: its heads read out over all V tokens (so they may pick a
  token outside d2t), and the file holds K copies of the LM head (K x V x D x 2 bytes).
- layout "vllm", vLLM's `Medusa` model (model_type "medusa"):
    config.json {model_type: medusa, num_heads: K, num_hidden_layers: L, hidden_size, vocab_size,
                 truncated_vocab_size: Vd, medusa_fc_bias: true, original_lm_head: true}
    model.safetensors:
        medusa_head.{k}.{l}.linear.weight / .bias  ->  blocks.{k}.layers.{l}.weight / .bias
        the target's LM head rows d2t [Vd, D]       ->  lm_heads.0.weight (shared by every head)
        d2t                                          ->  token_map [Vd] (only when Vd < V)
  Exact: the same blocks and the same reduced read-out.
Importing keeps the residual blocks and the vocabulary; an exported LM head is not read back
(specdec's heads always read out through the target's own LM head rows).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from specdec.errors import UserError
from specdec.models.checkpoint import read_config, read_weights, require_keys
from specdec.models.linear import Linear, float_weight, take_rows, use_cpu_kernels

REFERENCE_FILE = "medusa_lm_head.safetensors"
LAYOUTS = ("medusa", "vllm")


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's
    num_heads: int  # K: head k guesses the token k+1 places after the target's next token
    draft_vocab_size: int  # rows of the reduced read-out (== vocab_size: the full LM head)
    num_layers: int = 1  # residual blocks per head (Medusa's medusa_num_layers)

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(linear(x)); the Linear starts at zero, so a new block is the identity."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = Linear(dim, dim, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., D] -> [..., D]
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*(ResBlock(D) for _ in range(config.num_layers))) for _ in range(config.num_heads)
        )
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)  # [Vd] target ids
        self.lm_head = Linear(D, config.draft_vocab_size, bias=False)  # rows d2t of the target's LM head (frozen)

    def attach(self, target, kernels: bool = True) -> "MedusaHeads":
        """Borrow the d2t rows of the target's LM head; place like the target; pack for the CPU kernel
        (kernels=False when the blocks are about to be trained: packed copies would go stale)."""
        c = target.config
        if c.vocab_size != self.config.vocab_size or c.hidden_size != self.config.hidden_size:
            raise UserError("these Medusa heads were trained for another target (vocabulary or width differ)")
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        self.lm_head = take_rows(target.lm_head, self.d2t, p.dtype, dequantize=not kernels)
        if kernels:
            use_cpu_kernels(self)
        return self

    def features(self, x: Tensor) -> Tensor:
        """x [..., D] target features -> every head's block output [..., K, D]."""
        return torch.stack([head(x) for head in self.medusa_head], dim=-2)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., D] -> draft-vocabulary logits [..., K, Vd] (float32)."""
        return self.lm_head(self.features(x)).float()


def save_medusa_heads(heads: MedusaHeads, folder: Path, extra: dict | None = None) -> None:
    """folder/config.json (MedusaConfig plus `extra`, e.g. the tree and training facts) and
    folder/model.safetensors (blocks in float16, d2t; the borrowed LM head rows are not saved)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v if k == "d2t" else v.half()).detach().contiguous().cpu()
             for k, v in heads.state_dict().items() if not k.startswith("lm_head.")}
    save_file(state, str(folder / "model.safetensors"))
    config = {"specdec_drafter": "medusa", **heads.config.to_dict(), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def load_medusa_heads(folder: str | Path) -> MedusaHeads:
    """Heads from specdec's format or from an export in either layout (see the module docstring)."""
    folder = Path(folder)
    config = read_config(folder, "a Medusa heads folder")
    if (folder / REFERENCE_FILE).exists():
        return import_reference(folder, config)
    if config.get("model_type") == "medusa":
        return import_vllm(folder, config)
    if config.get("specdec_drafter") != "medusa" or not (folder / "model.safetensors").exists():
        raise UserError(f"{folder} is not a Medusa heads folder (specdec, Medusa or vLLM layout)")
    require_keys(config, MedusaConfig.__dataclass_fields__, f"{folder}/config.json")
    heads = MedusaHeads(MedusaConfig(**{k: config[k] for k in MedusaConfig.__dataclass_fields__}))
    state = read_weights(folder / "model.safetensors")
    load_blocks(heads, {k: v for k, v in state.items() if k != "d2t"}, folder)
    if "d2t" not in state or state["d2t"].shape != (heads.config.draft_vocab_size,):
        raise UserError(f"{folder}: d2t missing or not of draft_vocab_size {heads.config.draft_vocab_size}")
    heads.d2t = state["d2t"].long()
    return heads


def load_blocks(heads: MedusaHeads, blocks: dict[str, Tensor], folder: Path) -> None:
    """blocks: specdec names (medusa_head.{k}.{l}.linear.*) -> the heads' residual blocks, in float32."""
    expected = {k for k in heads.state_dict() if k.startswith("medusa_head.")}
    if set(blocks) != expected:
        missing, unexpected = sorted(expected - set(blocks)), sorted(set(blocks) - expected)
        raise UserError(f"{folder}: Medusa weights do not fit (missing {missing[:3]}, unexpected {unexpected[:3]})")
    heads.load_state_dict({k: v.float() for k, v in blocks.items()}, strict=False)


def export_medusa(heads: MedusaHeads, target, folder: str | Path, layout: str = "vllm") -> Path:
    """Write `heads` (attached or not) for FasterDecoding/Medusa (layout "medusa") or vLLM ("vllm"),
    in float16; the read-out is taken from `target`'s LM head."""
    if layout not in LAYOUTS:
        raise UserError(f"unknown Medusa export layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = heads.config
    K, L = c.num_heads, c.num_layers
    lm_head = float_weight(target.lm_head).detach().half().cpu()  # [V, D]
    blocks = {name: v.detach().half().contiguous().cpu() for name, v in heads.state_dict().items()
              if name.startswith("medusa_head.")}
    if layout == "medusa":
        state = {name.removeprefix("medusa_head."): v for name, v in blocks.items()}
        state.update({f"{k}.{L}.weight": lm_head for k in range(K)})
        config = {"medusa_num_heads": K, "medusa_num_layers": L, "base_model_name_or_path": getattr(target, "name", ""),
                  "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}
        save_file({k: v.clone() for k, v in state.items()}, str(folder / REFERENCE_FILE))  # clone: no shared storage
    else:
        state = {vllm_block_name(name): v for name, v in blocks.items()}
        state["lm_heads.0.weight"] = lm_head[heads.d2t.cpu()].contiguous()
        if c.draft_vocab_size < c.vocab_size:
            state["token_map"] = heads.d2t.cpu().long()
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": K, "num_hidden_layers": L,
                  "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "truncated_vocab_size": c.draft_vocab_size,
                  "medusa_fc_bias": True, "original_lm_head": True}
        save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def vllm_block_name(name: str) -> str:
    """medusa_head.{k}.{l}.linear.{weight|bias} -> blocks.{k}.layers.{l}.{weight|bias}"""
    _, k, l, _, kind = name.split(".")
    return f"blocks.{k}.layers.{l}.{kind}"


def import_reference(folder: Path, config: dict) -> MedusaHeads:
    """FasterDecoding/Medusa's folder: config.json + medusa_lm_head.safetensors (full-vocabulary heads)."""
    state = read_weights(folder / REFERENCE_FILE)
    K, L = config.get("medusa_num_heads"), config.get("medusa_num_layers", 1)
    if K is None or f"0.{L}.weight" not in state:
        raise UserError(f"{folder}: not a Medusa reference checkpoint (medusa_num_heads, {{k}}.{L}.weight)")
    V, D = state[f"0.{L}.weight"].shape
    heads = MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, draft_vocab_size=V, num_layers=L))
    blocks = {f"medusa_head.{name}": v for name, v in state.items() if ".linear." in name}
    load_blocks(heads, blocks, folder)
    return heads


def import_vllm(folder: Path, config: dict) -> MedusaHeads:
    """vLLM's Medusa folder: config.json (model_type medusa) + model.safetensors (blocks, lm_heads, token_map)."""
    state = read_weights(folder / "model.safetensors")
    K, L = config["num_heads"], config.get("num_hidden_layers", 1)
    D, V = config["hidden_size"], config["vocab_size"]
    token_map = state.get("token_map")
    Vd = V if token_map is None else len(token_map)
    heads = MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, draft_vocab_size=Vd, num_layers=L))
    blocks = {}
    for k in range(K):
        for l in range(L):
            weight = state.get(f"blocks.{k}.layers.{l}.weight")
            if weight is None:
                raise UserError(f"{folder}: vLLM Medusa weights lack blocks.{k}.layers.{l}.weight")
            blocks[f"medusa_head.{k}.{l}.linear.weight"] = weight
            blocks[f"medusa_head.{k}.{l}.linear.bias"] = state.get(f"blocks.{k}.layers.{l}.bias", torch.zeros(D))
    load_blocks(heads, blocks, folder)
    if token_map is not None:
        heads.d2t = token_map.long()
    return heads

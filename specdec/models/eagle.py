"""The EAGLE draft head (Li et al. 2024): one decoder layer over the target's own features.

Input at position t: the target's feature f_t (its final hidden state after token t) and the
embedding of token t+1; output: a prediction of f_{t+1}, read out by the target's LM head (here a
slice of it over a reduced draft vocabulary, so the read-out is cheap). Drafting feeds the head its
own predicted features. Weights that are the target's (embeddings, LM head rows) are not stored with
the head: `EagleHead.attach(target)` borrows them.

As in EAGLE's reference code (and vLLM's EAGLE Llama), the layer has no input norm: the fc output
enters the attention as it is. Stored weights (safetensors, specdec's names with fused projections):
fc.weight [D, 2D], fc.bias [D], layers.0.* (self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj,
mlp.down_proj, post_attention_layernorm) and d2t [Vd] (draft-vocabulary index -> target token id).
`specdec.train.eagle.export_reference` writes the reference layout and names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from specdec.errors import UserError

from specdec.kv_cache import KVCache
from specdec.models.checkpoint import load_weights, read_config, read_weights, require_keys
from specdec.models import cpu_gemm
from specdec.models.cpu_quant import QuantizedEmbedding
from specdec.models.linear import Linear, quantize_blocks, take_rows, use_cpu_kernels
from specdec.models.llama import DecoderLayer, ModelConfig, run_layers
from specdec.models.views import follow_kernels
from specdec.models.rope import build_rope


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # rows of the reduced read-out (== vocab_size: the full LM head)

    @classmethod
    def for_target(cls, target_config: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None) -> "EagleConfig":
        c = target_config
        return cls(c.hidden_size, intermediate_size or c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                   c.rms_norm_eps, c.rope_theta, c.max_position_embeddings, c.vocab_size, draft_vocab_size)

    def layer_config(self) -> ModelConfig:
        return ModelConfig(
            model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=None, max_position_embeddings=self.max_position_embeddings,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def quantize_head(head: nn.Module) -> None:
    """On the CPU the head's float layers (fc, its decoder layer, a float LM head's rows) go to Q8_0: a draft
    level reads every weight of the head at one row, so it is bound by their bytes. Beside a GGUF target its
    float32 weights (17 MB) cost a draft step more than the target's whole forward saves by being quantised
    (an EAGLE step on the 2-core CPU: 7.7 ms of drafting beside an 18 ms verify); beside a float32 target
    (`--gguf dequantize`, gsm8k-eval 10 x 256, the 2M-token head, one interleaved run) EAGLE went from 1.67x
    to 1.78x plain at the same tau (3.53 and 3.55). A drafter's rounding cannot change the output, only what
    is accepted."""
    for module in head.modules():
        if isinstance(module, Linear) and not module.quantized:
            quantize_blocks(module, module, "Q8_0")


class EagleHead(nn.Module):
    kind = "eagle"  # the drafter it drafts for
    feature_layers = None  # reads the target's final hidden states (drafters.base.target_features)

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.fc = Linear(2 * D, D, bias=True)  # [embedding(t+1), feature(t)] -> D
        self.layers = nn.ModuleList([DecoderLayer(config.layer_config())])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's layer 0 has none (see the docstring)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)  # [Vd] target ids
        rope = build_rope(config.head_dim, config.rope_theta, None, config.max_position_embeddings)
        self.register_buffer("inv_freq", rope.inv_freq, persistent=False)
        self.embed_tokens: nn.Embedding | None = None  # borrowed from the target by attach()
        self.lm_head = Linear(D, config.draft_vocab_size, bias=False)  # rows of the target's LM head (frozen)

    def attach(self, target, kernels: bool = True) -> "EagleHead":
        """Borrow the target's embeddings (shared, frozen) and the d2t rows of its LM head; place like the
        target. kernels=False for training: the CPU kernel's packed weight copies would go stale."""
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        embed = target.embed_tokens
        self.embed_tokens = embed if isinstance(embed, QuantizedEmbedding) else nn.Embedding.from_pretrained(embed.weight.detach(), freeze=True)
        self.lm_head = take_rows(target.lm_head, self.d2t, p.dtype, dequantize=not kernels)
        follow_target_kernels(self, target, kernels)
        return self

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads (Verified.hidden's last dimension)."""
        return self.config.hidden_size

    def mismatch(self, target) -> str | None:
        """Why this head cannot draft for `target` (None: it can)."""
        c, t = self.config, target.config
        if (c.vocab_size, c.hidden_size) != (t.vocab_size, t.hidden_size):
            return f"vocabulary {c.vocab_size}, width {c.hidden_size}; the target's are {t.vocab_size}, {t.hidden_size}"
        return None

    def project(self, hidden: Tensor) -> Tensor:
        """The target's features as the head's input at committed positions: EAGLE reads them as they are."""
        return hidden

    def new_cache(self, batch_size: int, max_len: int, static: bool = False) -> KVCache:
        c, p = self.config, self.layers[0].post_attention_layernorm.weight  # the activations' dtype
        return KVCache(1, batch_size, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device, static)

    def features(self, hidden: Tensor, tokens: Tensor, positions: Tensor, cache: KVCache | None, mask: Tensor | None = None) -> Tensor:
        """hidden [B, T, D] = target (or predicted) features at t, tokens [B, T] = token t+1 -> predicted
        features at t+1 [B, T, D]. cache=None: causal within the block (training)."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden], dim=-1))  # [B, T, D]
        return run_layers(self.layers, x, positions, cache, mask, self.inv_freq, 1.0, None)

    def draft_logits(self, features: Tensor) -> Tensor:
        """features [..., D] -> draft-vocabulary logits [..., Vd] in the head's dtype, as drafting reads them
        (sampling.topk_log_probs computes in float32 whatever it is given: on CUDA its kernel converts as it
        loads, which saves a conversion kernel per tree level)."""
        return self.lm_head(features)

    def logits(self, features: Tensor) -> Tensor:
        """features [..., D] -> draft-vocabulary logits [..., Vd] (float32)."""
        return self.draft_logits(features).float()


def follow_target_kernels(head: nn.Module, target, kernels: bool) -> None:
    """A head's Linear layers on the target's kernel path: Q8_0 blocks for the CPU kernels (quantize_head)
    and the target's kernel choice. kernels=False (training and its held-out metrics): no packed
    copies, which would go stale, and PyTorch's layers: the exact path's visibility tables are [B, T, W, W]
    (kernels.order_visible): an H200 ran out of memory on them (97 GiB) for a held-out batch of 4096 tokens
    under the 7-step training mask."""
    if kernels and next(target.parameters()).device.type == "cpu" and cpu_gemm.available():
        quantize_head(head)
    if kernels:
        use_cpu_kernels(head)
        follow_kernels(head, target)
        return
    for module in head.modules():
        if isinstance(module, Linear):
            module.packed = None
        if isinstance(module, DecoderLayer):
            module.kernels = "library"


def save_eagle_head(head: EagleHead, folder: Path, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """folder/config.json (EagleConfig, plus `extra` facts such as training commands) and
    folder/model.safetensors (fc, layers.0, d2t; the borrowed target weights are not saved), with
    floating-point weights in `dtype` (None: as they are)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in head.state_dict().items() if not k.startswith(("lm_head.", "embed_tokens."))}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"specdec_drafter": "eagle", **head.config.to_dict(), **(extra or {})}, indent=2))


def load_eagle_head(folder: str | Path) -> EagleHead:
    folder = Path(folder)
    config = read_config(folder, "an EAGLE head folder")
    require_keys(config, EagleConfig.__dataclass_fields__, f"{folder}/config.json")
    head = EagleHead(EagleConfig(**{k: config[k] for k in EagleConfig.__dataclass_fields__}))
    state = {k: v.float() for k, v in read_weights(folder / "model.safetensors").items()}
    if "d2t" not in state:
        raise UserError(f"{folder}: weights missing from the EAGLE head: ['d2t']")
    state["d2t"] = state["d2t"].long()
    missing = load_weights(head, state, f"{folder}/model.safetensors")
    if any(not k.startswith("lm_head.") for k in missing):
        raise UserError(f"{folder}: weights missing from the EAGLE head: {missing[:5]}")
    return head

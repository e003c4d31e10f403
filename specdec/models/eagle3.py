"""The EAGLE-3 draft head (Li et al. 2025, arXiv:2503.01840): one decoder layer over the target's low-,
mid- and high-layer features, trained with training-time test.

Features. The target hands the head the residual stream entering three of its decoder layers
(`feature_layers`, HF's hidden_states[i]; by default the reference's [2, L // 2, L - 3]) at every
committed position, concatenated: aux_t [3D] (llama.py `aux_layers`, step.py `target_features`).
`project` (fc, [D, 3D], no bias) maps them to g_t [D].

Layer. At position t the head reads (h_t, token t+1), h_t = g_t at a committed position or its own
output at a drafted one:
    a   = [input_layernorm(embed(token t+1)) ; hidden_norm(h_t)]     [2D]
    x   = h_t + o_proj(attention(q, k, v of a))                      (q/k/v projections 2D wide)
    out = x + mlp(post_attention_layernorm(x))                      [D]: the next step's h
and logits = lm_head(norm(out)) over a reduced draft vocabulary (d2t: draft index -> target id; the
head's own trained rows, started from the target's). So it has the EagleHead interface the drafter
uses (drafters/eagle.py: `project`, `features`, `logits`, `new_cache`, `attach`), and EAGLE-2's dynamic
tree drafts it unchanged: committed positions read project(aux), draft positions the head's output.

The layer is a llama.DecoderLayer with a wider q/k/v input, a second norm and its own forward, and it
follows the target's kernel choice as EAGLE's layer does. On a GPU (and under Triton's interpreter) the
exact Triton stack runs it (kernels.run_layers_exact: the two norms side by side form the q/k/v input,
the rest is a decoder layer's five launches), so each token's outputs are independent of the block as
for every exact forward. cpu_layer.c does not cover it (another forward), so on the CPU its PyTorch path
runs through the packed Linear layers and cpu_attention, also block-independent (the lazy catch-up's
drafts equal eager feeding's). Either way a drafter's rounding changes what is accepted, never the output.

Stored (save_eagle3_head): config.json (Eagle3Config, "specdec_drafter": "eagle3") and
model.safetensors: fc.weight [D, 3D], layers.0.{input_layernorm, hidden_norm, self_attn.qkv_proj [.., 2D],
self_attn.o_proj, post_attention_layernorm, mlp.gate_up_proj, mlp.down_proj}, norm.weight,
lm_head.weight [Vd, D], d2t [Vd]. The embeddings are the target's (borrowed by attach). specdec/interop
writes and reads speculators' / vLLM's / SGLang's EAGLE-3 layout.
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
from specdec.models.cpu_quant import QuantizedEmbedding
from specdec.models.eagle import EagleConfig, follow_target_kernels
from specdec.models.linear import Linear, float_weight
from specdec.models.llama import DecoderLayer, ModelConfig, RMSNorm, run_layers
from specdec.models.rope import build_rope


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The reference's low, mid and high layers, [2, L // 2, L - 3], kept inside 0 .. L - 1."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class Eagle3Config(EagleConfig):
    feature_layers: tuple[int, ...] = ()  # target layers whose input the head reads (HF hidden_states ids)
    target_layers: int = 0  # the target's decoder layers (a head reads the layers of one target)

    @classmethod
    def for_target(cls, target_config: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None,
                   feature_layers: tuple[int, ...] | None = None) -> "Eagle3Config":
        base = EagleConfig.for_target(target_config, draft_vocab_size, intermediate_size)
        L = target_config.num_layers
        return cls(**asdict(base), feature_layers=tuple(feature_layers or default_feature_layers(L)), target_layers=L)

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        values = {k: d[k] for k in cls.__dataclass_fields__}
        return cls(**values | {"feature_layers": tuple(values["feature_layers"])})


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's decoder layer (see the module docstring): x [B, T, 2D] = [embedding of token t+1 ; h_t] ->
    [B, T, D]. input_layernorm normalises the embedding, hidden_norm h; q/k/v read both, 2D wide."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__(c)
        D = c.hidden_size
        self.hidden_norm = RMSNorm(D, c.rms_norm_eps)
        self.self_attn.qkv_proj = Linear(2 * D, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None, slots: Tensor | None,
                attn_mask: Tensor) -> Tensor:
        embedded, h = x.chunk(2, dim=-1)  # [B, T, D] each
        h = h + self.self_attn(self.attention_input(embedded, h), cos, sin, kv, slots, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def unrolled(self, x: Tensor, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None,
                 attn_mask: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The same layer attending over the `past` keys and values [B, Hkv, S, Dh] and its own (training-time
        test, differentiable: no cache writes): (output [B, T, D], keys and values [B, Hkv, S + T, Dh])."""
        embedded, h = x.chunk(2, dim=-1)
        q, k, v = self.self_attn.qkv(self.attention_input(embedded, h), cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        h = h + self.self_attn.attend(q, k, v, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h)), (k, v)

    def attention_input(self, embedded: Tensor, h: Tensor) -> Tensor:
        """[B, T, 2D] = [input_layernorm(embedding) ; hidden_norm(h)]."""
        return torch.cat([self.input_layernorm(embedded), self.hidden_norm(h)], dim=-1)


class Eagle3Head(nn.Module):
    kind = "eagle3"

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        if not config.feature_layers or any(not 0 <= i < config.target_layers for i in config.feature_layers):
            raise UserError(f"EAGLE-3 feature layers {list(config.feature_layers)} must lie in 0..{config.target_layers - 1}")
        self.config = config
        D = config.hidden_size
        self.fc = Linear(len(config.feature_layers) * D, D, bias=False)  # [aux_low ; aux_mid ; aux_high] -> D
        self.layers = nn.ModuleList([Eagle3Layer(config.layer_config())])
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.lm_head = Linear(D, config.draft_vocab_size, bias=False)  # its own rows (trained)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)  # [Vd] target ids
        rope = build_rope(config.head_dim, config.rope_theta, None, config.max_position_embeddings)
        self.register_buffer("inv_freq", rope.inv_freq, persistent=False)
        self.embed_tokens: nn.Module | None = None  # borrowed from the target by attach()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads: the tapped layers' states side by side."""
        return len(self.config.feature_layers) * self.config.hidden_size

    def mismatch(self, target) -> str | None:
        """Why this head cannot draft for `target` (None: it can)."""
        c, t = self.config, target.config
        if (c.vocab_size, c.hidden_size, c.target_layers) != (t.vocab_size, t.hidden_size, t.num_layers):
            return (f"vocabulary {c.vocab_size}, width {c.hidden_size}, {c.target_layers} layers; the target's are "
                    f"{t.vocab_size}, {t.hidden_size}, {t.num_layers}")
        return None

    def attach(self, target, kernels: bool = True) -> "Eagle3Head":
        """Borrow the target's embeddings (shared, frozen); place like the target. kernels=False for training."""
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        embed = target.embed_tokens
        self.embed_tokens = embed if isinstance(embed, QuantizedEmbedding) else nn.Embedding.from_pretrained(embed.weight.detach(), freeze=True)
        follow_target_kernels(self, target, kernels)
        return self

    def start_from(self, target) -> None:
        """The read-out as the target's: lm_head = the target's LM head rows d2t, norm = its final norm."""
        with torch.no_grad():
            self.lm_head.weight.copy_(float_weight(target.lm_head).detach()[self.d2t.to(target.norm.weight.device)])
            self.norm.weight.copy_(target.norm.weight.detach())

    def new_cache(self, batch_size: int, max_len: int, static: bool = False) -> KVCache:
        c, p = self.config, self.norm.weight  # the activations' dtype
        return KVCache(1, batch_size, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device, static)

    def project(self, aux: Tensor) -> Tensor:
        """aux [..., 3D] the target's tapped layers -> g [..., D], the head's input at committed positions."""
        return self.fc(aux)

    def inputs(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """[B, T, 2D] the layer's input: [embedding of token t+1 ; h_t] (hidden [B, T, D], tokens [B, T])."""
        return torch.cat([self.embed_tokens(tokens).to(hidden.dtype), hidden], dim=-1)

    def features(self, hidden: Tensor, tokens: Tensor, positions: Tensor, cache: KVCache | None, mask: Tensor | None = None) -> Tensor:
        """hidden [B, T, D] = h_t (project(aux_t) or the head's own output), tokens [B, T] = token t+1 -> the
        head's output [B, T, D] (the next step's h). cache=None: causal within the block."""
        return run_layers(self.layers, self.inputs(hidden, tokens), positions, cache, mask, self.inv_freq, 1.0, None)

    def draft_logits(self, h: Tensor) -> Tensor:
        """h [..., D] -> draft-vocabulary logits [..., Vd] in the head's dtype (EagleHead.draft_logits)."""
        return self.lm_head(self.norm(h))

    def logits(self, h: Tensor) -> Tensor:
        """h [..., D] -> draft-vocabulary logits [..., Vd] (float32)."""
        return self.draft_logits(h).float()


def save_eagle3_head(head: Eagle3Head, folder: Path, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """folder/config.json (Eagle3Config, plus `extra` facts) and folder/model.safetensors (every weight but the
    borrowed embeddings), floating-point weights in `dtype` (None: as they are)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in head.state_dict().items() if not k.startswith("embed_tokens.")}
    save_file(state, str(folder / "model.safetensors"))
    config = {"specdec_drafter": "eagle3", **asdict(head.config), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def load_eagle3_head(folder: str | Path) -> Eagle3Head:
    folder = Path(folder)
    config = read_config(folder, "an EAGLE-3 head folder")
    if config.get("specdec_drafter") != "eagle3":
        raise UserError(f"{folder} holds a {config.get('specdec_drafter', 'non-specdec')} drafter, not an EAGLE-3 head "
                        "(`specdec train eagle3` writes one; `specdec export --check` reads other layouts)")
    require_keys(config, Eagle3Config.__dataclass_fields__, f"{folder}/config.json")
    head = Eagle3Head(Eagle3Config.from_dict(config))
    state = {k: v.float() for k, v in read_weights(folder / "model.safetensors").items()}
    if "d2t" not in state:
        raise UserError(f"{folder}: weights missing from the EAGLE-3 head: ['d2t']")
    state["d2t"] = state["d2t"].long()
    missing = load_weights(head, state, f"{folder}/model.safetensors")
    unknown = sorted(set(state) - set(head.state_dict()))
    if missing or unknown:
        raise UserError(f"{folder}: weights missing from the EAGLE-3 head or unknown: {(missing + unknown)[:5]}")
    return head

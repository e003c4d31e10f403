"""Native Llama-family transformer: Llama 2/3.x, Mistral, Qwen2/2.5/3, SmolLM.

Contract (shared by every target and draft model):
    forward(tokens [B, T], positions [B, T], cache, mask [B, T, W] | None, logits_at [B] | None,
            aux_layers (i, j, ...) | None)
        -> ModelOutput(logits [B, T or 1, V] float32, hidden [B, T, D], aux [B, T, n*D] | None)
New tokens are written at each row's next free cache slots; `positions` are their RoPE positions
(for a chain, slot index == position; for a tree, depth positions). `mask` says which of the last W
slots (the new block and, for W > T, tree nodes written before it) each new token sees (None =
causal); every new token sees the whole committed prefix before them.

Kernels (specdec/models/kernels.py): each DecoderLayer's `kernels` ("exact", "library", or "auto" where
no loader set it) says whether forwards over a cache run specdec's Triton kernels on CUDA (block- and
batch-invariant) or the modules below (cuBLAS/SDPA; on the CPU, packed Linear layers and cpu_attention
are the exact path).

Auxiliary features (`aux_layers`, for drafters that read the target's inner layers: EAGLE-3): the
residual stream entering each named decoder layer (HF's `hidden_states[i]`: 0 is the embeddings, i the
output of layer i - 1), concatenated in the order named. Every kernel path keeps a reference to (or, in
the C path, a copy of) the stream it computes anyway, so the logits and hidden states are bitwise those
of a forward without them (see `Taps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.errors import UserError
from specdec.kv_cache import KVCache, write_kv
from specdec.models.checkpoint import require_keys
from specdec.models.linear import Linear
from specdec.models import cpu_attention, cpu_layer, fused, kernels
from specdec.models.rope import build_rope, rope_cos_sin
from specdec.models.tensor_parallel import SINGLE, Shard, Split, padded_share

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")  # config.json
# Eager forwards skip cuDNN attention: it builds an execution plan per new shape, and an eager forward
# over a growing cache (a draft model, an EAGLE head) meets a new shape every step (measured on an
# H200: ~100 ms a step). Graph captures (fixed shapes, inside fused.fusing()) keep it: it is fastest there.
EAGER_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CAPTURED_SDPA = [SDPBackend.CUDNN_ATTENTION, *EAGER_SDPA]


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool = False  # q, k, v biases
    o_proj_bias: bool = False  # Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2 does not
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, d: dict, where: str = "the model's config.json") -> "ModelConfig":
        """From an HF config.json dict (old `rope_theta`/`rope_scaling` or new `rope_parameters` style); `where`
        names the file for the error when it lacks a key."""
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"model type {model_type!r} has no native implementation (native: {SUPPORTED_MODEL_TYPES})")
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
        theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        require_keys(d, HF_REQUIRED, where)
        heads = d["num_attention_heads"]
        window = d.get("sliding_window")
        layer_types = d.get("layer_types") or ()
        if d.get("use_sliding_window") is False or (layer_types and "sliding_attention" not in layer_types):
            window = None
        if window is not None and any(t != "sliding_attention" for t in layer_types):
            raise UserError("mixed sliding/full attention layers (layer_types) have no native implementation; use backend='hf'")
        attention_bias = bool(d.get("attention_bias", model_type == "qwen2"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling if scaling and scaling.get("rope_type", scaling.get("type")) != "default" else None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=window,
            eos_token_ids=eos_ids,
        )


@dataclass
class ModelOutput:
    logits: Tensor  # [B, T, V] (or [B, 1, V] with logits_at), float32
    hidden: Tensor  # [B, T, D] final normed hidden states
    aux: Tensor | None = None  # [B, T, n*D] the residual stream entering each of `aux_layers` (asked for), concatenated


@dataclass
class Taps:
    """Where a forward keeps the residual stream entering some decoder layers (`aux_layers`): the layer
    runners (run_layers and its C and Triton paths) put layer i's input x [B, T, D] in `states[i]` as
    they pass it. They keep the tensor they compute anyway (a copy in the C path, which splits its one
    call at the tapped layers): no extra arithmetic, so every output keeps its bits."""

    layers: tuple[int, ...]
    states: dict[int, Tensor] = field(default_factory=dict)

    def concat(self) -> Tensor:
        """[B, T, n*D] the tapped states in the order of `layers`."""
        return torch.cat([self.states[i] for i in self.layers], dim=-1)


def aux_args(aux_layers: tuple[int, ...] | None) -> dict:
    """A forward's keyword for a drafter's target features: none where it reads the final hidden states
    (so any target, or a wrapper of one, works as before), else aux_layers."""
    return {} if aux_layers is None else {"aux_layers": aux_layers}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return fused.run(fused.rms_norm, x, self.weight, self.eps)


def row_parallel(linear: Linear, shard: Shard) -> Linear:
    """Mark a layer whose inputs are split across `shard`'s ranks: its products are partial sums."""
    if shard.parallel:
        linear.split = Split(shard, "rows", linear.out_features)
    return linear


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        self.num_heads = shard.local(c.num_heads, "the attention heads")  # this rank's heads (all of them without TP)
        self.num_kv_heads = shard.local(c.num_kv_heads, "the key/value heads")
        self.head_dim = c.head_dim
        qkv_dim = (self.num_heads + 2 * self.num_kv_heads) * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, qkv_dim, bias=c.attention_bias)  # q, k, v fused
        self.o_proj = row_parallel(Linear(self.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias), shard)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None, slots: Tensor | None, attn_mask: Tensor
    ) -> Tensor:
        """kv: this layer's cache (keys, values [B, Hkv, S, Dh]) to write the new tokens into and attend
        over; None: attend within the block (training)."""
        q, k, v = self.qkv(x, cos, sin)
        if kv is None:
            k_all, v_all = k, v
        else:
            k_all, v_all = kv  # [B, Hkv, S_max, Dh]
            write_kv(k_all, v_all, k, v, slots)
        return self.attend(q, k_all, v_all, attn_mask)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, D] -> q [B, H, T, Dh], k, v [B, Hkv, T, Dh], q and k rotated."""
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = fused.run(fused.rotate, q.transpose(1, 2), cos, sin)  # [B, H, T, Dh]
        k = fused.run(fused.rotate, k.transpose(1, 2), cos, sin)  # [B, Hkv, T, Dh]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, Dh]
        return q, k, v

    def attend(self, q: Tensor, k_all: Tensor, v_all: Tensor, attn_mask: Tensor) -> Tensor:
        """q [B, H, T, Dh] over the first S keys and values of k_all, v_all [B, Hkv, >= S, Dh] as attn_mask
        [B, 1, T, S] allows, then o_proj -> [B, T, D]."""
        B, _, T, _ = q.shape
        span = attn_mask.shape[-1]
        if self.o_proj.packed is not None and cpu_attention.supports(q):  # the exact CPU path: each query on its own
            return self.o_proj(cpu_attention.attend(q, k_all[:, :, :span], v_all[:, :, :span], attn_mask).transpose(1, 2).reshape(B, T, -1))
        with sdpa_kernel(CAPTURED_SDPA if fused.FUSING[0] else EAGER_SDPA, set_priority=fused.FUSING[0]):
            out = F.scaled_dot_product_attention(
                q, k_all[:, :, :span], v_all[:, :, :span], attn_mask=attn_mask, enable_gqa=self.num_kv_heads != self.num_heads
            )  # [B, H, T, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        features = shard.local(c.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(c.hidden_size, 2 * features, bias=c.mlp_bias)  # gate, up fused
        self.down_proj = row_parallel(Linear(features, c.hidden_size, bias=c.mlp_bias), shard)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(fused.run(fused.silu_mul, self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    kernels = "auto"  # "exact" | "library" | "auto", set by specdec.models.kernels.use_kernels

    def __init__(self, c: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, shard)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c, shard)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None, slots: Tensor | None, attn_mask: Tensor
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, slots, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_attention_mask(
    lengths: Tensor, slots: Tensor, positions: Tensor, tree_mask: Tensor | None, window: int | None,
    span: int | None = None,
) -> Tensor:
    """Which cache slots each new token attends to: bool [B, 1, T, S], S = last written slot + 1.

    lengths [B]: slots before this forward; slots, positions [B, T]. tree_mask [B, T, W], W >= T, says
    what each new token sees among the last W slots up to and including the new block (W = T: the block
    itself; W > T: also tree nodes written by earlier forwards, as when a drafter grows a tree level by
    level); every slot before those W is a committed prefix slot and is seen. None = causal block.
    Committed slots hold a chain, so a committed slot's position is its index. `span` fixes S (a static
    cache passes its max_len, avoiding the host synchronisation that measures it).
    """
    B, T = slots.shape
    span = span or int(slots[:, -1].max()) + 1
    j = torch.arange(span, device=slots.device)  # [S]
    W = T if tree_mask is None else tree_mask.shape[-1]
    rel = j[None, None, :] - (lengths[:, None, None] + T - W)  # [B, 1, S] offset into the masked window
    in_window = (rel >= 0) & (rel < W)
    if tree_mask is None:
        sees = in_window & (rel <= torch.arange(T, device=slots.device)[None, :, None])  # [B, T, S]
    else:
        sees = in_window & tree_mask.gather(2, rel.clamp(0, W - 1).expand(B, T, span))
    visible = (rel < 0) | sees  # [B, T, S]
    if window is not None:
        key_pos = j[None, :].expand(B, span).scatter(1, slots, positions)  # [B, S]
        visible &= (positions[:, :, None] - key_pos[:, None, :]) < window
    return visible[:, None]


def causal_mask(positions: Tensor, window: int | None) -> Tensor:
    """[B, 1, T, T] causal (and sliding-window) mask for a block attended without a cache."""
    T = positions.shape[1]
    visible = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()[None]  # [1, T, T]
    if window is not None:
        visible = visible & ((positions[:, :, None] - positions[:, None, :]) < window)
    return visible[:, None]


def run_layers(
    layers: nn.ModuleList, x: Tensor, positions: Tensor, cache: KVCache | None, mask: Tensor | None,
    inv_freq: Tensor, rope_attention_factor: float, window: int | None, taps: Taps | None = None,
) -> Tensor:
    """x [B, T, D] through decoder layers. With a cache: written at each row's next slots, attending per
    `mask` (see build_attention_mask). cache=None: causal within the block (training, no cache). `taps`:
    keep the inputs of those layers (Taps)."""
    if len(layers) and cache is not None and not torch.is_grad_enabled() and kernels.runs_triton(layers[0], x.device, x.dtype):
        if not getattr(cache, "static", False):
            cache.reserve(x.shape[1])  # fails loudly on overflow (a static cache's caller keeps within max_len)
        x = kernels.run_layers_exact(layers, x, positions, cache, mask, inv_freq, rope_attention_factor, window, taps)
        cache.lengths += x.shape[1]
        return x
    if cache is not None and x.device.type == "cpu":  # every layer in one C call, where it covers them (cpu_layer.py)
        out = cpu_layer.run_layers_cpu(layers, x, positions, cache, mask, inv_freq, rope_attention_factor, window, taps)
        if out is not None:
            return out
    cos, sin = rope_cos_sin(positions, inv_freq, rope_attention_factor, x.dtype)
    if cache is None:
        slots, attn_mask = None, causal_mask(positions, window)
    else:
        slots = cache.reserve(x.shape[1])  # [B, T]
        attn_mask = build_attention_mask(cache.lengths, slots, positions, mask, window, cache.max_len if cache.static else None)
    for i, layer in enumerate(layers):
        if taps is not None and i in taps.layers:
            taps.states[i] = x
        x = layer(x, cos, sin, None if cache is None else cache.layer(i), slots, attn_mask)
    if cache is not None:
        cache.lengths += x.shape[1]
    return x


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard = SINGLE) -> None:
        """shard: this process's rank in a tensor-parallel group (specdec/models/tensor_parallel.py); its
        layers then hold this rank's heads and features, and its LM head this rank's vocabulary shard.
        `config` stays the whole model's."""
        super().__init__()
        c = self.config = config
        self.shard = shard
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, shard) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, padded_share(c.vocab_size, shard.world), bias=False)
        if shard.parallel:
            self.lm_head.split = Split(shard, "columns", c.vocab_size)
        elif c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        rope = build_rope(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self.register_buffer("inv_freq", rope.inv_freq, persistent=False)  # [Dh/2] float32
        self.rope_attention_factor = rope.attention_factor
        self.tokenizer = None  # set by the loaders

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, batch_size: int, max_len: int, static: bool = False) -> KVCache:
        c, p = self.config, self.norm.weight  # the activations' dtype (the embedding may be quantised)
        kv_heads = self.shard.local(c.num_kv_heads, "the key/value heads")
        return KVCache(c.num_layers, batch_size, kv_heads, max_len, c.head_dim, p.dtype, p.device, static)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [B, T]
        positions: Tensor,  # [B, T]
        cache: KVCache,
        mask: Tensor | None = None,  # [B, T, W] bool, True = sees (see build_attention_mask)
        logits_at: Tensor | None = None,  # [B] the one position per row that needs logits
        aux_layers: tuple[int, ...] | None = None,  # layers whose input residual stream to return (ModelOutput.aux)
    ) -> ModelOutput:
        x = self.embed_tokens(tokens)  # [B, T, D]
        taps = None if aux_layers is None else Taps(aux_layers)
        x = run_layers(self.layers, x, positions, cache, mask, self.inv_freq, self.rope_attention_factor, self.config.sliding_window,
                       taps)
        aux = None if taps is None else taps.concat()  # [B, T, n*D]
        exact = len(self.layers) > 0 and kernels.runs_triton(self.layers[0], x.device, x.dtype)
        head = None if exact else cpu_layer.norm_and_logits(self.norm, self.lm_head, x, logits_at)  # the CPU's C path
        if head is not None:
            return ModelOutput(logits=head[1], hidden=head[0], aux=aux)
        hidden = kernels.norm_exact(self.norm, x) if exact else self.norm(x)  # [B, T, D]
        h = cpu_layer.positions_at(hidden, logits_at)
        return ModelOutput(logits=kernels.logits_exact(self.lm_head, h) if exact else self.lm_head(h).float(), hidden=hidden,
                           aux=aux)


def random_llama(config: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 shard: Shard = SINGLE) -> LlamaModel:
    """A native model of `config`'s shape with random weights (matrices normal with std 0.02, which keeps a
    deep random net's activations finite in bf16), built directly on `device` (only this rank's shard
    under tensor parallelism): for costs and kernel checks at real shapes (8B, 70B) without weight files,
    never for acceptance."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(config, shard)
    finally:
        torch.set_default_dtype(default)
    model.to(device)  # buffers built on the CPU (rope frequencies) follow
    for p in model.parameters():
        if p.dim() == 2:
            p.data.normal_(0, 0.02)
    return model.eval()

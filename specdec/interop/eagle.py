"""EAGLE-1/2 heads (specdec.models.eagle.EagleHead) out to the layouts vLLM, SGLang and speculators load, and back.

The head is the same network in every layout: fc over [embedding(t+1) | feature(t)] (D x 2D), one
Llama decoder layer without its input norm, read out by the target's own LM head. Only names, config
and the draft vocabulary's home differ (schemas and their sources: specdec.interop.schema):

    specdec (save_eagle_head)        vllm                        sglang                      speculators
    fc.weight                        fc.weight                   fc.weight                   fusion_fc.weight
    fc.bias (zero after training)    (none: vLLM's fc has none)  fc.bias (always)            fusion_fc.bias iff fusion_bias
    layers.0.self_attn.qkv_proj      layers.0.self_attn.{q,k,v}_proj (rows H*Dh, Hkv*Dh, Hkv*Dh) transformer.self_attn.*
    layers.0.mlp.gate_up_proj        layers.0.mlp.{gate,up}_proj (rows I, I)                 transformer.mlp.*
    layers.0.{o_proj,down_proj,post_attention_layernorm} under the same names                  transformer.*
    d2t [Vd]                         hot_token_ids.pt (sidecar) in all three
    config                           {model_type: eagle,         Llama config, architectures  EagleSpeculatorConfig
                                      model: Llama config}       [LlamaForCausalLMEagle]

The target's embeddings and LM head are never written: vLLM shares the target's (and later vLLM
would keep an unloaded copy if the checkpoint named embed_tokens), SGLang replaces them with the
target's (set_embed_and_head), speculators never saves them. The draft vocabulary d2t goes to
`hot_token_ids.pt`, a torch.save'd list of target ids: SGLang reads exactly that with
`--speculative-token-map`, vLLM never reads a .pt file beside safetensors, and importing reads it back.
The "reference" layout (SafeAILab/EAGLE) is specdec.train.eagle.export_reference's.

Weights are written in float16 (as the reference releases); importing gives a float32 head whose
weights are the float16 values, so export -> import is exact for a head already in float16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from specdec.errors import UserError
from specdec.interop.schema import D2T_FILE, REFERENCE_D2T
from specdec.models.checkpoint import read_config
from specdec.models.eagle import EagleConfig, EagleHead
from specdec.models.linear import float_weight

SPECULATORS_VERSION = "0.3.0"  # the speculators release whose EagleSpeculatorConfig the layout follows
LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def unfused_products(head) -> dict[str, Tensor]:
    """The head's decoder layer's products in transformers' names (no prefix): q/k/v and gate/up split
    apart (an EAGLE or EAGLE-3 head; float weights, detached)."""
    c, layer = head.config, head.layers[0]
    q, k, v = float_weight(layer.self_attn.qkv_proj).detach().split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])  # rows
    gate, up = float_weight(layer.mlp.gate_up_proj).detach().chunk(2)
    values = (q, k, v, float_weight(layer.self_attn.o_proj).detach(), gate, up, float_weight(layer.mlp.down_proj).detach())
    return {f"{name}.weight": w for name, w in zip(LAYER, values)}


def fused_products(weight: Callable[[str], Tensor]) -> dict[str, Tensor]:
    """unfused_products back into the head's own names (layers.0.*, q/k/v and gate/up fused), from
    weight(name), a product's weight in transformers' names."""
    return {
        "layers.0.self_attn.qkv_proj.weight": torch.cat([weight(f"self_attn.{p}_proj") for p in "qkv"]),
        "layers.0.self_attn.o_proj.weight": weight("self_attn.o_proj"),
        "layers.0.mlp.gate_up_proj.weight": torch.cat([weight("mlp.gate_proj"), weight("mlp.up_proj")]),
        "layers.0.mlp.down_proj.weight": weight("mlp.down_proj"),
    }


def layer_tensors(head: EagleHead) -> dict[str, Tensor]:
    """The decoder layer in transformers' names (no prefix), unfused, float16 on the CPU."""
    out = {**unfused_products(head), "post_attention_layernorm.weight": head.layers[0].post_attention_layernorm.weight}
    return {name: half(w) for name, w in out.items()}


def half(w: Tensor) -> Tensor:
    return w.detach().to(device="cpu", dtype=torch.float16).contiguous().clone()  # clone: no shared storage


def fc_tensors(head: EagleHead) -> tuple[Tensor, Tensor | None]:
    """(fc.weight, fc.bias or None when it is all zeros)."""
    bias = head.fc.bias.detach()
    return half(float_weight(head.fc)), (half(bias) if bool(bias.abs().max() > 0) else None)


def llama_config(c: EagleConfig, architectures: list[str]) -> dict:
    """The head's decoder layer as a one-layer Llama config (the target's vocabulary)."""
    return {
        "architectures": architectures, "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float16",
    }


def config_from_llama(d: dict, draft_vocab_size: int, where: Path) -> EagleConfig:
    if d.get("num_hidden_layers", 1) != 1 or d.get("hidden_act", "silu") != "silu" or d.get("rope_scaling"):
        raise UserError(f"{where}: specdec's EAGLE head is one Llama layer (silu, no RoPE scaling)")
    try:
        D, heads = d["hidden_size"], d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}
        return EagleConfig(D, d["intermediate_size"], heads, d.get("num_key_value_heads") or heads,
                           d.get("head_dim") or D // heads, d.get("rms_norm_eps", 1e-6),
                           float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                           d.get("max_position_embeddings", 4096), d["vocab_size"], draft_vocab_size)
    except KeyError as e:
        raise UserError(f"{where}: the Llama config lacks {e}") from None


def write_d2t(head: EagleHead, folder: Path) -> str | None:
    """hot_token_ids.pt unless the draft vocabulary is the whole vocabulary in order."""
    d2t = head.d2t.detach().cpu().long()
    if len(d2t) == head.config.vocab_size and torch.equal(d2t, torch.arange(len(d2t))):
        return None
    torch.save(d2t.tolist(), folder / D2T_FILE)
    return D2T_FILE


def export_eagle(head: EagleHead, folder: str | Path, layout: str, target_name: str = "",
                 speculative_tokens: int = 3, verifier_architectures: tuple[str, ...] = ("LlamaForCausalLM",)) -> list[str]:
    """Write `head` in `layout` ("vllm", "sglang" or "speculators"; "reference" is
    specdec.train.eagle.export_reference) into `folder`; returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = head.config
    fc_w, fc_b = fc_tensors(head)
    layer = layer_tensors(head)
    if layout == "vllm":
        if fc_b is not None:
            raise UserError("this head has a nonzero fc.bias, and vLLM's EAGLE-1 fc has no bias "
                            "(llama_eagle.py): export it as sglang, speculators or reference")
        weights = {"fc.weight": fc_w, **{f"layers.0.{n}": w for n, w in layer.items()}}
        config = {"model_type": "eagle", "architectures": ["EagleLlamaForCausalLM"],
                  "model": llama_config(c, ["LlamaForCausalLM"]), "truncated_vocab_size": c.vocab_size}
    elif layout == "sglang":
        bias = fc_b if fc_b is not None else torch.zeros(c.hidden_size, dtype=torch.float16)
        weights = {"fc.weight": fc_w, "fc.bias": bias, **{f"layers.0.{n}": w for n, w in layer.items()}}
        config = llama_config(c, ["LlamaForCausalLMEagle"])
    elif layout == "speculators":
        weights = {"fusion_fc.weight": fc_w, **{f"transformer.{n}": w for n, w in layer.items()}}
        if fc_b is not None:
            weights["fusion_fc.bias"] = fc_b
        config = speculators_config(c, fc_b is not None, target_name, speculative_tokens, list(verifier_architectures))
    else:
        raise UserError(f"unknown EAGLE export layout {layout!r}; choose vllm, sglang, speculators or reference")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    d2t = write_d2t(head, folder)
    return ["config.json", "model.safetensors"] + ([d2t] if d2t else [])


def speculators_config(c: EagleConfig, fusion_bias: bool, target_name: str, speculative_tokens: int,
                       verifier_architectures: list[str]) -> dict:
    """speculators v0.3.0's EagleSpeculatorConfig as its save_pretrained writes it (the decoder layer
    class resolved: "auto" becomes LlamaDecoderLayer and joins architectures)."""
    layer = llama_config(c, ["LlamaForCausalLM"])
    return {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer,
        "layernorms": False,
        "fusion_bias": fusion_bias,
        "speculators_config": proposal_config("eagle", speculative_tokens, target_name, verifier_architectures),
        "torch_dtype": "float16",
    }


def proposal_config(algorithm: str, speculative_tokens: int, target_name: str, verifier_architectures: list[str]) -> dict:
    """speculators' SpeculatorsConfig: greedy proposals of `speculative_tokens`, and the verifier (the target)."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": target_name, "architectures": verifier_architectures},
    }


# ---- import --------------------------------------------------------------------------------------


def import_eagle(folder: str | Path) -> EagleHead:
    """An EagleHead (float32, not attached) from any EAGLE layout specdec writes: vllm, sglang,
    speculators, reference, or specdec's own (save_eagle_head). The layout is read off config.json."""
    from specdec.interop.schema import detect

    folder = Path(folder)
    config = read_config(folder, "an EAGLE head folder")
    if config.get("specdec_drafter") == "eagle":
        from specdec.models.eagle import load_eagle_head

        return load_eagle_head(folder)
    kind, layout = detect(folder)
    if kind != "eagle":
        raise UserError(f"{folder}: a {kind} folder ({layout} layout), not an EAGLE head")
    if layout == "reference":
        from specdec.train.eagle import import_reference

        return import_reference(folder)
    if not (folder / "model.safetensors").is_file():
        raise UserError(f"{folder}: no model.safetensors")
    weights = load_file(str(folder / "model.safetensors"))
    if layout == "vllm":
        llama, fc, prefix = config.get("model") or {}, "fc", "layers.0."
    elif layout == "sglang":
        llama, fc, prefix = config, "fc", "layers.0."
    else:
        llama, fc, prefix = config.get("transformer_layer_config") or {}, "fusion_fc", "transformer."
    d2t = read_sidecar_d2t(folder, llama.get("vocab_size"))
    head = EagleHead(config_from_llama(llama, len(d2t), folder))
    try:
        w = lambda name: weights[f"{prefix}{name}.weight"].float()  # noqa: E731
        state = {
            "fc.weight": weights[f"{fc}.weight"].float(),
            "fc.bias": weights[f"{fc}.bias"].float() if f"{fc}.bias" in weights else torch.zeros(head.config.hidden_size),
            **fused_products(w),
            "layers.0.post_attention_layernorm.weight": w("post_attention_layernorm"),
            "d2t": d2t,
        }
    except KeyError as e:
        raise UserError(f"{folder}: model.safetensors lacks {e} ({layout} layout)") from None
    try:
        head.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise UserError(f"{folder}: the weights do not fit the config ({str(e).splitlines()[-1].strip()})") from None
    return head


def read_sidecar_d2t(folder: Path, vocab_size: int | None) -> Tensor:
    from specdec.interop.schema import read_d2t

    for name in (D2T_FILE, REFERENCE_D2T):
        if (folder / name).is_file():
            return read_d2t(folder / name)
    if not isinstance(vocab_size, int):
        raise UserError(f"{folder}: the config has no vocab_size")
    return torch.arange(vocab_size)

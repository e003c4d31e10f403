"""EAGLE-3 heads (specdec.models.eagle3.Eagle3Head) out to the layouts vLLM and SGLang load, and back.

The network is the same in every layout: fc over the three tapped target layers [D, 3D] (no bias),
one decoder layer whose q/k/v read [input_layernorm(embedding) ; hidden_norm(h)] (embedding first, in
specdec as in SafeAILab/EAGLE cnets.py, SGLang and vLLM llama_eagle3.py and speculators eagle3.py) with
the residual on h itself (norm_before_residual false), then norm and a draft-vocabulary LM head. Names,
config and two conventions differ (the schemas and the files they were read from: specdec.interop.schema):

    specdec (save_eagle3_head)          speculators (= the vllm layout)          sglang (SafeAILab EAGLE-3 names)
    fc.weight [D, 3D]                   fc.weight                                fc.weight
    layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}   layers.0.*    midlayer.*
    layers.0.self_attn.qkv_proj [.., 2D]  layers.0.self_attn.{q,k,v}_proj [H*Dh | Hkv*Dh | Hkv*Dh, 2D]   midlayer.*
    layers.0.mlp.gate_up_proj           layers.0.mlp.{gate,up}_proj              midlayer.*
    norm.weight, lm_head.weight [Vd, D] the same                                 the same
    d2t [Vd] target ids                 d2t [Vd] int64 OFFSETS, target id = i + d2t[i]; t2d [V] bool (both layouts)
    feature_layers (HF hidden_states ids = the inputs of those layers)
                                        eagle_aux_hidden_state_layer_ids: the    eagle_config.eagle_aux_hidden_state_layer_ids:
                                        same ids (vLLM taps layer inputs)        ids - 1 (SGLang taps id + 1), written only
                                                                                 when not the default [2, L // 2, L - 3]

vLLM and SGLang concatenate the taps in layer order and their fc reads exactly three: a head whose
feature layers are not three distinct layers >= 1 cannot be exported; one whose layers are out of
order is written with fc's column blocks permuted into layer order (the same function; the sums run
in another order, so drafts match to rounding, not bit for bit). The embeddings are never written
(vLLM shares the target's when the checkpoint has none, SGLang replaces them). Weights are float16 (as
the EAGLE-3 releases); importing gives a float32 head holding the float16 values.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from specdec.errors import UserError
from specdec.interop.eagle import (SPECULATORS_VERSION, config_from_llama, fused_products, half, llama_config,
                                   proposal_config, unfused_products)
from specdec.interop.schema import EAGLE3_TAPS, validate
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, default_feature_layers
from specdec.models.linear import float_weight

LAYER_PREFIX = {"speculators": "layers.0.", "sglang": "midlayer."}
NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


@dataclass(frozen=True)
class Taps:
    """Where a head's features come from, in layer order: `layers` (HF hidden_states ids, increasing) and
    `order`, the head's feature block each one is (fc's column blocks are permuted by it)."""

    layers: tuple[int, ...]
    order: tuple[int, ...]


def taps_of(head: Eagle3Head) -> Taps:
    """The head's feature layers as vLLM and SGLang tap them, or a one-line error why they cannot be."""
    layers = head.config.feature_layers
    if len(layers) != EAGLE3_TAPS or len(set(layers)) != EAGLE3_TAPS:
        raise UserError(f"this EAGLE-3 head reads target layers {list(layers)}; vLLM and SGLang tap three distinct "
                        "layers (retrain with --feature-layers naming three)")
    if min(layers) < 1:
        raise UserError(f"this EAGLE-3 head reads target layer 0 (the embeddings, {list(layers)}); vLLM taps a layer's "
                        "input as hidden + residual, which layer 0 does not have yet")
    order = tuple(sorted(range(EAGLE3_TAPS), key=lambda k: layers[k]))
    return Taps(tuple(layers[k] for k in order), order)


def fc_in_layer_order(head: Eagle3Head, taps: Taps) -> Tensor:
    """fc.weight [D, 3D] with its column blocks in the taps' layer order."""
    w = float_weight(head.fc).detach()
    D = head.config.hidden_size
    return w.view(D, EAGLE3_TAPS, D)[:, list(taps.order)].reshape(D, EAGLE3_TAPS * D)


def layer_tensors(head: Eagle3Head) -> dict[str, Tensor]:
    """The decoder layer in transformers' names (no prefix), q/k/v and gate/up unfused (q/k/v's columns:
    [embedding ; h])."""
    return {**unfused_products(head), **{f"{name}.weight": getattr(head.layers[0], name).weight for name in NORMS}}


def vocab_tensors(head: Eagle3Head) -> dict[str, Tensor]:
    """d2t as offsets [Vd] int64 (target id - draft index) and t2d [V] bool (the target ids drafted)."""
    ids = head.d2t.detach().cpu().long()  # [Vd] absolute target ids (specdec's convention)
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def head_tensors(head: Eagle3Head, layout: str, taps: Taps) -> dict[str, Tensor]:
    prefix = LAYER_PREFIX[layout]
    floats = {"fc.weight": fc_in_layer_order(head, taps), **{prefix + n: w for n, w in layer_tensors(head).items()},
              "norm.weight": head.norm.weight, "lm_head.weight": float_weight(head.lm_head)}
    return {**{name: half(w) for name, w in floats.items()}, **vocab_tensors(head)}


def export_eagle3(head: Eagle3Head, folder: str | Path, layout: str, target_name: str = "", speculative_tokens: int = 3,
                  verifier_architectures: tuple[str, ...] = ("LlamaForCausalLM",)) -> list[str]:
    """Write `head` in `layout` ("speculators" or "vllm", the same folder; "sglang") into `folder`;
    returns the files written."""
    layout = "speculators" if layout == "vllm" else layout
    if layout not in LAYER_PREFIX:
        raise UserError(f"unknown EAGLE-3 export layout {layout!r}; choose vllm, sglang or speculators")
    if head.d2t.unique().numel() != head.d2t.numel():
        raise UserError("this EAGLE-3 head's draft vocabulary repeats a target id; t2d and vLLM's scatter need each once")
    taps = taps_of(head)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "speculators":
        config = speculators_config(head.config, taps, target_name, speculative_tokens, list(verifier_architectures))
    else:
        config = sglang_config(head.config, taps)
    save_file(head_tensors(head, layout, taps), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["config.json", "model.safetensors"]


def speculators_config(c: Eagle3Config, taps: Taps, target_name: str, speculative_tokens: int,
                       verifier_architectures: list[str]) -> dict:
    """speculators' Eagle3SpeculatorConfig as its save_pretrained writes it, with every field vLLM's
    update_eagle3 reads set explicitly (norm_before_residual defaults to true there)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": llama_config(c, ["LlamaForCausalLM"]),
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(taps.layers),  # vLLM: the inputs of these layers
        "speculators_config": proposal_config("eagle3", speculative_tokens, target_name, verifier_architectures),
        "torch_dtype": "float16",
    }


def sglang_config(c: Eagle3Config, taps: Taps) -> dict:
    """SafeAILab/EAGLE's EAGLE-3 config (a one-layer Llama config with draft_vocab_size), as SGLang reads it."""
    config = {**llama_config(c, ["LlamaForCausalLMEagle3"]), "draft_vocab_size": c.draft_vocab_size}
    if taps.layers != default_feature_layers(c.target_layers):
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps.layers]}  # SGLang taps id + 1
    return config


# ---- import --------------------------------------------------------------------------------------


def import_eagle3(folder: str | Path, target_layers: int) -> Eagle3Head:
    """An Eagle3Head (float32, not attached) from a speculators / vllm or sglang EAGLE-3 folder, for a
    target of `target_layers` decoder layers (the layouts do not record it; default taps derive from it).
    The folder must validate against its layout's schema."""
    from specdec.interop.schema import detect

    folder = Path(folder)
    kind, layout = detect(folder)
    layout = "speculators" if layout == "vllm" else layout
    if kind != "eagle3":
        raise UserError(f"{folder}: a {kind} folder ({layout} layout), not an EAGLE-3 head")
    result = validate(folder, "eagle3", layout)
    if not result.ok:
        raise UserError(f"{folder}: not a valid {layout} EAGLE-3 folder: {result.problems[0]}")
    config = json.loads((folder / "config.json").read_text())
    llama = config["transformer_layer_config"] if layout == "speculators" else config
    if config.get("target_hidden_size", llama["hidden_size"]) != llama["hidden_size"]:
        raise UserError(f"{folder}: target_hidden_size {config['target_hidden_size']} differs from the head's width; "
                        "specdec's EAGLE-3 head reads a target of its own width")
    base = config_from_llama(llama, config["draft_vocab_size"], folder)
    layers = read_taps(config, layout, target_layers)
    head = Eagle3Head(Eagle3Config(**asdict(base), feature_layers=layers, target_layers=target_layers))
    load_head_tensors(head, load_file(str(folder / "model.safetensors")), LAYER_PREFIX[layout], folder)
    return head


def read_taps(config: dict, layout: str, target_layers: int) -> tuple[int, ...]:
    """The tapped layers as HF hidden_states ids (specdec's feature_layers)."""
    if layout == "speculators":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        return tuple(ids) if ids else default_feature_layers(target_layers)
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(i + 1 for i in ids) if ids else default_feature_layers(target_layers)


def load_head_tensors(head: Eagle3Head, weights: dict[str, Tensor], prefix: str, folder: Path) -> None:
    w = lambda name: weights[prefix + name + ".weight"].float()  # noqa: E731
    draft_ids = torch.arange(head.config.draft_vocab_size)
    state = {
        "fc.weight": weights["fc.weight"].float(),
        **fused_products(w),
        **{f"layers.0.{name}.weight": w(name) for name in NORMS},
        "norm.weight": weights["norm.weight"].float(),
        "lm_head.weight": weights["lm_head.weight"].float(),
        "d2t": weights["d2t"].long() + draft_ids,  # offsets -> absolute target ids
    }
    result = head.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise UserError(f"{folder}: the EAGLE-3 head's weights do not match: {(result.missing_keys + result.unexpected_keys)[:5]}")

"""What other runtimes' loaders read from a drafter folder, written down from their code, and a validator.

A `Schema` is one (drafter kind, layout) pair: the config.json keys the loader reads (with their types
and any value it requires), the tensors its weight loader maps onto parameters (names and shapes,
derived from the config), whether it reads every *.safetensors file in the folder, and the sidecar
file holding the draft vocabulary (d2t: draft index -> target token id) where the layout has one.
`validate(folder, kind, layout)` checks a folder against it without loading any weights (safetensors
headers only) and returns the problems found.

Sources, read for this (GitHub files at the commits given; "later main" = a newer stored copy of the
same file, whose commit the index did not give):

vLLM (vllm-project/vllm)
- `vllm/transformers_utils/configs/eagle.py` @ 23c5aa92d517802488a0c77a5f58cd0a2019c5a3 (EAGLEConfig):
  `model_type: "eagle"`, `model` = a dict built with `AutoConfig.for_model(**model)`, optional
  `truncated_vocab_size` (default `model.vocab_size`); method "eagle" makes the architectures
  `Eagle{arch}` of `model.architectures` ("LlamaForCausalLM" -> "EagleLlamaForCausalLM"). Top-level
  keys that the sub-config also has are copied onto it, so the top level holds nothing else.
- `vllm/model_executor/models/llama_eagle.py` @ e1c4a55214c63e19e83f82ad6c552d82148bae0b and later main
  (EagleLlamaForCausalLM): checkpoint names without "lm_head" get "model." prepended, then
  q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj are stacked; parameters are `fc.weight`
  [D, 2D] (nn.Linear(2D, D, bias=False): no fc.bias), `layers.0.*` (input_layernorm replaced by an
  identity), `embed_tokens` (skipped when pipeline parallelism is off); there is no lm_head module,
  the target's is shared. Later main calls `process_eagle_weight` (models/utils.py), which marks the
  draft as owning embed_tokens / lm_head as soon as a checkpoint name contains them, and the proposer
  (v1/spec_decode) then keeps the draft's own (here never loaded) embedding unless equal to the
  target's: so the export carries neither. No d2t: EAGLE-1 reads out over the full vocabulary.
- `vllm/model_executor/model_loader/default_loader.py` `_prepare_weights`: every "*.safetensors" file
  of the folder is read (the first matching pattern wins, so a ".pt" sidecar is never read).
- `vllm/transformers_utils/configs/speculators/base.py` @ 94699746757f9d68e2f4bd89ad2c4b10ed962457 and
  `algos.py` @ cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec (+ later main): a config with
  `speculators_model_type` must name a registered algorithm: "eagle3" (later also "peagle", "dflash").
  "eagle" (EAGLE-1) is not registered in any stored version, so vLLM does not load the speculators
  EAGLE-1 layout below; it is for the speculators library.
- EAGLE-3: `vllm/model_executor/models/llama_eagle3.py` @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
  (Eagle3LlamaForCausalLM): names without "lm_head" get "model." prepended, "midlayer." becomes
  "layers.0." (so both spellings load), q/k/v and gate/up are stacked; parameters `fc.weight`
  [D, 3 * target_hidden_size] (no bias; exactly three tapped layers), `layers.0.{input_layernorm,
  hidden_norm, post_attention_layernorm}`, q/k/v_proj reading 2D = [input_layernorm(embedding) ;
  hidden_norm(h)] (embedding first), `norm.weight`, `lm_head.weight` [draft_vocab_size, D], `d2t` ->
  `draft_id_to_target_id` (int64 OFFSETS: compute_logits scatters draft logit i to target id
  i + d2t[i]), `t2d` skipped, `embed_tokens` skipped when absent (the target's is shared). The
  residual is h itself unless `norm_before_residual` (then hidden_norm(h)).
  `configs/speculators/algos.py` (`update_eagle3`, later main): `draft_vocab_size`,
  `target_hidden_size`, `norm_before_residual` (DEFAULT TRUE when absent), `norm_before_fc` (default
  false), `eagle_aux_hidden_state_layer_ids`, architectures -> ["Eagle3LlamaForCausalLM"].
  `models/llama.py` LlamaModel.forward: layer idx in aux_hidden_state_layers appends
  `hidden_states + residual` before layer idx runs (its input: HF hidden_states[idx]; idx 0 has no
  residual yet), in layer order; `v1/worker/gpu_model_runner.py` `_get_eagle3_aux_layers_from_config`
  reads `eagle_aux_hidden_state_layer_ids` from the draft config (default (2, L // 2, L - 3)).
- `vllm/model_executor/models/medusa.py` @ 09cddad8f0324594022359cd2b07e962a14b895f and
  `vllm/transformers_utils/configs/medusa.py` @ 4bb77b3239adff81001f12cd9c9a39b65800a373 (Medusa):
  `blocks.{k}.layers.{l}.weight` [D, D] (+ `.bias` when `medusa_fc_bias`), `lm_heads.0.weight`
  (one head shared by all when `original_lm_head`, else `lm_heads.{k}.weight`), `token_map` [Vd]
  integer ids when `truncated_vocab_size` < `vocab_size` (asserted), config keys with "num" and
  "heads" / "layers" renamed to num_heads / num_hidden_layers.

SGLang (sgl-project/sglang)
- `python/sglang/srt/models/llama_eagle.py` @ 3b64d5dee0756de843b5f022966f69c995cd15ea and later main
  (LlamaForCausalLMEagle, chosen by `architectures`): `fc = nn.Linear(2D, D)` *with* a bias (left at
  its random initialisation if the checkpoint lacks it), `layers.0` without input_layernorm; names
  without "lm_head" get "model." prepended and go through LlamaForCausalLM.load_weights
  (`models/llama.py` @ bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf: stacked q/k/v and gate/up, unknown
  names logged and skipped). `tie_word_embeddings: true` would make lm_head the embedding; later main
  sizes lm_head by `hot_vocab_size`.
- `python/sglang/srt/speculative/eagle_worker.py` (`load_token_map`, `hot_token_id`): with
  `--speculative-token-map FILE`, FILE is `torch.load`ed into the list of draft token ids, the draft's
  LM head is the target's rows at those ids and drafted indices map back through it: exactly specdec's
  d2t. EAGLE and embeddings come from the target (`set_embed_and_head`). The model loader reads every
  "*.safetensors" file of the folder (model_loader/loader.py `_prepare_weights`).
- `python/sglang/srt/models/llama_eagle3.py` @ 03d5a7771f6082e7737a5f19cae7d1e863087013
  (LlamaForCausalLMEagle3, "adapted from SafeAILab/EAGLE eagle/model/cnets.py"): `model.midlayer`
  (a decoder layer whose q/k/v read cat([input_layernorm(embeds), hidden_norm(h)]), residual h),
  `model.fc` (bias iff config "bias"), `model.norm`, `lm_head` [draft_vocab_size, D] (the embedding
  if tie_word_embeddings; the target's rows if draft_vocab_size is null); checkpoint names are tried
  as given, then with "model." prepended, and SKIPPED SILENTLY when neither is a parameter (so
  `layers.0.*` would load nothing: the layout must say `midlayer.*`); `d2t` becomes hot_token_id =
  d2t + arange (offsets), `t2d` is skipped. `models/llama.py` set_eagle3_layers_to_capture: default
  [2, L // 2, L - 3] tapped as layer inputs; ids from the draft config's
  `eagle_config.eagle_aux_hidden_state_layer_ids` are shifted by one (layers_to_capture = id + 1:
  SpecForge's "output of layer id" convention); `model_executor/model_runner.py` reads them.
- `python/sglang/srt/speculative/spec_info.py`: algorithms EAGLE, EAGLE3, STANDALONE, NGRAM, DFLASH,
  FROZEN_KV_MTP: no Medusa.

speculators (vllm-project/speculators)
- v0.3.0 (be6e86e79eee8b2d363399a767194e53f5407331) `src/speculators/models/eagle.py`
  (EagleSpeculatorConfig / EagleSpeculator), `config.py` (SpeculatorModelConfig, SpeculatorsConfig,
  VerifierConfig), `proposals/greedy.py`: `speculators_model_type: "eagle"`, `speculators_version`,
  `architectures` ["EagleSpeculator", + the decoder layer class], `transformer_layer_architecture`,
  `transformer_layer_config` (AutoConfig.for_model dict), `layernorms`, `fusion_bias`,
  `speculators_config` {algorithm, proposal_methods [{proposal_type "greedy", speculative_tokens >= 1,
  verifier_accept_k >= 1, accept_tolerance >= 0}], default_proposal_method, verifier {name_or_path,
  architectures}}; weights `fusion_fc.weight` [D, 2D] (+ `.bias` iff fusion_bias), `transformer.*`
  (a decoder layer whose input_layernorm is an identity when layernorms is false), embed_tokens and
  lm_head never saved. The EAGLE-1 model was kept through v0.6.0.1 and removed by #672 (bcdc38af).
- EAGLE-3: `src/speculators/models/eagle3.py` @ 03a7c1497cdbb0cf6a3cdffc86aead090034c285 and
  `models/eagle3/config.py` @ 11ecdd3385ed00258b89b0de8b55a0074ced9ec4 (Eagle3SpeculatorConfig:
  `speculators_model_type: "eagle3"`, architectures ["Eagle3Speculator"], `transformer_layer_config`,
  `draft_vocab_size`, `norm_before_residual` (default false there), `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`); weights `fc`, `layers.0.*` (Eagle3DecoderLayer: embeds first),
  `norm`, `lm_head`, buffers `d2t` [Vd] int64 offsets (map_draft_to_target_tokens: t + d2t[t]) and
  `t2d` [V] bool.

Reference repos
- SafeAILab/EAGLE EAGLE-3 `eagle/model/cnets.py` @ 148042c5fed07822194a49b027c897c9c5494b0e (Model):
  `midlayer` (LlamaDecoderLayeremb: hidden_norm, input_layernorm, cat((input_emb, hidden)), residual
  the un-normed hidden), `fc` [D, 3 * (target_hidden_size or D)] without bias, `norm`, `lm_head`
  [draft_vocab_size, D], `d2t` int64 [Vd] and `t2d` bool [V] buffers; the config is a Llama config
  with `draft_vocab_size`; the target taps the inputs of layers 2, L // 2 and L - 3
  (modeling_llama_kv.py). This is the layout SGLang reads.
- SafeAILab/EAGLE (EAGLE-1/2, `eagle/model/cnets1.py`, `ea_model.py`): a Llama config with
  num_hidden_layers 1 and "bias" (fc bias, default true), `fc.*`, `layers.0.*`, optional
  `embed_tokens.weight` (current ea_model loads it from the base model and loads the head with
  strict=False); see specdec.train.eagle.
- FasterDecoding/Medusa `medusa/model/medusa_model.py` @ 60eeab92e98adb0e787987493b11fa38535a8260:
  MedusaConfig {medusa_num_heads, medusa_num_layers, base_model_name_or_path}; `medusa_head` =
  ModuleList of Sequential(ResBlock x L, Linear(D, V, bias=False)), saved as
  `medusa_lm_head.safetensors` (`{k}.{l}.linear.weight/bias`, `{k}.{L}.weight`).
- A plain Hugging Face Llama folder (transformers' LlamaForCausalLM names) for a draft model: vLLM's
  draft-model speculation and SGLang's STANDALONE algorithm load it like any model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specdec.errors import UserError
from specdec.models.checkpoint import read_config

D2T_FILE = "hot_token_ids.pt"  # torch.save'd list of target ids (SGLang: --speculative-token-map FILE)
REFERENCE_D2T = "draft_vocab.safetensors"  # specdec.train.eagle.export_reference's d2t sidecar
MANIFEST = "specdec_export.json"  # what specdec export wrote; no runtime reads it

KINDS = ("eagle", "eagle3", "medusa", "draft_model")
LAYOUTS = {
    "eagle": ("vllm", "sglang", "speculators", "reference"),
    "eagle3": ("vllm", "sglang", "speculators"),  # vllm = the speculators folder (what vLLM's docs load)
    "medusa": ("vllm", "medusa"),
    "draft_model": ("hf", "vllm", "sglang"),  # the same plain HF folder for all three
}
FLOAT_DTYPES = ("F16", "BF16", "F32")
INT_DTYPES = ("I64", "I32")
ANY = object()


@dataclass(frozen=True)
class Key:
    """A config.json entry: dotted path, accepted types, required or not, a required value (ANY: any)."""

    path: str
    types: tuple[type, ...]
    required: bool = True
    value: object = ANY


@dataclass(frozen=True)
class Spec:
    """A tensor the loader reads: its shape and whether it holds integers (ids) or floats, or the one
    safetensors dtype it must have (`dtype`, e.g. "I64", "BOOL")."""

    shape: tuple[int, ...]
    integer: bool = False
    required: bool = True
    dtype: str | None = None


@dataclass(frozen=True)
class Schema:
    kind: str
    layout: str
    runtime: str  # who loads it and how
    sources: tuple[str, ...]  # where the schema was read (see the module docstring)
    keys: tuple[Key, ...]
    weights: str  # the weights file
    tensors: Callable[[dict], dict[str, Spec]]  # the parsed config -> the tensors the loader reads
    reads_every_safetensors: bool  # the runtime loads every *.safetensors file of the folder
    d2t: str | None = None  # the sidecar holding the draft vocabulary, if the layout has one
    config_check: Callable[[dict], list[str]] | None = None
    notes: tuple[str, ...] = ()
    values_check: Callable[[Path, dict], list[str]] | None = None  # (weights file, config): a few small tensors' values


@dataclass
class Validation:
    schema: Schema
    folder: Path
    problems: list[str] = field(default_factory=list)
    tensors_checked: int = 0
    keys_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        s = self.schema
        return {"kind": s.kind, "layout": s.layout, "valid": self.ok, "problems": self.problems,
                "keys_checked": self.keys_checked, "tensors_checked": self.tensors_checked,
                "runtime": s.runtime, "sources": list(s.sources), "notes": list(s.notes)}


# ---- Llama pieces -------------------------------------------------------------------------------


def speculators_config_keys(algorithm: str) -> tuple[Key, ...]:
    """The `speculators_config` block every speculators-format config carries (algorithm, proposal methods,
    the verifier it drafts for)."""
    return (Key("speculators_config", (dict,)), Key("speculators_config.algorithm", (str,), value=algorithm),
            Key("speculators_config.proposal_methods", (list,)), Key("speculators_config.default_proposal_method", (str,)),
            Key("speculators_config.verifier", (dict,)), Key("speculators_config.verifier.name_or_path", (str,)),
            Key("speculators_config.verifier.architectures", (list,)))


def llama_keys(prefix: str = "", one_layer: bool = True) -> tuple[Key, ...]:
    """The Llama config entries the loaders build a decoder layer from."""
    p = prefix
    return (
        Key(f"{p}model_type", (str,), value="llama"),
        Key(f"{p}hidden_size", (int,)),
        Key(f"{p}intermediate_size", (int,)),
        Key(f"{p}num_attention_heads", (int,)),
        Key(f"{p}num_key_value_heads", (int,), required=False),
        Key(f"{p}head_dim", (int,), required=False),
        Key(f"{p}num_hidden_layers", (int,), value=1 if one_layer else ANY),
        Key(f"{p}vocab_size", (int,)),
        Key(f"{p}rms_norm_eps", (float, int)),
        Key(f"{p}rope_theta", (float, int), required=False),
        Key(f"{p}max_position_embeddings", (int,), required=False),
        Key(f"{p}hidden_act", (str,), required=False, value="silu"),
        Key(f"{p}attention_bias", (bool,), required=False, value=False),
        Key(f"{p}mlp_bias", (bool,), required=False, value=False),
    )


def llama_dims(c: dict) -> dict[str, int]:
    D, H = c["hidden_size"], c["num_attention_heads"]
    return {"D": D, "H": H, "Hkv": c.get("num_key_value_heads") or H, "Dh": c.get("head_dim") or D // H,
            "I": c["intermediate_size"], "V": c["vocab_size"], "L": c.get("num_hidden_layers", 1)}


def decoder_layer(prefix: str, c: dict, input_norm: bool) -> dict[str, Spec]:
    """A Llama decoder layer's tensors under `prefix` (transformers' names)."""
    d = llama_dims(c)
    D, q, kv, inner = d["D"], d["H"] * d["Dh"], d["Hkv"] * d["Dh"], d["I"]
    layer = {
        "self_attn.q_proj.weight": Spec((q, D)), "self_attn.k_proj.weight": Spec((kv, D)),
        "self_attn.v_proj.weight": Spec((kv, D)), "self_attn.o_proj.weight": Spec((D, q)),
        "mlp.gate_proj.weight": Spec((inner, D)), "mlp.up_proj.weight": Spec((inner, D)),
        "mlp.down_proj.weight": Spec((D, inner)), "post_attention_layernorm.weight": Spec((D,)),
    }
    if input_norm:
        layer["input_layernorm.weight"] = Spec((D,))
    return {prefix + name: spec for name, spec in layer.items()}


def parses_as_config(d: dict, where: str) -> list[str]:
    """transformers' AutoConfig.for_model(**d): what vLLM's EAGLEConfig and speculators do with the dict."""
    from transformers import AutoConfig

    try:
        AutoConfig.for_model(**d)
    except Exception as e:  # noqa: BLE001 - any failure to parse is the finding
        return [f"{where}: transformers cannot build a config from it ({type(e).__name__}: {e})"]
    return []


# ---- EAGLE ---------------------------------------------------------------------------------------


def eagle_vllm_tensors(c: dict) -> dict[str, Spec]:
    m = c["model"]
    D = m["hidden_size"]
    return {"fc.weight": Spec((D, 2 * D)), **decoder_layer("layers.0.", m, input_norm=False)}


def eagle_vllm_check(c: dict) -> list[str]:
    m = c["model"]
    archs = m.get("architectures") or []
    eagle = [a if a.startswith("Eagle") else f"Eagle{a}" for a in archs]  # EAGLEConfig, method "eagle"
    problems = [] if eagle == ["EagleLlamaForCausalLM"] else [
        f"model.architectures {archs} resolve to {eagle} in vLLM's EAGLEConfig; the EAGLE-1 Llama head is "
        "EagleLlamaForCausalLM (model.architectures [\"LlamaForCausalLM\"])"]
    shared = sorted(k for k in c if k not in ("model_type", "model", "architectures", "truncated_vocab_size")
                    and k in m)
    if shared:
        problems.append(f"top-level keys {shared} would overwrite model.* in vLLM's EAGLEConfig")
    tv = c.get("truncated_vocab_size")
    if tv is not None and tv != m["vocab_size"]:
        problems.append(f"truncated_vocab_size {tv} != model.vocab_size {m['vocab_size']}: vLLM's EAGLE-1 head "
                        "reads out over the target's whole LM head")
    return problems + parses_as_config(m, "model")


def eagle_sglang_tensors(c: dict) -> dict[str, Spec]:
    D, V = c["hidden_size"], c["vocab_size"]
    return {"fc.weight": Spec((D, 2 * D)), "fc.bias": Spec((D,)), **decoder_layer("layers.0.", c, input_norm=False),
            "embed_tokens.weight": Spec((V, D), required=False)}


def eagle_sglang_check(c: dict) -> list[str]:
    return parses_as_config(c, "config.json")


def eagle_speculators_tensors(c: dict) -> dict[str, Spec]:
    t = c["transformer_layer_config"]
    D = t["hidden_size"]
    out = {"fusion_fc.weight": Spec((D, 2 * D)), **decoder_layer("transformer.", t, input_norm=False)}
    if c.get("fusion_bias"):
        out["fusion_fc.bias"] = Spec((D,))
    return out


def eagle_speculators_check(c: dict) -> list[str]:
    problems = proposal_problems(c["speculators_config"])
    if "EagleSpeculator" not in c["architectures"]:
        problems.append(f"architectures {c['architectures']} lack 'EagleSpeculator'")
    return problems + parses_as_config(c["transformer_layer_config"], "transformer_layer_config")


def proposal_problems(s: dict) -> list[str]:
    """speculators_config's proposal methods as speculators validates them (vLLM reads the first's
    speculative_tokens)."""
    problems = []
    methods = s["proposal_methods"]
    if not methods:
        problems.append("speculators_config.proposal_methods is empty (vLLM and speculators read the first)")
    types = []
    for i, m in enumerate(methods):
        where = f"speculators_config.proposal_methods[{i}]"
        if not isinstance(m, dict):
            problems.append(f"{where} is not an object")
            continue
        types.append(m.get("proposal_type"))
        if m.get("proposal_type") != "greedy":
            problems.append(f"{where}.proposal_type {m.get('proposal_type')!r}: speculators registers 'greedy'")
        for key, low, kinds in (("speculative_tokens", 1, (int,)), ("verifier_accept_k", 1, (int,)),
                                ("accept_tolerance", 0, (float, int))):
            v = m.get(key)
            if v is None and key != "speculative_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, kinds) or v < low:
                problems.append(f"{where}.{key} must be a number >= {low}, got {v!r}")
    if s["default_proposal_method"] not in types:
        problems.append(f"speculators_config.default_proposal_method {s['default_proposal_method']!r} names no "
                        f"proposal method ({types})")
    return problems


def eagle_reference_tensors(c: dict) -> dict[str, Spec]:
    D, V = c["hidden_size"], c["vocab_size"]
    out = {"fc.weight": Spec((D, 2 * D)), **decoder_layer("layers.0.", c, input_norm=False),
           "embed_tokens.weight": Spec((V, D), required=False)}
    if c.get("bias", True):
        out["fc.bias"] = Spec((D,))
    return out


# ---- EAGLE-3 -------------------------------------------------------------------------------------

EAGLE3_TAPS = 3  # vLLM's and SGLang's fc reads exactly three target layers (3 * target_hidden_size inputs)


def eagle3_tensors(layer_prefix: str, layer: dict, draft_vocab_size: int, target_hidden_size: int | None) -> dict[str, Spec]:
    """An EAGLE-3 head's tensors: fc, the decoder layer under `layer_prefix` (q/k/v 2D wide, hidden_norm
    beside input_layernorm), norm, the draft-vocabulary LM head, d2t offsets and the t2d mask."""
    d = llama_dims(layer)
    D, V, q, kv = d["D"], d["V"], d["H"] * d["Dh"], d["Hkv"] * d["Dh"]
    out = {"fc.weight": Spec((D, EAGLE3_TAPS * (target_hidden_size or D))), **decoder_layer(layer_prefix, layer, input_norm=True)}
    out.update({f"{layer_prefix}self_attn.q_proj.weight": Spec((q, 2 * D)),  # [input_layernorm(embedding) ; hidden_norm(h)]
                f"{layer_prefix}self_attn.k_proj.weight": Spec((kv, 2 * D)),
                f"{layer_prefix}self_attn.v_proj.weight": Spec((kv, 2 * D)),
                f"{layer_prefix}hidden_norm.weight": Spec((D,)),
                "norm.weight": Spec((D,)), "lm_head.weight": Spec((draft_vocab_size, D)),
                "d2t": Spec((draft_vocab_size,), dtype="I64"), "t2d": Spec((V,), dtype="BOOL", required=False),
                "embed_tokens.weight": Spec((V, D), required=False)})
    return out


def eagle3_speculators_tensors(c: dict) -> dict[str, Spec]:
    return eagle3_tensors("layers.0.", c["transformer_layer_config"], c["draft_vocab_size"], c.get("target_hidden_size"))


def eagle3_sglang_tensors(c: dict) -> dict[str, Spec]:
    return eagle3_tensors("midlayer.", c, c["draft_vocab_size"], c.get("target_hidden_size"))


def tap_problems(ids: object, where: str, lowest: int) -> list[str]:
    """Tapped-layer ids as vLLM and SGLang use them: three, in increasing order (both concatenate the taps
    in layer order, and a repeated id is tapped once), none below `lowest`."""
    if not isinstance(ids, list) or len(ids) != EAGLE3_TAPS or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        return [f"{where} must be a list of {EAGLE3_TAPS} layer ids (the fc reads three target layers), got {ids!r}"]
    if ids != sorted(set(ids)):
        return [f"{where} {ids} must increase: vLLM and SGLang concatenate the tapped layers in layer order"]
    if ids[0] < lowest:
        return [f"{where} {ids}: ids below {lowest} are not tapped as specdec taps them"]
    return []


def draft_vocab_problems(draft_vocab_size: int, vocab_size: int) -> list[str]:
    if not 0 < draft_vocab_size <= vocab_size:
        return [f"draft_vocab_size {draft_vocab_size} must be in 1..vocab_size ({vocab_size})"]
    return []


def eagle3_speculators_check(c: dict) -> list[str]:
    t = c["transformer_layer_config"]
    problems = proposal_problems(c["speculators_config"]) + draft_vocab_problems(c["draft_vocab_size"], t["vocab_size"])
    if "Eagle3Speculator" not in c["architectures"]:
        problems.append(f"architectures {c['architectures']} lack 'Eagle3Speculator'")
    if c.get("eagle_aux_hidden_state_layer_ids") is not None:  # vLLM: the input of layer id (idx 0 has no residual yet)
        problems += tap_problems(c["eagle_aux_hidden_state_layer_ids"], "eagle_aux_hidden_state_layer_ids", 1)
    return problems + parses_as_config(t, "transformer_layer_config")


def eagle3_sglang_check(c: dict) -> list[str]:
    problems = draft_vocab_problems(c["draft_vocab_size"], c["vocab_size"])
    ids = lookup(c, "eagle_config.eagle_aux_hidden_state_layer_ids")
    if ids is not ANY and ids is not None:  # SGLang: the output of layer id (the input of id + 1)
        problems += tap_problems(ids, "eagle_config.eagle_aux_hidden_state_layer_ids", 0)
    return problems + parses_as_config(c, "config.json")


def eagle3_vocab_check(weights: Path, config: dict) -> list[str]:
    """d2t holds offsets (draft index i reads out target id i + d2t[i]: vLLM compute_logits, SGLang
    hot_token_id, speculators map_draft_to_target_tokens): the ids must lie in the vocabulary, once each,
    and t2d (where present) must mark exactly them."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        d2t = f.get_tensor("d2t")
        t2d = f.get_tensor("t2d") if "t2d" in f.keys() else None  # [V] bool
    ids, V = d2t + torch.arange(len(d2t)), vocab_size_of(config)  # [Vd] target ids
    problems = []
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= V):
        problems.append(f"{weights.name}: d2t offsets give target ids outside 0..{V - 1} (d2t holds id - index)")
    if len(torch.unique(ids)) != len(ids):
        problems.append(f"{weights.name}: d2t maps two draft indices to one target id")
    if not problems and t2d is not None:
        expected = torch.zeros(len(t2d), dtype=torch.bool)
        expected[ids] = True
        if not torch.equal(t2d, expected):
            problems.append(f"{weights.name}: t2d does not mark exactly the target ids d2t reaches")
    return problems


# ---- Medusa --------------------------------------------------------------------------------------


def medusa_vllm_tensors(c: dict) -> dict[str, Spec]:
    K, L, D, V = c["num_heads"], c.get("num_hidden_layers", 1), c["hidden_size"], c["vocab_size"]
    Vd = c.get("truncated_vocab_size") or V
    out = {}
    for k in range(K):
        for l in range(L):
            out[f"blocks.{k}.layers.{l}.weight"] = Spec((D, D))
            if c.get("medusa_fc_bias"):
                out[f"blocks.{k}.layers.{l}.bias"] = Spec((D,))
    heads = [0] if c.get("original_lm_head") else range(K)
    for k in heads:
        out[f"lm_heads.{k}.weight"] = Spec((Vd, D))  # rows already at token_map (or all V, sliced on load)
    if Vd < V:
        out["token_map"] = Spec((Vd,), integer=True)
    return out


def medusa_vllm_check(c: dict) -> list[str]:
    V, Vd = c["vocab_size"], c.get("truncated_vocab_size") or c["vocab_size"]
    renamed = sorted(k for k in c if "num" in k and ("heads" in k or "layers" in k)
                     and k not in ("num_heads", "num_hidden_layers"))
    problems = []
    if renamed:
        problems.append(f"keys {renamed} would be renamed to num_heads / num_hidden_layers by vLLM's MedusaConfig")
    if not 0 < Vd <= V:
        problems.append(f"truncated_vocab_size {Vd} must be in 1..vocab_size ({V})")
    return problems


def medusa_reference_tensors(c: dict) -> dict[str, Spec]:
    K, L = c["medusa_num_heads"], c.get("medusa_num_layers", 1)
    D, V = c["hidden_size"], c["vocab_size"]
    out = {}
    for k in range(K):
        for l in range(L):
            out[f"{k}.{l}.linear.weight"] = Spec((D, D))
            out[f"{k}.{l}.linear.bias"] = Spec((D,))
        out[f"{k}.{L}.weight"] = Spec((V, D))
    return out


# ---- draft model (plain HF Llama) ----------------------------------------------------------------


def hf_llama_tensors(c: dict) -> dict[str, Spec]:
    d = llama_dims(c)
    out = {"model.embed_tokens.weight": Spec((d["V"], d["D"])), "model.norm.weight": Spec((d["D"],))}
    for i in range(d["L"]):
        out.update(decoder_layer(f"model.layers.{i}.", c, input_norm=True))
    if not c.get("tie_word_embeddings", True):  # LlamaConfig's default is false, our export always says
        out["lm_head.weight"] = Spec((d["V"], d["D"]))
    return out


def hf_llama_check(c: dict) -> list[str]:
    return parses_as_config(c, "config.json")


# ---- the schemas ---------------------------------------------------------------------------------

SCHEMAS: dict[tuple[str, str], Schema] = {}
SAME_FOLDER = {("draft_model", "vllm"): "hf", ("draft_model", "sglang"): "hf",  # layouts that write another's folder
               ("eagle3", "vllm"): "speculators"}


def register(schema: Schema) -> None:
    SCHEMAS[(schema.kind, schema.layout)] = schema


register(Schema(
    "eagle", "vllm",
    "vLLM EagleLlamaForCausalLM (speculative method 'eagle'); embeddings and LM head shared with the target",
    ("vllm/transformers_utils/configs/eagle.py@23c5aa92", "vllm/model_executor/models/llama_eagle.py@e1c4a552",
     "vllm/model_executor/model_loader/default_loader.py (_prepare_weights)"),
    keys=(Key("model_type", (str,), value="eagle"), Key("model", (dict,)),
          Key("model.architectures", (list,), value=["LlamaForCausalLM"]),
          Key("model.tie_word_embeddings", (bool,), required=False, value=False),
          Key("truncated_vocab_size", (int,), required=False), *llama_keys("model.")),
    weights="model.safetensors", tensors=eagle_vllm_tensors, reads_every_safetensors=True, d2t=D2T_FILE,
    config_check=eagle_vllm_check,
    notes=("vLLM's EAGLE-1 head reads out over the target's full vocabulary (no d2t): still lossless, but where a "
           "token outside the draft vocabulary outranks every one inside it, vLLM drafts it and specdec does not",
           f"{D2T_FILE} (the draft vocabulary) is for specdec's import; vLLM never reads a .pt beside safetensors")))

register(Schema(
    "eagle", "sglang",
    "SGLang LlamaForCausalLMEagle (--speculative-algorithm EAGLE); embeddings and LM head rows from the target",
    ("python/sglang/srt/models/llama_eagle.py@3b64d5de", "python/sglang/srt/models/llama.py@bf7a0e23",
     "python/sglang/srt/speculative/eagle_worker.py (load_token_map, hot_token_id)"),
    keys=(Key("architectures", (list,), value=["LlamaForCausalLMEagle"]),
          Key("tie_word_embeddings", (bool,), value=False), *llama_keys()),
    weights="model.safetensors", tensors=eagle_sglang_tensors, reads_every_safetensors=True, d2t=D2T_FILE,
    config_check=eagle_sglang_check,
    notes=(f"pass --speculative-token-map DIR/{D2T_FILE}: the draft then reads out over exactly specdec's draft "
           "vocabulary (SGLang's hot_token_id is specdec's d2t)",)))

register(Schema(
    "eagle", "speculators",
    "the speculators library's EagleSpeculator (v0.3.0 .. v0.6.0.1); NOT vLLM: its speculators reader "
    "registers eagle3 (later peagle, dflash) only",
    ("vllm-project/speculators@v0.3.0 src/speculators/models/eagle.py, config.py, proposals/greedy.py",
     "vllm/transformers_utils/configs/speculators/base.py@94699746, algos.py@cfb173ab"),
    keys=(Key("speculators_model_type", (str,), value="eagle"), Key("speculators_version", (str,)),
          Key("architectures", (list,)), Key("transformer_layer_architecture", (str,), required=False),
          Key("transformer_layer_config", (dict,)), *llama_keys("transformer_layer_config."),
          Key("layernorms", (bool,), value=False), Key("fusion_bias", (bool,)),
          *speculators_config_keys("eagle")),
    weights="model.safetensors", tensors=eagle_speculators_tensors, reads_every_safetensors=False, d2t=D2T_FILE,
    config_check=eagle_speculators_check,
    notes=("speculators removed its EAGLE-1 model after v0.6.0.1 (#672) and vLLM loads speculators eagle3 "
           "checkpoints only: this layout documents the head in speculators' terms; an EAGLE-3 head is a "
           "different network (normed inputs, 3-layer features): `specdec export eagle3` writes one",)))

register(Schema(
    "eagle", "reference",
    "SafeAILab/EAGLE (EAGLE-1/2, cnets1.Model); specdec.train.eagle.export_reference",
    ("SafeAILab/EAGLE eagle/model/cnets1.py, ea_model.py",),
    keys=(Key("architectures", (list,)), Key("bias", (bool,), required=False), *llama_keys()),
    weights="model.safetensors", tensors=eagle_reference_tensors, reads_every_safetensors=False,
    d2t=REFERENCE_D2T, config_check=eagle_sglang_check,
    notes=(f"{REFERENCE_D2T} is a second safetensors file: vLLM and SGLang read every *.safetensors file of a "
           "folder (vLLM then fails on 'd2t'), so give them the vllm / sglang layouts, not this one",)))

register(Schema(
    "eagle3", "speculators",
    "vLLM Eagle3LlamaForCausalLM (speculators format: --speculative-config '{\"method\": \"eagle3\", ...}') and the "
    "speculators library's Eagle3Speculator; embeddings shared with the target",
    ("vllm/model_executor/models/llama_eagle3.py@00bd1493", "vllm/transformers_utils/configs/speculators/algos.py "
     "(update_eagle3), base.py@052316ae", "vllm/model_executor/models/llama.py (aux_hidden_state_layers)",
     "vllm-project/speculators src/speculators/models/eagle3.py@03a7c149, models/eagle3/config.py@11ecdd33"),
    keys=(Key("speculators_model_type", (str,), value="eagle3"), Key("speculators_version", (str,), required=False),
          Key("architectures", (list,)), Key("transformer_layer_config", (dict,)), *llama_keys("transformer_layer_config."),
          Key("draft_vocab_size", (int,)), Key("norm_before_residual", (bool,), value=False),
          Key("norm_before_fc", (bool,), required=False, value=False), Key("target_hidden_size", (int,), required=False),
          Key("eagle_aux_hidden_state_layer_ids", (list,), required=False),
          *speculators_config_keys("eagle3")),
    weights="model.safetensors", tensors=eagle3_speculators_tensors, reads_every_safetensors=True,
    config_check=eagle3_speculators_check, values_check=eagle3_vocab_check,
    notes=("norm_before_residual must be written: vLLM's speculators reader defaults it to true, speculators to "
           "false; specdec's head adds the attention output to h itself (false)",
           "eagle_aux_hidden_state_layer_ids are the layers whose INPUT vLLM taps (HF hidden_states[id]), as "
           "specdec's feature_layers; without them vLLM taps (2, L // 2, L - 3)")))

register(Schema(
    "eagle3", "sglang",
    "SGLang LlamaForCausalLMEagle3 (--speculative-algorithm EAGLE3), in SafeAILab/EAGLE's EAGLE-3 names, which vLLM "
    "also loads (method eagle3; midlayer. -> layers.0.); embeddings from the target",
    ("python/sglang/srt/models/llama_eagle3.py@03d5a777", "python/sglang/srt/models/llama.py "
     "(set_eagle3_layers_to_capture)", "SafeAILab/EAGLE eagle/model/cnets.py@148042c5",
     "vllm/model_executor/models/llama_eagle3.py@00bd1493"),
    keys=(Key("architectures", (list,), value=["LlamaForCausalLMEagle3"]),
          Key("tie_word_embeddings", (bool,), value=False), *llama_keys(), Key("draft_vocab_size", (int,)),
          Key("bias", (bool,), required=False, value=False), Key("norm_before_residual", (bool,), required=False, value=False),
          Key("target_hidden_size", (int,), required=False), Key("eagle_config", (dict,), required=False),
          Key("eagle_config.eagle_aux_hidden_state_layer_ids", (list,), required=False)),
    weights="model.safetensors", tensors=eagle3_sglang_tensors, reads_every_safetensors=True,
    config_check=eagle3_sglang_check, values_check=eagle3_vocab_check,
    notes=("SGLang reads eagle_config.eagle_aux_hidden_state_layer_ids as layer OUTPUTS (it taps the input of id + "
           "1); specdec writes them only for non-default taps, since vLLM versions that read that nested key take "
           "it as layer inputs: for non-default taps in vLLM use the vllm (speculators) layout",)))

register(Schema(
    "medusa", "vllm",
    "vLLM Medusa (speculative method 'medusa'), with its own LM head rows and token_map",
    ("vllm/model_executor/models/medusa.py@09cddad8", "vllm/transformers_utils/configs/medusa.py@4bb77b32"),
    keys=(Key("model_type", (str,), value="medusa"), Key("num_heads", (int,)), Key("num_hidden_layers", (int,)),
          Key("hidden_size", (int,)), Key("vocab_size", (int,)), Key("truncated_vocab_size", (int,), required=False),
          Key("medusa_fc_bias", (bool,), value=True), Key("original_lm_head", (bool,), required=False)),
    weights="model.safetensors", tensors=medusa_vllm_tensors, reads_every_safetensors=True,
    config_check=medusa_vllm_check,
    notes=("vLLM's Medusa proposes each head's top-1 token (a chain, no tree)",)))

register(Schema(
    "medusa", "medusa",
    "FasterDecoding/Medusa MedusaModel (full-vocabulary heads)",
    ("FasterDecoding/Medusa medusa/model/medusa_model.py@60eeab92",),
    keys=(Key("medusa_num_heads", (int,)), Key("medusa_num_layers", (int,)), Key("base_model_name_or_path", (str,)),
          Key("hidden_size", (int,)), Key("vocab_size", (int,))),
    weights="medusa_lm_head.safetensors", tensors=medusa_reference_tensors, reads_every_safetensors=False,
    notes=("the reference heads read out over all V tokens (K copies of the LM head), so they may pick a token "
           "outside specdec's draft vocabulary",)))

register(Schema(
    "draft_model", "hf",
    "a Hugging Face LlamaForCausalLM folder: vLLM draft-model speculation, SGLang --speculative-algorithm "
    "STANDALONE, transformers assisted generation",
    ("transformers LlamaForCausalLM (modeling_llama) names", "vllm/model_executor/models/llama.py load_weights"),
    keys=(Key("architectures", (list,), value=["LlamaForCausalLM"]), Key("tie_word_embeddings", (bool,)),
          *llama_keys(one_layer=False)),
    weights="model.safetensors", tensors=hf_llama_tensors, reads_every_safetensors=True, d2t=D2T_FILE,
    config_check=hf_llama_check,
    notes=("the folder carries the target's embeddings (and LM head unless tied): runtimes read out over the full "
           f"vocabulary; {D2T_FILE} records specdec's draft vocabulary",)))


def schema_for(kind: str, layout: str) -> Schema:
    if kind not in KINDS:
        raise UserError(f"unknown drafter {kind!r}; export takes {', '.join(KINDS)}")
    if layout not in LAYOUTS[kind]:
        raise UserError(f"layout {layout!r} does not take {kind} drafters; choose {', '.join(LAYOUTS[kind])}"
                        + (" (SGLang has no Medusa algorithm; speculators has no Medusa model)" if kind == "medusa" else ""))
    return SCHEMAS[(kind, SAME_FOLDER.get((kind, layout), layout))]


# ---- validation ----------------------------------------------------------------------------------


def lookup(d: dict, path: str):
    node = d
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return ANY
        node = node[part]
    return node


def check_keys(config: dict, keys: tuple[Key, ...]) -> list[str]:
    problems, missing = [], []
    for key in keys:
        if any(key.path.startswith(m + ".") for m in missing):
            continue  # its parent is missing or not an object: said once
        v = lookup(config, key.path)
        if v is ANY:
            if key.required:
                problems.append(f"config.json: missing {key.path}")
            missing.append(key.path)
            continue
        if v is None and not key.required:
            continue
        if isinstance(v, bool) and bool not in key.types or not isinstance(v, key.types):
            names = "/".join(t.__name__ for t in key.types)
            problems.append(f"config.json: {key.path} is {type(v).__name__} {v!r}, expected {names}")
            missing.append(key.path)
        elif key.value is not ANY and v != key.value:
            problems.append(f"config.json: {key.path} is {v!r}, expected {key.value!r}")
    return problems


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) from the file's header, without reading the tensors."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            part = f.get_slice(name)
            out[name] = (tuple(part.get_shape()), part.get_dtype())
    return out


def check_tensors(header: dict, expected: dict[str, Spec], weights: str) -> list[str]:
    problems = []
    for name, spec in expected.items():
        if name not in header:
            if spec.required:
                problems.append(f"{weights}: missing {name} {list(spec.shape)}")
            continue
        shape, dtype = header[name]
        if shape != spec.shape:
            problems.append(f"{weights}: {name} has shape {list(shape)}, expected {list(spec.shape)}")
        wanted = (spec.dtype,) if spec.dtype else INT_DTYPES if spec.integer else FLOAT_DTYPES
        if dtype not in wanted:
            problems.append(f"{weights}: {name} is {dtype}, expected one of {', '.join(wanted)}")
    unexpected = sorted(set(header) - set(expected))
    if unexpected:
        more = f" (+{len(unexpected) - 4} more)" if len(unexpected) > 4 else ""
        problems.append(f"{weights}: tensors the loader has no parameter for: {', '.join(unexpected[:4])}{more}")
    return problems


def read_d2t(path: Path) -> torch.Tensor:
    """The draft vocabulary from a sidecar: hot_token_ids.pt (a torch.save'd list or tensor of ids) or
    draft_vocab.safetensors ({"d2t": ...})."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            ids = load_file(str(path))["d2t"]
        else:
            ids = torch.load(path, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(ids)
    except Exception as e:  # noqa: BLE001 - an unreadable sidecar is a user-facing finding
        raise UserError(f"{path}: not a draft-vocabulary file ({type(e).__name__}: {e})") from None
    if ids.ndim != 1 or ids.is_floating_point():
        raise UserError(f"{path}: the draft vocabulary must be a 1-D list of token ids")
    return ids.long()


def check_d2t(path: Path, vocab_size: int) -> list[str]:
    try:
        ids = read_d2t(path)
    except UserError as e:
        return [str(e)]
    problems = []
    if len(ids) == 0 or len(ids) > vocab_size:
        problems.append(f"{path.name}: {len(ids)} ids for a vocabulary of {vocab_size}")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        problems.append(f"{path.name}: ids outside 0..{vocab_size - 1}")
    if len(torch.unique(ids)) != len(ids):
        problems.append(f"{path.name}: repeated ids")
    return problems


def vocab_size_of(config: dict) -> int | None:
    for path in ("model.vocab_size", "transformer_layer_config.vocab_size", "vocab_size"):
        v = lookup(config, path)
        if isinstance(v, int):
            return v
    return None


def validate(folder: str | Path, kind: str, layout: str) -> Validation:
    """Check `folder` against the (kind, layout) schema: config keys and types, the weights' names,
    shapes and dtypes, stray safetensors files, the d2t sidecar. Reads headers only."""
    schema = schema_for(kind, layout)
    folder = Path(folder)
    result = Validation(schema, folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        result.problems.append(f"{folder}: no config.json")
        return result
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        result.problems.append(f"config.json: not JSON ({e.msg}, line {e.lineno})")
        return result
    if not isinstance(config, dict):
        result.problems.append("config.json: not a JSON object")
        return result
    result.problems += check_keys(config, schema.keys)
    result.keys_checked = len(schema.keys)
    if result.problems:
        return result  # the tensor shapes derive from these keys
    if schema.config_check is not None:
        result.problems += schema.config_check(config)
    weights = folder / schema.weights
    if not weights.is_file():
        result.problems.append(f"{folder}: no {schema.weights}")
    else:
        expected = schema.tensors(config)
        tensor_problems = check_tensors(read_header(weights), expected, schema.weights)
        result.problems += tensor_problems
        result.tensors_checked = len(expected)
        if schema.values_check is not None and not tensor_problems:
            result.problems += schema.values_check(weights, config)
    if schema.reads_every_safetensors:
        stray = sorted(p.name for p in folder.glob("*.safetensors") if p.name != schema.weights)
        if stray:
            result.problems.append(f"{', '.join(stray)}: {schema.runtime.split(' (')[0]} reads every *.safetensors file "
                                   "of the folder and has no parameter for these")
    if schema.d2t is not None and (folder / schema.d2t).exists():
        V = vocab_size_of(config)
        if V is not None:
            result.problems += check_d2t(folder / schema.d2t, V)
    return result


def detect(folder: str | Path) -> tuple[str, str]:
    """(kind, layout) of an exported folder: from specdec's manifest, else from config.json's telltales."""
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        try:
            m = json.loads((folder / MANIFEST).read_text())
            if m.get("kind") in KINDS and m.get("layout") in LAYOUTS[m["kind"]]:
                return m["kind"], m["layout"]
        except (json.JSONDecodeError, AttributeError):
            pass
    c = read_config(folder, "a drafter folder")
    archs = c.get("architectures") or []
    if c.get("speculators_model_type") == "eagle3":
        return "eagle3", "speculators"
    if "speculators_model_type" in c:
        return "eagle", "speculators"
    if archs[:1] == ["LlamaForCausalLMEagle3"]:
        return "eagle3", "sglang"
    if c.get("model_type") == "eagle":
        return "eagle", "vllm"
    if c.get("model_type") == "medusa":
        return "medusa", "vllm"
    if "medusa_num_heads" in c or (folder / "medusa_lm_head.safetensors").exists():
        return "medusa", "medusa"
    if archs[:1] == ["LlamaForCausalLMEagle"]:
        return "eagle", "sglang"
    if c.get("num_hidden_layers") == 1 and (folder / "model.safetensors").is_file() \
            and "fc.weight" in read_header(folder / "model.safetensors"):
        return "eagle", "reference"
    if archs[:1] == ["LlamaForCausalLM"]:
        return "draft_model", "hf"
    raise UserError(f"{folder}: cannot tell which layout this is; pass --layout (and the drafter kind)")

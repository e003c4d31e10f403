"""A GGUF target run in its own quantised formats on the CPU: Q4_0, Q4_1 and Q8_0 tensors go straight
into specdec's C kernels as block panels (cpu_quant.py), never dequantised; the model that decoding
preserves is this quantised one.

Tensors of other types are dequantised to floats at load, and the loader says which, once: F32 / F16 /
BF16 (norms, and some files' embeddings) and the k-quants (Q4_K, Q6_K, ...), for which there is no
native kernel yet. The config and tokenizer come from the cached folder `loading.gguf_folder` writes
(transformers' GGUF metadata reader); the weights from the file itself, through gguf's reader
(memory-mapped: the repacking copies each tensor once).

llama.cpp's converter reorders the rows of q and k of "llama" GGUF files (each head's two rotary halves
interleaved); they are put back in the order of the Hugging Face checkpoints, which is what the native
model's RoPE expects (transformers' GGUF loader does the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from specdec.errors import UserError, first_line
from specdec.models import cpu_gemm, cpu_quant
from specdec.models.kernels import say_once
from specdec.models.linear import Linear
from specdec.models.llama import LlamaModel, ModelConfig

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class GGUFTensor:
    name: str
    qtype: str  # GGUF's type name: "Q4_1", "F32", ...
    data: np.ndarray  # as stored: uint8 rows [N, bytes] for block types, else floats [N, K] or [K]
    tensor_type: object  # gguf.GGMLQuantizationType

    def floats(self) -> Tensor:
        """The tensor as float32 (dequantised where it is quantised, and BF16's raw bits: bitwise gguf's reference)."""
        if self.qtype in ("F32", "F16"):
            return torch.from_numpy(np.asarray(self.data, dtype=np.float32).copy())
        from gguf import quants

        return torch.from_numpy(quants.dequantize(np.asarray(self.data), self.tensor_type))

    def rows(self) -> Tensor:
        """A block tensor's raw rows, uint8 [N, bytes]."""
        return torch.from_numpy(np.array(self.data))  # a copy: the reader maps the file read-only


def read_gguf(path: Path) -> tuple[str, dict[str, GGUFTensor]]:
    """(architecture, tensors by name) of a GGUF file; UserError for an unreadable one."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        tensors = {t.name: GGUFTensor(t.name, t.tensor_type.name, t.data, t.tensor_type) for t in reader.tensors}
    except ImportError as e:
        raise UserError(f"reading {path.name} needs the gguf package (pip install gguf): {first_line(e)}") from None
    except Exception as e:  # a truncated or foreign file fails anywhere in the reader
        raise UserError(f"{path} is not a readable GGUF model ({type(e).__name__}: {first_line(e)})") from None
    return arch, tensors


def unpermute(rows: Tensor, n_head: int) -> Tensor:
    """q or k rows [N, ...] as llama.cpp's converter stores them -> the Hugging Face order."""
    return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def native_problem(arch: str, config: ModelConfig) -> str | None:
    """Why this GGUF cannot run natively quantised (None: it can)."""
    if not cpu_gemm.available():
        return f"the CPU kernels could not be built ({cpu_gemm.build_status()['error']})"
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        return f"GGUF architecture {arch!r}"
    if config.hidden_size % cpu_quant.QK or config.intermediate_size % cpu_quant.QK:
        return f"hidden or intermediate size not a multiple of {cpu_quant.QK}"
    return None


class Loader:
    """Fills a meta-device LlamaModel from GGUF tensors."""

    def __init__(self, arch: str, tensors: dict[str, GGUFTensor], config: ModelConfig, dtype: torch.dtype) -> None:
        self.arch, self.tensors, self.config, self.dtype = arch, tensors, config, dtype
        self.dequantised: dict[str, int] = {}  # non-native GGUF types turned into floats: count of tensors

    def get(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise UserError(f"tensor {name!r} is missing from the GGUF file")
        return self.tensors[name]

    def ordered(self, t: GGUFTensor, rows: Tensor) -> Tensor:
        """Rows of q / k back in Hugging Face order (llama-architecture files only)."""
        if self.arch != "llama" or not t.name.endswith(("attn_q.weight", "attn_k.weight")):
            return rows
        heads = self.config.num_heads if t.name.endswith("attn_q.weight") else self.config.num_kv_heads
        return unpermute(rows, heads)

    def fill_linear(self, linear: Linear, names: list[str]) -> None:
        """A Linear from GGUF tensors stacked along the output (q, k, v; gate, up): block panels where
        every part is one native block type, else float weights (packed later like any float layer)."""
        parts = [self.get(n) for n in names]
        qtypes = {t.qtype for t in parts}
        K = linear.in_features
        if len(qtypes) == 1 and (qtype := qtypes.pop()) in cpu_quant.FORMATS:
            raw = torch.cat([self.ordered(t, t.rows()) for t in parts])  # [N, K / 32 * block bytes]
            if raw.shape[0] != linear.out_features or raw.shape[1] * cpu_quant.QK != K * cpu_quant.FORMATS[qtype].gguf_bytes:
                raise UserError(f"{'+'.join(names)}: {raw.shape[0]} rows of {K} weights expected "
                                f"{linear.out_features} x {K}: the file does not match its config")
            linear.packed, linear.qtype = cpu_quant.pack_blocks(raw, qtype), qtype
            linear.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            return
        for t in parts:
            if t.qtype not in FLOAT_TYPES:
                self.dequantised[t.qtype] = self.dequantised.get(t.qtype, 0) + 1
        weight = torch.cat([self.ordered(t, t.floats().reshape(-1, K)) for t in parts])
        linear.weight = nn.Parameter(weight.to(self.dtype), requires_grad=False)

    def floats(self, name: str) -> Tensor:
        t = self.get(name)
        return self.ordered(t, t.floats()).to(self.dtype)

    def bias(self, linear: Linear, names: list[str]) -> None:
        if linear.bias is not None:
            linear.bias = nn.Parameter(torch.cat([self.floats(n).reshape(-1) for n in names]), requires_grad=False)
            if linear.qtype is not None:
                linear.packed_bias = cpu_gemm.pad_bias(linear.bias, linear.packed)


def load_gguf_native(path: Path, config_dict: dict, dtype: torch.dtype) -> LlamaModel:
    """The native model of a GGUF file with its Q4_0 / Q4_1 / Q8_0 tensors as block panels (CPU)."""
    config = ModelConfig.from_hf(config_dict)
    arch, tensors = read_gguf(path)
    problem = native_problem(arch, config)
    if problem:
        raise UserError(f"{path.name} cannot run in its quantised formats here: {problem}; use --gguf dequantize")
    load = Loader(arch, tensors, config, dtype)
    with torch.device("meta"):
        model = LlamaModel(config)
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [p + f"attn_{x}.weight" for x in "qkv"]
        load.fill_linear(attn.qkv_proj, qkv)
        load.bias(attn.qkv_proj, [n.replace(".weight", ".bias") for n in qkv])
        load.fill_linear(attn.o_proj, [p + "attn_output.weight"])
        load.bias(attn.o_proj, [p + "attn_output.bias"])
        load.fill_linear(mlp.gate_up_proj, [p + "ffn_gate.weight", p + "ffn_up.weight"])
        load.bias(mlp.gate_up_proj, [p + "ffn_gate.bias", p + "ffn_up.bias"])
        load.fill_linear(mlp.down_proj, [p + "ffn_down.weight"])
        load.bias(mlp.down_proj, [p + "ffn_down.bias"])
        layer.input_layernorm.weight = nn.Parameter(load.floats(p + "attn_norm.weight"), requires_grad=False)
        layer.post_attention_layernorm.weight = nn.Parameter(load.floats(p + "ffn_norm.weight"), requires_grad=False)
        if config.qk_norm:
            attn.q_norm.weight = nn.Parameter(load.floats(p + "attn_q_norm.weight"), requires_grad=False)
            attn.k_norm.weight = nn.Parameter(load.floats(p + "attn_k_norm.weight"), requires_grad=False)
    model.norm.weight = nn.Parameter(load.floats("output_norm.weight"), requires_grad=False)
    fill_embeddings(model, load, config)
    if load.dequantised:
        kinds = ", ".join(f"{n} x {k}" for k, n in sorted(load.dequantised.items()))
        say_once(f"{path.name}: no native kernel for {kinds} tensors: dequantised to {dtype} at load")
    return model


def fill_embeddings(model: LlamaModel, load: Loader, config: ModelConfig) -> None:
    """The token embedding (block panels looked up row by row, or floats) and the LM head (tied: the
    same panels; else the `output` tensor)."""
    embed = load.get("token_embd.weight")
    D, V = config.hidden_size, config.vocab_size
    if embed.qtype in cpu_quant.FORMATS:
        packed = cpu_quant.pack_blocks(embed.rows(), embed.qtype)
        model.embed_tokens = cpu_quant.QuantizedEmbedding(packed, embed.qtype, V, D, load.dtype)
    else:
        model.embed_tokens = nn.Embedding(V, D, _weight=load.floats("token_embd.weight").reshape(V, D), _freeze=True)
    head = model.lm_head
    if config.tie_word_embeddings or "output.weight" not in load.tensors:
        if isinstance(model.embed_tokens, cpu_quant.QuantizedEmbedding):
            head.packed, head.qtype = model.embed_tokens.packed, embed.qtype
            head.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        else:
            head.weight = model.embed_tokens.weight
    else:
        load.fill_linear(head, ["output.weight"])

"""Decoder layers over a KV cache on the CPU in one C call per forward (cpu_layer.c).

The PyTorch path of `run_layers` (specdec/models/llama.py) runs each layer as four products and an
attention through the C kernels, glued by ~40 small PyTorch operations (RMSNorm, RoPE, SiLU·mul,
views, residual adds, dtype conversions) that cost 10-50 us each on a 2-core CPU: more than the
arithmetic they do, and the same in bfloat16 as in float32, so a bfloat16 forward that reads half the
weight bytes was barely faster. `run_layers_cpu` runs every layer of a forward in one call to
cpu_layer.c, with the same arithmetic, the same fixed reduction orders (each token's outputs are
bitwise independent of T, B, trees and threads) and the same roundings to bfloat16 (listed in the C
file; one deviation: RoPE rounds once, in float32, where PyTorch rounds cos, sin and each step).

Where it cannot run a forward (`unsupported` says why: no cache, autograd on, not on the CPU, a dtype
or layer the C code does not cover, unpacked Linear layers) it returns None and the caller runs the
PyTorch path, which is exact on the CPU too, only slower.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdec.errors import UserError
from specdec.models import cpu_gemm


class LinearArgs(ctypes.Structure):  # linear_args in cpu_layer.c
    _fields_ = [("packed", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("wtype", ctypes.c_int), ("N", ctypes.c_int)]


class NormArgs(ctypes.Structure):  # norm_args
    _fields_ = [("weight", ctypes.c_void_p), ("eps", ctypes.c_float)]


class LayerArgs(ctypes.Structure):  # layer_args
    _fields_ = [("input_norm", NormArgs), ("post_norm", NormArgs), ("q_norm", NormArgs), ("k_norm", NormArgs),
                ("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs), ("down", LinearArgs)]


class StackArgs(ctypes.Structure):  # stack_args
    _fields_ = [(name, ctypes.c_int) for name in ("B", "T", "D", "H", "Hkv", "Dh", "I", "bf16", "threads")] + [
        ("positions", ctypes.c_void_p), ("lengths", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("W", ctypes.c_int),
        ("window", ctypes.c_int64), ("inv_freq", ctypes.c_void_p), ("rope_factor", ctypes.c_float),
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("s_layer", "s_row", "s_head", "s_slot", "S")]


@dataclass(frozen=True)
class Dims:
    D: int  # hidden size
    H: int  # query heads
    Hkv: int  # key/value heads
    Dh: int  # head dim
    I: int  # intermediate size


@dataclass
class Prepared:
    """A layer list's arguments for cpu_layer.c, or why it has none."""
    signature: tuple  # what the pointers were taken from (see `signature`)
    problem: str | None
    dims: Dims | None = None
    args: ctypes.Array | None = None  # LayerArgs * L
    keep: tuple = ()  # the tensors the pointers point into, kept alive


PREPARED: "weakref.WeakKeyDictionary[nn.Module, Prepared]" = weakref.WeakKeyDictionary()


def forward_problem(x: Tensor, cache) -> str | None:
    """Why this forward cannot run here whatever its layers are (None: it can)."""
    if cache is None:
        return "no KV cache (a training forward)"
    if torch.is_grad_enabled():
        return "autograd is on"
    if x.device.type != "cpu":
        return f"x is on {x.device.type}, not the CPU"
    if x.dtype not in cpu_gemm.KERNEL_DTYPES:
        return f"dtype {x.dtype} (the C kernels take {' and '.join(map(str, cpu_gemm.KERNEL_DTYPES))})"
    if cache.k.dtype != x.dtype or cache.k.stride() != cache.v.stride() or cache.k.stride(-1) != 1:
        return f"a {cache.k.dtype} cache with strides {cache.k.stride()} (wants {x.dtype}, k and v alike, head_dim contiguous)"
    if not cpu_gemm.available():
        return f"the CPU kernels could not be built ({cpu_gemm.build_status()['error']})"
    return None


def signature(layers, dtype: torch.dtype) -> tuple:
    """What prepared arguments for `layers` depend on: the modules, their packed tensors (by identity;
    a repack makes new ones) and the norm weights' storage (`.to()` swaps a parameter's storage in place)."""
    parts: list = [dtype]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            parts += (id(lin), id(lin.packed), id(lin.packed_bias), id(lin.scales))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm):
            weight = getattr(norm, "weight", None)
            parts += (id(norm), 0 if weight is None else weight.data_ptr())
    return tuple(parts)


def linear_problem(lin: nn.Module, in_features: int, out_features: int) -> str | None:
    if getattr(lin, "packed", None) is None:
        return "a Linear layer not packed for the C kernels (kernels='library'?)"
    if (lin.in_features, lin.out_features) != (in_features, out_features):
        return f"a {lin.in_features} x {lin.out_features} Linear where {in_features} x {out_features} was expected"
    if lin.packed.dtype not in cpu_gemm.WEIGHT_TYPES or (lin.packed.dtype == torch.int8) != (lin.scales is not None):
        return f"{lin.packed.dtype} panels"
    return None


def norm_problem(norm: nn.Module | None, dim: int, dtype: torch.dtype, optional: bool) -> str | None:
    from specdec.models.llama import RMSNorm

    if norm is None or isinstance(norm, nn.Identity):
        return None if optional or norm is not None else "a missing norm"
    if type(norm).forward is not RMSNorm.forward:
        return f"a {type(norm).__name__} norm"
    if norm.weight.shape != (dim,) or norm.weight.dtype != dtype or not norm.weight.is_contiguous():
        return f"a norm weight {tuple(norm.weight.shape)} {norm.weight.dtype} beside {dtype} activations"
    return None


def layer_problem(layer: nn.Module, dims: Dims, dtype: torch.dtype) -> str | None:
    """Why cpu_layer.c cannot run this layer as llama.DecoderLayer.forward would (None: it can)."""
    from specdec.models.llama import MLP, Attention, DecoderLayer

    attn, mlp = layer.self_attn, layer.mlp
    if (type(layer).forward, type(attn).forward, type(mlp).forward) != (DecoderLayer.forward, Attention.forward, MLP.forward):
        return f"a decoder layer with its own forward ({type(layer).__name__})"
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (dims.H, dims.Hkv, dims.Dh):
        return "layers of different shapes"
    if (attn.q_norm is None) != (attn.k_norm is None):
        return "a q_norm without a k_norm"
    checks = (
        linear_problem(attn.qkv_proj, dims.D, (dims.H + 2 * dims.Hkv) * dims.Dh),
        linear_problem(attn.o_proj, dims.H * dims.Dh, dims.D),
        linear_problem(mlp.gate_up_proj, dims.D, 2 * dims.I),
        linear_problem(mlp.down_proj, dims.I, dims.D),
        norm_problem(layer.input_layernorm, dims.D, dtype, optional=True),
        norm_problem(layer.post_attention_layernorm, dims.D, dtype, optional=True),
        norm_problem(attn.q_norm, dims.Dh, dtype, optional=True),
        norm_problem(attn.k_norm, dims.Dh, dtype, optional=True),
    )
    return next((problem for problem in checks if problem), None)


def model_dims(layer: nn.Module) -> Dims | str:
    """The first layer's dimensions, or why the C code cannot take them."""
    attn, mlp = layer.self_attn, layer.mlp
    dims = Dims(attn.qkv_proj.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.down_proj.in_features)
    if dims.Dh % 2 or dims.H % dims.Hkv:
        return f"head_dim {dims.Dh} with {dims.H} query and {dims.Hkv} key/value heads"
    return dims


def linear_args(lin: nn.Module) -> LinearArgs:
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return LinearArgs(lin.packed.data_ptr(), ptr(lin.scales), ptr(lin.packed_bias), cpu_gemm.WEIGHT_TYPES[lin.packed.dtype],
                      lin.packed.shape[0] * cpu_gemm.NR)


def norm_args(norm: nn.Module | None) -> NormArgs:
    weight = getattr(norm, "weight", None)
    return NormArgs(None, 0.0) if weight is None else NormArgs(weight.data_ptr(), norm.eps)


def prepare(layers, dtype: torch.dtype) -> Prepared:
    """The C arguments of `layers` (built once, rebuilt when `signature` changes), or why there are none."""
    key = signature(layers, dtype)
    prepared = PREPARED.get(layers)
    if prepared is not None and prepared.signature == key:
        return prepared
    dims = model_dims(layers[0])
    problem = dims if isinstance(dims, str) else next((p for p in (layer_problem(l, dims, dtype) for l in layers) if p), None)
    if problem:
        prepared = Prepared(key, problem)
    else:
        args = (LayerArgs * len(layers))()
        keep = []
        for layer_arg, layer in zip(args, layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            layer_arg.input_norm, layer_arg.post_norm = norm_args(layer.input_layernorm), norm_args(layer.post_attention_layernorm)
            layer_arg.q_norm, layer_arg.k_norm = norm_args(attn.q_norm), norm_args(attn.k_norm)
            layer_arg.qkv, layer_arg.o, layer_arg.gate_up, layer_arg.down = map(linear_args, linears)
            keep += [t for lin in linears for t in (lin.packed, lin.packed_bias, lin.scales)]
        prepared = Prepared(key, None, dims, args, tuple(keep))
    PREPARED[layers] = prepared
    return prepared


def unsupported(layers, x: Tensor, cache) -> str | None:
    """Why `run_layers_cpu` would return None for this forward (None: it runs it)."""
    if not isinstance(layers, nn.Module) or not len(layers):
        return "no layers in an nn.ModuleList"
    problem = forward_problem(x, cache)
    if problem is None and (cache.k.shape[0] < len(layers) or cache.k.shape[1] != x.shape[0]):
        problem = f"a cache of {cache.k.shape[0]} layers x {cache.k.shape[1]} rows for {len(layers)} x {x.shape[0]}"
    return problem or prepare(layers, x.dtype).problem


def run_layers_cpu(
    layers: nn.ModuleList, x: Tensor, positions: Tensor, cache, mask: Tensor | None,
    inv_freq: Tensor, rope_attention_factor: float, window: int | None,
) -> Tensor | None:
    """x [B, T, D] through decoder layers over `cache`, as `run_layers` (specdec/models/llama.py): the new
    tokens' keys and values written at slots cache.lengths .. + T - 1 of each row, attending per `mask`
    [B, T, W] (None: causal; see build_attention_mask), RoPE at `positions` [B, T]; cache.lengths
    advanced by T. Returns the new x [B, T, D], or None (nothing done) where `unsupported` says why.
    UserError when a row's tokens would overflow the cache."""
    if unsupported(layers, x, cache):
        return None
    prepared = PREPARED[layers]
    dims = prepared.dims
    B, T, _ = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)  # [B, T, D]
    positions = positions.to(torch.int64).contiguous()  # [B, T]
    lengths = cache.lengths.contiguous()  # [B]
    if mask is not None:
        mask = mask.expand(B, T, -1).contiguous()  # [B, T, W]
    inv_freq = inv_freq.float().contiguous()  # [Dh / 2]
    s_layer, s_row, s_head, s_slot, _ = cache.k.stride()
    stack = StackArgs(
        B, T, dims.D, dims.H, dims.Hkv, dims.Dh, dims.I, x.dtype == torch.bfloat16, torch.get_num_threads(),
        positions.data_ptr(), lengths.data_ptr(), None if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[-1],
        window or 0, inv_freq.data_ptr(), rope_attention_factor, cache.k.data_ptr(), cache.v.data_ptr(),
        s_layer, s_row, s_head, s_slot, cache.k.shape[3],
    )
    status = cpu_gemm.library().specdec_layers(ctypes.addressof(prepared.args), len(layers), ctypes.addressof(stack),
                                               x.data_ptr(), out.data_ptr())
    if status != 0:
        raise UserError(f"sequence would exceed the KV cache of {cache.max_len} slots (context too long)")
    cache.lengths += T
    return out

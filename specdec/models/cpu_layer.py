"""Decoder layers over a KV cache on the CPU in one C call per forward (cpu_layer.c).

The PyTorch path of `run_layers` (specdec/models/llama.py) runs each layer as four products and an
attention through the C kernels, glued by ~40 small PyTorch operations (RMSNorm, RoPE, SiLU·mul,
views, residual adds, dtype conversions) that cost 10-50 us each on a 2-core CPU: more than the
arithmetic they do, and the same in bfloat16 as in float32, so a bfloat16 forward that reads half the
weight bytes was barely faster. `run_layers_cpu` runs every layer of a forward in one call to
cpu_layer.c: the same products and attention (bit for bit), the same fixed reduction orders (each
token's outputs are bitwise independent of T, B, trees and threads), the same roundings to bfloat16
(listed in the C file; one deviation: RoPE rounds once, in float32, where PyTorch rounds cos, sin and
each step). It covers what the native models have: GQA, q/k/v biases, Qwen3's q/k norms, a sliding
window, a layer without an input norm (EAGLE), int8 layers (views.quantized_copy), GGUF Q4_0 / Q4_1 / Q8_0
layers (cpu_quant.py).

`norm_and_logits` does the final norm and the logits (float32, straight from the kernel's float32
sums). It matters as much: PyTorch's conversion of a bfloat16 row of 49,152 logits to float32 is
large enough to run on OpenMP threads, and on a busy 2-core CPU it waited milliseconds for one
(measured: bfloat16 plain decoding through `run_layers_cpu` alone was 1.03-1.47x float32; with
`norm_and_logits` too, 1.51-1.65x).

Where it cannot run a forward (`unsupported` says why: no cache, autograd on, not on the CPU, a dtype
or layer the C code does not cover, unpacked Linear layers) it returns None and the caller runs the
PyTorch path, which is exact on the CPU too, only slower.

One decode forward of the default model (T = 1, context 200, 2 threads), median ms, the configurations
alternating forward by forward; AMD EPYC (Zen 3), 2 cores shared with other jobs (load 1.3-1.5):

                                    float32    bfloat16
    PyTorch path (packed Linear)    41.8       32.8
    run_layers_cpu                  22.8       12.5
    + norm_and_logits               22.7       12.2
    inside the C call (layers)      13.5        8.5     products 12.0 / 7.1, attention 1.1 / 0.85

Python's share of a `run_layers_cpu` call is ~0.1 ms (mostly checking the layers' packs: `fingerprint`).
End to end (`specdec generate --drafter none --max-new-tokens 128`, float32 and bfloat16 runs
alternating, 3-8 pairs, five sessions at loads 1-3), bfloat16 / float32 tokens per second: 1.09-1.26
through the PyTorch path, 1.51-1.65 (median 1.6) with `run_layers_cpu` and `norm_and_logits`; float32
itself 1.9x faster than through the PyTorch path (45 against 23 tok/s). The products read weights at
~30 GB/s in float32 but ~25 GB/s in bfloat16 on 2 threads (16-17 against 19-21 on one), which is what
keeps bfloat16 from 2x.
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
    stamp: tuple  # (activation dtype, cpu_gemm.CHANGES) when built
    problem: str | None
    dims: Dims | None = None
    args: ctypes.Array | None = None  # LayerArgs * L
    keep: tuple = ()  # the tensors the pointers point into, kept alive (a `.to()` swaps a parameter's storage)


PREPARED: "weakref.WeakKeyDictionary[nn.Module, Prepared]" = weakref.WeakKeyDictionary()


def tensor_problem(x: Tensor) -> str | None:
    """Why the C code cannot take x (None: it can)."""
    if torch.is_grad_enabled():
        return "autograd is on"
    if x.device.type != "cpu":
        return f"x is on {x.device.type}, not the CPU"
    if x.dtype not in cpu_gemm.KERNEL_DTYPES:
        return f"dtype {x.dtype} (the C kernels take {' and '.join(map(str, cpu_gemm.KERNEL_DTYPES))})"
    if not cpu_gemm.available():
        return f"the CPU kernels could not be built ({cpu_gemm.build_status()['error']})"
    return None


def cache_problem(cache, x: Tensor, num_layers: int) -> str | None:
    """Why the C code cannot run a forward of x [B, T, D] through num_layers layers over cache (None: it can)."""
    if cache is None:
        return "no KV cache (a training forward)"
    k, v = cache.k, cache.v  # [L, B, Hkv, S, Dh]
    if k.device.type != "cpu" or k.dtype != x.dtype or k.stride() != v.stride() or k.stride(-1) != 1:
        return f"a {k.dtype} {k.device.type} cache with strides {k.stride()} (wants {x.dtype} on the CPU, k and v alike)"
    if k.shape[0] < num_layers or k.shape[1] != x.shape[0]:
        return f"a cache of {k.shape[0]} layers x {k.shape[1]} rows for {num_layers} layers x {x.shape[0]} rows"
    return None


def linear_problem(lin: nn.Module, in_features: int, out_features: int) -> str | None:
    if getattr(lin, "packed", None) is None:
        return "a Linear layer not packed for the C kernels (kernels='library'?)"
    if getattr(lin, "split", None) is not None:
        return "a tensor-parallel shard (its partial products are summed across ranks between the C kernels)"
    if (lin.in_features, lin.out_features) != (in_features, out_features):
        return f"a {lin.in_features} x {lin.out_features} Linear where {in_features} x {out_features} was expected"
    if lin.qtype is None and (lin.packed.dtype not in cpu_gemm.WEIGHT_TYPES or (lin.packed.dtype == torch.int8) != (lin.scales is not None)):
        return f"{lin.packed.dtype} panels"
    return None


def norm_problem(norm: nn.Module | None, dim: int, dtype: torch.dtype) -> str | None:
    """Why the C code cannot run this norm (None: it can; None or nn.Identity is no norm)."""
    from specdec.models.llama import RMSNorm

    if norm is None or isinstance(norm, nn.Identity):
        return None
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
        norm_problem(layer.input_layernorm, dims.D, dtype),
        norm_problem(layer.post_attention_layernorm, dims.D, dtype),
        norm_problem(attn.q_norm, dims.Dh, dtype),
        norm_problem(attn.k_norm, dims.Dh, dtype),
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
    return LinearArgs(lin.packed.data_ptr(), ptr(lin.scales), ptr(lin.packed_bias), cpu_gemm.weight_type(lin.packed, lin.qtype),
                      lin.packed.shape[0] * cpu_gemm.NR)


def norm_args(norm: nn.Module | None) -> NormArgs:
    weight = getattr(norm, "weight", None)
    return NormArgs(None, 0.0) if weight is None else NormArgs(weight.data_ptr(), norm.eps)


def prepare(layers: nn.ModuleList, dtype: torch.dtype) -> Prepared:
    """The C arguments of `layers`, or why there are none: built once, and again after anything they were taken
    from may have changed (a Linear's packs set, a module or parameter registered anywhere: cpu_gemm.CHANGES).
    Walking the layers at every forward to compare what they hold, as this did, cost a 4-bit draft forward of
    the default model 5.48 ms against 5.13 without it (2-core EPYC, medians of six alternated generations):
    12 us in a loop of its own, but after a forward's C kernels the objects it reads are out of the caches."""
    stamp = (dtype, cpu_gemm.CHANGES[0])
    prepared = PREPARED.get(layers)
    if prepared is not None and prepared.stamp == stamp:
        return prepared
    dims = model_dims(layers[0])
    problem = dims if isinstance(dims, str) else next((p for p in (layer_problem(l, dims, dtype) for l in layers) if p), None)
    if problem:
        prepared = Prepared(stamp, problem)
    else:
        args = (LayerArgs * len(layers))()
        keep = []
        for layer_arg, layer in zip(args, layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
            layer_arg.input_norm, layer_arg.post_norm, layer_arg.q_norm, layer_arg.k_norm = map(norm_args, norms)
            layer_arg.qkv, layer_arg.o, layer_arg.gate_up, layer_arg.down = map(linear_args, linears)
            keep += [t for lin in linears for t in (lin.packed, lin.packed_bias, lin.scales)]
            keep += [norm.weight.detach() for norm in norms if getattr(norm, "weight", None) is not None]
        prepared = Prepared(stamp, None, dims, args, tuple(keep))
    PREPARED[layers] = prepared
    return prepared


def unsupported(layers: nn.ModuleList, x: Tensor, cache) -> str | None:
    """Why `run_layers_cpu` would return None for this forward (None: it runs it)."""
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return "no layers in an nn.ModuleList"
    return tensor_problem(x) or cache_problem(cache, x, len(layers)) or prepare(layers, x.dtype).problem


def run_layers_cpu(
    layers: nn.ModuleList, x: Tensor, positions: Tensor, cache, mask: Tensor | None,
    inv_freq: Tensor, rope_attention_factor: float, window: int | None, taps=None,
) -> Tensor | None:
    """x [B, T, D] through decoder layers over `cache`, as `run_layers` (specdec/models/llama.py): the new
    tokens' keys and values written at slots cache.lengths .. + T - 1 of each row, attending per `mask`
    [B, T, W] (None: causal; see build_attention_mask), RoPE at `positions` [B, T]; cache.lengths
    advanced by T. Returns the new x [B, T, D], or None (nothing done) where `unsupported` says why.
    UserError when a row's tokens would overflow the cache. `taps` (llama.Taps): the call is split at
    the layers it names, and each one's input is kept; the C code rounds the residual stream to the
    activation dtype after every add, so a split changes no bits."""
    if unsupported(layers, x, cache):
        return None
    prepared = PREPARED[layers]
    dims = prepared.dims
    B, T, _ = x.shape
    if inv_freq.shape != (dims.Dh // 2,):
        raise ValueError(f"inv_freq {tuple(inv_freq.shape)} for head_dim {dims.Dh}")
    x = x.contiguous()
    out = torch.empty_like(x)  # [B, T, D]
    positions = positions.to("cpu", torch.int64).expand(B, T).contiguous()  # [B, T]
    lengths = cache.lengths.contiguous()  # [B]
    if mask is not None:
        mask = mask.to("cpu", torch.bool).expand(B, T, -1).contiguous()  # [B, T, W]
    inv_freq = inv_freq.to("cpu", torch.float32).contiguous()  # [Dh / 2]
    s_layer, s_row, s_head, s_slot, _ = cache.k.stride()
    stack = StackArgs(
        B, T, dims.D, dims.H, dims.Hkv, dims.Dh, dims.I, x.dtype == torch.bfloat16, cpu_gemm.threads(),
        positions.data_ptr(), lengths.data_ptr(), None if mask is None else mask.data_ptr(),
        0 if mask is None else mask.shape[-1],
        window or 0, inv_freq.data_ptr(), rope_attention_factor, cache.k.data_ptr(), cache.v.data_ptr(),
        s_layer, s_row, s_head, s_slot, cache.k.shape[3],
    )
    bounds = sorted({0, len(layers), *(i for i in (taps.layers if taps is not None else ()) if 0 < i < len(layers))})
    for start, end in zip(bounds, bounds[1:]):  # one call, or one per stretch between tapped layers
        if taps is not None and start in taps.layers:
            taps.states[start] = x.clone()
        offset = start * s_layer * cache.k.element_size()  # this stretch's first layer in the cache
        stack.k, stack.v = cache.k.data_ptr() + offset, cache.v.data_ptr() + offset
        status = cpu_gemm.library().specdec_layers(ctypes.addressof(prepared.args) + start * ctypes.sizeof(LayerArgs), end - start,
                                                   ctypes.addressof(stack), x.data_ptr(), out.data_ptr())
        if status != 0:
            raise UserError(f"sequence would exceed the KV cache of {cache.max_len} slots (context too long)")
        x = out
    cache.lengths += T
    return out


def positions_at(hidden: Tensor, logits_at: Tensor | None) -> Tensor:
    """hidden [B, T, D] at one position per row, logits_at [B] ([B, 1, D]); all of it where None."""
    return hidden if logits_at is None else hidden.gather(1, logits_at[:, None, None].expand(-1, 1, hidden.shape[-1]))


def norm_and_logits(norm: nn.Module, lm_head: nn.Module, x: Tensor, logits_at: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """(hidden [B, T, D], float32 logits [B, T, V], or [B, 1, V] at logits_at [B]) of x [B, T, D], as
    LlamaModel.forward computes them, or None where the C code does not cover them (an unpacked lm_head:
    kernels="library"). The norm per row in C (the layers' code); the logits straight from the
    kernel's float32 sums, neither rounded to bfloat16 nor converted by PyTorch: on a busy 2-core CPU,
    converting a bfloat16 row of 49,152 logits ran on OpenMP threads and waited milliseconds for one."""
    if tensor_problem(x) or getattr(lm_head, "packed", None) is None or isinstance(norm, nn.Identity) or norm_problem(
        norm, x.shape[-1], x.dtype
    ):
        return None
    x = x.contiguous()
    hidden = torch.empty_like(x)  # [B, T, D]
    cpu_gemm.library().specdec_rms_norm(x.data_ptr(), hidden.data_ptr(), x.shape[:-1].numel(), x.shape[-1],
                                        norm.weight.data_ptr(), norm.eps, x.dtype == torch.bfloat16)
    h = positions_at(hidden, logits_at)
    logits = cpu_gemm.gemm(h, lm_head.packed, lm_head.packed_bias, lm_head.out_features, lm_head.scales, out_dtype=torch.float32,
                           qtype=lm_head.qtype)
    if getattr(lm_head, "split", None) is not None:  # a tensor-parallel vocabulary shard
        logits = lm_head.split.combine(logits)
    return hidden, logits

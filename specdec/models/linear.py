"""A Linear layer that runs inference products on the CPU through specdec's kernel.

Decoding multiplies 1 (plain step) or k+1 (verify step) rows by each weight, so it is bound by
reading the weights. On the CPU, `use_cpu_kernels` packs each float32 or bfloat16 weight for
cpu_gemm.skinny_gemm, which streams it once per call and gives a row the same bits whatever the number
of rows beside it (verify blocks, batches, prefill: any number of rows), accumulating in float32. It
is as fast as MKL or faster at every size measured (cpu_gemm's docstring), so every inference product
of a packed layer goes through it. GPUs and training (grad enabled) use `F.linear`. The packed copy
doubles the weight memory on the CPU; it is an inference-only cache (training uses `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.models import cpu_gemm


PACK_FIELDS = ("packed", "packed_bias", "scales", "qtype", "split")  # what cpu_layer.prepare reads of a Linear


class Linear(nn.Linear):
    packed: Tensor | None = None  # [ceil(out/16), in, 16] panels (float32, bfloat16, or int8 with scales), CPU only
    packed_bias: Tensor | None = None  # [ceil(out/16) * 16] float32, the bias as the kernel reads it
    scales: Tensor | None = None  # [ceil(out/16) * 16] per-output scales of int8 panels (quantize_int8)
    qtype: str | None = None  # GGUF block format of uint8 panels ("Q4_0", "Q4_1", "Q8_0", "Q4_0-A8", "Q4_1-A8"; cpu_quant.py)
    split = None  # a tensor_parallel.Split: this layer is one rank's shard, its products combined across ranks

    def __setattr__(self, name: str, value) -> None:
        if name in PACK_FIELDS:
            cpu_gemm.note_change()  # the C code's prepared arguments point at the packs (cpu_layer.prepare)
        super().__setattr__(name, value)

    @property
    def quantized(self) -> bool:
        """Whether the panels are the only copy of the weight (int8 or GGUF blocks; `weight` is empty)."""
        return self.scales is not None or self.qtype is not None

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out] (the whole layer's out under tensor parallelism)
        y = self.local_forward(x)
        return y if self.split is None else self.split.combine(y)

    def local_forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., this shard's out]
        if self.packed is None or (torch.is_grad_enabled() and not self.quantized):
            return F.linear(x, self.weight, self.bias)
        if x.dtype in cpu_gemm.KERNEL_DTYPES:
            return cpu_gemm.gemm(x, self.packed, self.packed_bias, self.out_features, self.scales, qtype=self.qtype)
        # float16 activations into a quantized layer (a float16 CPU target's quantized drafter)
        return cpu_gemm.gemm(x.float(), self.packed, self.packed_bias, self.out_features, self.scales, qtype=self.qtype).to(x.dtype)


def float_weight(linear: Linear) -> Tensor:
    """The layer's weight [out, in] as floats: `weight` itself, or dequantised from its panels (a new
    tensor) where the panels are the only copy."""
    if linear.qtype is not None:
        from specdec.models import cpu_quant

        return cpu_quant.dequantize(linear.packed, linear.qtype, linear.out_features, linear.in_features)
    if linear.scales is not None:
        return cpu_gemm.dequantize(linear.packed, linear.scales, linear.out_features)
    return linear.weight


def take_rows(linear: Linear, rows: Tensor, dtype: torch.dtype, dequantize: bool = False) -> Linear:
    """A frozen, bias-free Linear of `linear`'s output rows `rows` [n] (an LM head's draft vocabulary): GGUF
    block panels of the same blocks where `linear` has them (unless `dequantize`: training needs float
    weights), else float rows in `dtype` (packed for the CPU kernels by `use_cpu_kernels`, as any float
    layer)."""
    out = Linear(linear.in_features, len(rows), bias=False, device="meta")
    if linear.qtype is not None and not dequantize:
        from specdec.models import cpu_quant

        out.packed, out.qtype = cpu_quant.take_rows(linear.packed, linear.qtype, linear.out_features, rows), linear.qtype
        out.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        return out
    weight = float_weight(linear).detach()
    if linear.split is not None and linear.split.kind == "columns":  # one rank's vocabulary shard: rows of all of them
        weight = linear.split.whole_weight(weight)
    out.weight = nn.Parameter(weight[rows.to(weight.device)].to(dtype).clone(), requires_grad=False)
    return out


def quantize_int8(linear: Linear, source: Linear) -> None:
    """Give a CPU Linear int8 panels with per-output scales of `source`'s weight (weight-only
    quantisation); it keeps no float weight."""
    linear.packed, linear.scales = cpu_gemm.pack_int8(float_weight(source))
    linear.packed_bias = cpu_gemm.pad_bias(linear.bias, linear.packed)
    linear.weight = nn.Parameter(torch.empty(0), requires_grad=False)


def quantize_blocks(linear: Linear, source: Linear, qtype: str) -> None:
    """Give a CPU Linear GGUF block panels (qtype "Q4_0", "Q4_1", "Q8_0", or "Q4_0-A8" / "Q4_1-A8" for
    int8 activations; gguf's reference quantiser) of `source`'s weight; it keeps no float weight."""
    from gguf import GGMLQuantizationType, quants

    from specdec.models import cpu_quant

    gguf_type = GGMLQuantizationType[cpu_quant.FORMATS[qtype].gguf]
    raw = quants.quantize(float_weight(source).detach().float().numpy(), gguf_type)  # [N, K/32 * bytes]
    linear.packed, linear.qtype = cpu_quant.pack_blocks(torch.from_numpy(raw), qtype), qtype
    linear.packed_bias = cpu_gemm.pad_bias(linear.bias, linear.packed)
    linear.weight = nn.Parameter(torch.empty(0), requires_grad=False)


def use_cpu_kernels(model: nn.Module) -> bool:
    """Pack every float32 and bfloat16 CPU Linear of `model` for the kernel; False when no kernel could
    be built (cpu_gemm says why, once). Other dtypes keep `F.linear`, and say so once."""
    if not cpu_gemm.available():
        return False
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" and not module.quantized:
            if module.weight.dtype not in cpu_gemm.KERNEL_DTYPES:
                cpu_gemm.say_once(f"no CPU kernel for {module.weight.dtype} weights: PyTorch's matmul runs them; "
                                  "greedy speculative output may differ from plain decoding")
                continue
            module.packed = cpu_gemm.pack(module.weight)
            module.packed_bias = cpu_gemm.pad_bias(module.bias, module.packed)
    return True

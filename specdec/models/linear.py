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


class Linear(nn.Linear):
    packed: Tensor | None = None  # [ceil(out/16), in, 16] panels (float32, bfloat16, or int8 with scales), CPU only
    packed_bias: Tensor | None = None  # [ceil(out/16) * 16] float32, the bias as the kernel reads it
    scales: Tensor | None = None  # [ceil(out/16) * 16] per-output scales of int8 panels (quantize_int8)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.packed is None or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if x.dtype in cpu_gemm.KERNEL_DTYPES:
            return cpu_gemm.gemm(x, self.packed, self.packed_bias, self.out_features, self.scales)
        # float16 activations into an int8 layer (a float16 CPU target's quantized drafter)
        return cpu_gemm.gemm(x.float(), self.packed, self.packed_bias, self.out_features, self.scales).to(x.dtype)


def quantize_int8(linear: Linear) -> None:
    """Replace a CPU Linear's weight by int8 panels with per-output scales (weight-only quantisation).
    The float weight is dropped."""
    linear.packed, linear.scales = cpu_gemm.pack_int8(linear.weight)
    linear.packed_bias = cpu_gemm.pad_bias(linear.bias, linear.packed)
    linear.weight = nn.Parameter(torch.empty(0), requires_grad=False)


def use_cpu_kernels(model: nn.Module) -> bool:
    """Pack every float32 and bfloat16 CPU Linear of `model` for the kernel; False when no kernel could
    be built (cpu_gemm says why, once). Other dtypes keep `F.linear`, and say so once."""
    if not cpu_gemm.available():
        return False
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" and module.scales is None:
            if module.weight.dtype not in cpu_gemm.KERNEL_DTYPES:
                cpu_gemm.say_once(f"no CPU kernel for {module.weight.dtype} weights: PyTorch's matmul runs them; "
                                  "greedy speculative output may differ from plain decoding")
                continue
            module.packed = cpu_gemm.pack(module.weight)
            module.packed_bias = cpu_gemm.pad_bias(module.bias, module.packed)
    return True

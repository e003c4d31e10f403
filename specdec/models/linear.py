"""A Linear layer that runs the few-row products of decoding through specdec's CPU kernel.

Decoding multiplies 1 (plain step) or k+1 (verify step) rows by each weight, so it is bound by
reading the weights. On the CPU, `use_cpu_kernels` packs each weight for cpu_gemm.skinny_gemm, which
streams it once per call for up to MAX_KERNEL_ROWS rows and gives a row the same bits whatever the
number of rows beside it. Larger products (prefill) and GPUs use `F.linear`. The packed copy doubles
the weight memory on the CPU; it is an inference-only cache (training uses `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.models import cpu_gemm

MAX_KERNEL_ROWS = 16  # beyond this, MKL's blocked GEMM is faster than streaming panels per 6 rows


class Linear(nn.Linear):
    packed: Tensor | None = None  # [ceil(out/16), in, 16] panels (float32, or int8 with scales), CPU only
    scales: Tensor | None = None  # [ceil(out/16) * 16] per-output scales of int8 panels (quantize_int8)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        rows = x.shape[:-1].numel()
        if self.packed is None or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if rows > MAX_KERNEL_ROWS:
            weight = self.weight if self.scales is None else cpu_gemm.dequantize(self.packed, self.scales, self.out_features)
            return F.linear(x, weight, self.bias)
        y = cpu_gemm.gemm(x.reshape(rows, -1), self.packed, self.bias, self.out_features, self.scales)  # [M, out]
        return y.reshape(*x.shape[:-1], -1)


def quantize_int8(linear: Linear) -> None:
    """Replace a CPU Linear's weight by int8 panels with per-output scales (weight-only quantisation).
    The float weight is dropped; products of more than MAX_KERNEL_ROWS rows dequantise on the fly."""
    linear.packed, linear.scales = cpu_gemm.pack_int8(linear.weight)
    linear.weight = nn.Parameter(torch.empty(0), requires_grad=False)


def use_cpu_kernels(model: nn.Module) -> bool:
    """Pack every float32 CPU Linear of `model` for the kernel; False when no kernel could be built."""
    if not cpu_gemm.available():
        return False
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32 \
                and module.scales is None:
            module.packed = cpu_gemm.pack(module.weight)
    return True

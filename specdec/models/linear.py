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
    packed: Tensor | None = None  # [ceil(out/16), in, 16] float32 panels, CPU only

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        rows = x.shape[:-1].numel()
        if self.packed is None or rows > MAX_KERNEL_ROWS or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        y = cpu_gemm.gemm(x.reshape(rows, -1), self.packed, self.bias, self.out_features)  # [M, out]
        return y.reshape(*x.shape[:-1], -1)


def use_cpu_kernels(model: nn.Module) -> bool:
    """Pack every float32 CPU Linear of `model` for the kernel; False when no kernel could be built."""
    if not cpu_gemm.available():
        return False
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.packed = cpu_gemm.pack(module.weight)
    return True

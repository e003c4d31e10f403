"""A Linear layer that picks the fastest CPU matrix kernel for the few-row products of decoding.

Decoding multiplies 1 (plain step) or k+1 (verify step) rows by each weight, so it is bound by reading
the weights. On the CPU the BLAS kernels differ a lot for such skinny products (measured on a 2-core
AMD EPYC with MKL, reading SmolLM2-135M's 49152x576 LM head): `x @ W.T` with W stored [out, in]
streams about 7 GB/s for one row; with a contiguous [in, out] copy, one row streams about 17 GB/s
(the machine's read bandwidth is about 19 GB/s); for 2-16 rows, `W @ x.T` on the [out, in] layout is
about twice as fast as `F.linear`. So on the CPU each layer keeps both layouts (twice the weight
memory) and picks per call; on a GPU it is a plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Linear(nn.Linear):
    weight_t: Tensor | None = None  # [in, out] contiguous copy, CPU only

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.weight_t is None or torch.is_grad_enabled():  # the copy is an inference-only cache
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        y = rows @ self.weight_t if rows.shape[0] == 1 else (self.weight @ rows.t()).t()  # [M, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def use_cpu_kernels(model: nn.Module) -> None:
    """Give every Linear of a CPU model its [in, out] copy (see the module docstring)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu":
            module.weight_t = module.weight.detach().t().contiguous()

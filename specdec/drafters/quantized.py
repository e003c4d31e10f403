"""`quantized`: the target's own weights in int8 (weight-only) as the draft model. It agrees with the
target very often, and is cheaper only where an int8 kernel reads a quarter of the bytes: the CPU
kernel (see views.py). Elsewhere an int8 copy would run at the target's own speed, so it is refused."""

from __future__ import annotations

from specdec.drafters.base import DrafterOptions, register
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import UserError
from specdec.models import cpu_gemm
from specdec.models.views import int8_copy


@register("quantized")
def build(target, options: DrafterOptions) -> DraftModelDrafter:
    if next(target.parameters()).device.type != "cpu" or not cpu_gemm.available():
        raise UserError("the quantized drafter needs specdec's CPU int8 kernel (a CPU target and a C compiler); "
                        "on a GPU use layer_skip, eagle or a draft model")
    drafter = DraftModelDrafter(target, int8_copy(target))
    drafter.name = "quantized"
    return drafter

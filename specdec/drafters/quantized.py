"""`quantized`: the target's own weights in int8 (weight-only) as the draft model. It agrees with
the target very often; whether it is faster depends on an int8 kernel (CPU: yes, see views.py)."""

from __future__ import annotations

from specdec.drafters.base import DrafterOptions, register
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.models.views import int8_copy


@register("quantized")
def build(target, options: DrafterOptions) -> DraftModelDrafter:
    drafter = DraftModelDrafter(target, int8_copy(target))
    drafter.name = "quantized"
    return drafter

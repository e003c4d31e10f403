"""`quantized`: the target's own weights, quantised (weight-only), as the draft model. It agrees with
the target very often, and is cheaper only where a kernel reads fewer bytes per weight: specdec's CPU
kernels (see views.quantized_copy). Elsewhere a quantised copy would run at the target's own speed, so
it is refused.

The draft's format (DrafterOptions.extra["quant_format"], `--quant-format`): int8 (one scale per output
channel), GGUF's blocks Q8_0, Q4_1, Q4_0 (one scale per 32 weights), or Q4_1-A8, Q4_0-A8: the same
4-bit blocks multiplied with int8 activations in integer dot products (int_dot.c; the draft's kernel
path, `weights` included, is in `generate --json`'s `draft_kernels`). A 4-bit copy's LM head only ranks
the vocabulary: its best logits are scored again by the target's head rows in int8 (views.RescoredHead). The default is the cheaper
kind of the target: int8 for a float target, Q4_0 for a Q8_0 GGUF target; a 4-bit target has no
cheaper copy by default (its own format is already 4-bit), so one must be asked for by name.
"""

from __future__ import annotations

from specdec.drafters.base import DrafterOptions, register
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import UserError
from specdec.models import cpu_gemm
from specdec.models.views import QUANT_FORMATS, quantized_copy


def target_format(target) -> str | None:
    """The GGUF block format of the target's layers (None: float weights)."""
    return getattr(target.layers[0].mlp.down_proj, "qtype", None) if hasattr(target, "layers") else None


def default_format(target) -> str:
    own = target_format(target)
    if own is None:
        return "int8"
    if own == "Q8_0":
        return "Q4_0"
    raise UserError(f"the target already runs {own} weights: a quantized copy would cost as much as the target; "
                    f"name a format with --quant-format ({', '.join(QUANT_FORMATS)}) or pick another drafter")


@register("quantized")
def build(target, options: DrafterOptions) -> DraftModelDrafter:
    if next(target.parameters()).device.type != "cpu" or not cpu_gemm.available():
        raise UserError("the quantized drafter needs specdec's CPU kernels (a CPU target and a C compiler); "
                        "on a GPU use layer_skip, eagle or a draft model")
    fmt = options.extra.get("quant_format") or default_format(target)
    drafter = DraftModelDrafter(target, quantized_copy(target, fmt))
    drafter.name = "quantized"
    return drafter

"""`layer_skip`: self-speculation. The draft is the target with most decoder layers skipped (the
kept ones chosen by `specdec tune layer-skip`, or the first few), sharing the target's weights; it
runs as a draft model with its own KV cache (see draft_model.py)."""

from __future__ import annotations

from specdec.drafters.base import DrafterOptions, register
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.models.views import layer_subset

DEFAULT_FRACTION = 0.25  # without a tuned set: the first quarter of the layers


def default_layers(num_layers: int) -> list[int]:
    return list(range(max(1, round(num_layers * DEFAULT_FRACTION))))


@register("layer_skip")
def build(target, options: DrafterOptions) -> DraftModelDrafter:
    layers = options.extra.get("layers") or default_layers(target.config.num_layers)
    drafter = DraftModelDrafter(target, layer_subset(target, list(layers)))
    drafter.name = "layer_skip"
    return drafter

"""`layer_skip`: self-speculation. The draft is the target with most decoder layers skipped (the
kept ones chosen by `specdec tune layer-skip`, or the first few), sharing the target's weights; it
runs as a draft model (see draft_model.py).

Where the kept layers are the target's first ones (the default) and steps run eagerly on the CPU
(catching up in gaps, catch_up.py), the draft keeps no KV cache of its own: at every position the
target has read, the keys and values of its first layers are exactly what the draft would compute
there (the same layers over the same tokens), so the draft reads and writes the target's cache for
those layers. A proposal then feeds each row one token, the pending one, where a cache of its own
would first catch up over every position since the row last drafted: a whole prompt and a stretch at
gamma 0, about six plain steps on a 2-core CPU each time the cost policy retries drafting (docs/
design.md, "Out of domain"). The draft writes only slots the target writes again, layer by layer, before
reading them: the pending token's and the drafts' (the verify block), and padding past a row's length.
Graphed steppers catch up in chunks, whose padding runs SHORT_GAP slots past a row's length, where the
target's cache has no spare slots: there the draft keeps its own cache.
"""

from __future__ import annotations

from specdec.drafters.base import DrafterOptions, register
from specdec.drafters.catch_up import catches_up
from specdec.drafters.draft_model import DraftModelDrafter, DraftState
from specdec.models.views import layer_subset

DEFAULT_FRACTION = 0.25  # without a tuned set: the first quarter of the layers


def default_layers(num_layers: int) -> list[int]:
    return list(range(max(1, round(num_layers * DEFAULT_FRACTION))))


class LayerSkipDrafter(DraftModelDrafter):
    name = "layer_skip"

    def __init__(self, target, layers: list[int]) -> None:
        super().__init__(target, layer_subset(target, layers))
        self.first_layers = list(layers) == list(range(len(layers)))

    def attach(self, batch) -> None:
        if not (self.first_layers and catches_up(batch) and batch.target_cache is not None):
            return super().attach(batch)
        target = batch.target_cache
        batch.draft = DraftState(target.first_layers(len(self.draft.layers)), follows=target.lengths)


@register("layer_skip")
def build(target, options: DrafterOptions) -> LayerSkipDrafter:
    return LayerSkipDrafter(target, list(options.extra.get("layers") or default_layers(target.config.num_layers)))

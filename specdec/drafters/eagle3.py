"""`eagle3`: EAGLE-2's dynamic trees (drafters/eagle.py) drafted by an EAGLE-3 head (models/eagle3.py).

The drafter is EagleDrafter itself: the head declares the target layers it reads (`feature_layers`),
so the step hands `join` and `commit` those layers' states ([.., 3D]) instead of the final hidden
states, and the head's `project` (fc) turns them into its input at committed positions, when they are
fed (at once on a graphed stepper, at the next drafting step's catch-up on an eager one). Tree shape,
defaults, `--tree-nodes` and the grafted prompt lookup (`--tree-lookup`) are EAGLE's.
"""

from __future__ import annotations

from specdec.drafters.base import DrafterOptions, register
from specdec.drafters.eagle import EagleDrafter, tree_config
from specdec.drafters.ngram import ngram_config
from specdec.drafters.shipped import trained_folder
from specdec.models.eagle3 import load_eagle3_head


@register("eagle3")
def build(target, options: DrafterOptions) -> EagleDrafter:
    head = options.extra.get("eagle3_head")
    if head is None:
        head = load_eagle3_head(trained_folder("eagle3", target, options.extra.get("eagle3_path"), "--eagle3-head"))
    return EagleDrafter(target, head, tree_config(target, options), ngram_config(options))

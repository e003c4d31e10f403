"""`none`: plain decoding through the same step, one target token per step. The baseline."""

from __future__ import annotations

from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Stateless, register


class NoDrafter(Stateless):
    name = "none"

    def shape(self, gamma: int) -> DraftShape:
        return DraftShape(width=0, depth=0)

    def propose(self, batch, gamma, u) -> Proposal:
        raise AssertionError("the step never asks `none` for drafts")


@register("none")
def build(target, options: DrafterOptions) -> NoDrafter:
    return NoDrafter()

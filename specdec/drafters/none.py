"""`none`: plain decoding through the same engine, one target token per step. The baseline."""

from __future__ import annotations

from specdec.drafters.base import DecodeState, DrafterOptions, Proposal, empty_proposal, register
from specdec.verify import VerifyResult


class NoDrafter:
    name = "none"

    def max_tokens(self, gamma: int) -> int:
        return 0

    def prefill(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState, k: int) -> Proposal:
        return empty_proposal(state)

    def commit(self, state: DecodeState, result: VerifyResult) -> None:
        pass


@register("none")
def build(target, options: DrafterOptions) -> NoDrafter:
    return NoDrafter()

"""Drafters, one per file. Importing this package registers them all."""

from specdec.drafters import draft_model, eagle, eagle3, layer_skip, lookahead, medusa, ngram, none, quantized, suffix  # noqa: F401  (registration side effects)
from specdec.drafters.base import DRAFTERS, Drafter, DrafterOptions, DraftShape, Proposal, Verified
from specdec.errors import UserError


def build_drafter(name: str, target, options: DrafterOptions | None = None) -> Drafter:
    if name not in DRAFTERS:
        raise UserError(f"unknown drafter {name!r}; choose one of: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[name](target, options or DrafterOptions())


__all__ = ["DRAFTERS", "DraftShape", "Drafter", "DrafterOptions", "Proposal", "Verified", "build_drafter"]

"""Configuration dataclasses. No logic beyond validation lives here; argument parsing is in cli.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn from a distribution. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise UserError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class NgramConfig:
    """Prompt lookup: match the longest recent n-gram (max_ngram down to min_ngram) and copy what followed."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UserError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")


@dataclass(frozen=True)
class SpecConfig:
    """What the engine does per request batch."""

    gamma: int = 4  # draft tokens proposed per step (the start for gamma_policy "heuristic")
    gamma_policy: str = "fixed"  # fixed | heuristic | confidence | cost (see adaptive.py)
    gamma_max: int = 12  # the most an adaptive policy drafts
    confidence_threshold: float = 0.4  # "confidence": stop drafting below this top-1 draft probability
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded output
    stop_at_eos: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int):
            raise UserError(f"gamma must be a whole number, got {self.gamma!r}")
        if self.gamma < 1:
            raise UserError(f"gamma must be >= 1, got {self.gamma}")
        from specdec.adaptive import POLICIES

        if self.gamma_policy not in POLICIES:
            raise UserError(f"unknown gamma policy {self.gamma_policy!r}; choose from {', '.join(POLICIES)}")
        if self.gamma_max < 1:
            raise UserError(f"gamma_max must be >= 1, got {self.gamma_max}")
        if not 0 <= self.confidence_threshold <= 1:
            raise UserError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


AUTO_GAMMA_START = 4  # where an adaptive policy starts from with gamma "auto"


def spec_config_for(gamma: int | str, gamma_policy: str = "cost", **fields) -> SpecConfig:
    """SpecConfig for a gamma given as a number (drafted at every step) or "auto" (chosen per row by
    `gamma_policy`, from AUTO_GAMMA_START): the CLI's `--gamma` and `specdec.generate`'s `gamma`."""
    if gamma == "auto":
        return SpecConfig(gamma=AUTO_GAMMA_START, gamma_policy=gamma_policy, **fields)
    if isinstance(gamma, str):
        raise UserError(f"gamma must be a whole number or 'auto', got {gamma!r}")
    return SpecConfig(gamma=gamma, **fields)

"""Counters of a decode and the rates derived from them (names as in docs/design.md, "Vocabulary").

- acceptance rate = accepted / drafted, overall and per draft position;
- mean accepted length tau = tokens emitted by decode steps / decode steps (plain decoding: tau = 1).
  The prefill forward, which emits the first token and drafts nothing, is in neither count. This is
  the one definition: `generate --json`, the server's usage, `results.json` and the reports use it;
- tokens/s = emitted tokens / wall seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def mean_accepted_length(decode_emitted: int, decode_steps: int) -> float | None:
    """tau: tokens per decode step, the prefill left out (see the module docstring)."""
    return decode_emitted / decode_steps if decode_steps else None


@dataclass
class SpecStats:
    steps: int = 0  # target forwards (prefill included)
    decode_steps: int = 0  # the steps after the prefill
    decode_emitted: int = 0  # tokens those steps emitted
    drafted: int = 0  # draft tokens proposed (for a tree: its depth, the longest acceptable run)
    accepted: int = 0
    draft_nodes: int = 0  # draft tokens the target verified (tree nodes; equals drafted for chains)
    emitted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    draft_s: float = 0.0  # time inside drafter.propose
    target_s: float = 0.0  # time inside target forwards

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int, num_nodes: int | None = None,
                    prefill: bool = False) -> None:
        self.steps += 1
        if not prefill:
            self.decode_steps += 1
            self.decode_emitted += num_emitted
        self.drafted += num_drafted
        self.draft_nodes += num_drafted if num_nodes is None else num_nodes
        self.accepted += num_accepted
        self.emitted += num_emitted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        """Add another row's counters (times are not added: rows of a batch share the clock)."""
        self.steps += other.steps
        self.decode_steps += other.decode_steps
        self.decode_emitted += other.decode_emitted
        self.drafted += other.drafted
        self.draft_nodes += other.draft_nodes
        self.accepted += other.accepted
        self.emitted += other.emitted
        for i, (d, a) in enumerate(zip(other.drafted_per_position, other.accepted_per_position)):
            if i == len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            self.drafted_per_position[i] += d
            self.accepted_per_position[i] += a

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_per_position(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_accepted_length(self) -> float | None:
        return mean_accepted_length(self.decode_emitted, self.decode_steps)

    @property
    def tokens_per_s(self) -> float | None:
        return self.emitted / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "decode_emitted": self.decode_emitted,
            "drafted": self.drafted,
            "draft_nodes": self.draft_nodes,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_position": self.accepted_per_position,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_s": self.tokens_per_s,
            "wall_s": self.wall_s,
            "draft_s": self.draft_s,
            "target_s": self.target_s,
        }

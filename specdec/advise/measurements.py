"""What `advise` measured, as plain data: the input of every decision (decide.py) and every page
(render.py), and what `measurements.json` holds. Tests build these tables by hand.

Speedups are per-prompt ratios of tokens/s to plain decoding of the same target on the same prompt
in the same run (medians over prompts); plain's speed is interpolated between its two runs, which
bracket each round. `noise` is how much plain decoding varies against itself from round to round:
differences within it are not differences.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields


@dataclass
class Option:
    """One speculative configuration as measured: a drafter at one gamma (or its tree)."""

    name: str  # "specdec/eagle/4"
    drafter: str
    gamma: int
    per_prompt: dict[str, float]  # task id -> speedup vs plain on that prompt
    tokens_per_s: float  # median over prompts
    alpha: float | None = None  # acceptance rate
    tau: float | None = None  # mean accepted length (tokens per decode step)
    c: float | None = None  # cost coefficient: draft seconds per drafted token / t(1)
    verified_per_step: float = 0.0  # draft tokens (tree nodes) verified per step
    step_cost: float | None = None  # seconds of an average step / t(1): the tau at which it breaks even
    memory_mb: float = 0.0  # the drafter's own weights and per-row state
    lossless: bool | None = None  # greedy: every output equal to plain decoding's
    batch_speedup: dict[int, float] = field(default_factory=dict)  # rows decoded together -> throughput vs plain
    options: dict = field(default_factory=dict)  # drafter options it ran with (tree_nodes, ...)

    @property
    def speedup(self) -> float:
        return statistics.median(self.per_prompt.values()) if self.per_prompt else 0.0

    @property
    def spread(self) -> tuple[float, float]:
        """(p25, p75) of the per-prompt speedups."""
        values = sorted(self.per_prompt.values())
        if len(values) < 2:
            return (self.speedup, self.speedup)
        q = statistics.quantiles(values, n=4, method="inclusive")
        return (q[0], q[2])


@dataclass
class Measurements:
    model: str
    device: str
    dtype: str
    kernels: str
    task: str
    greedy: bool
    num_prompts: int
    plain_tokens_per_s: float  # median over prompts
    output_tokens: float  # median tokens per answer (plain decoding, capped by max_new_tokens)
    prefill_ms: float  # one forward over a median-length prompt
    threshold_ms: float  # decode time per answer below which decode is not the bottleneck
    noise: float  # relative spread of plain decoding against itself
    options: list[Option]
    concurrency: list[int]  # the loads the user asked about
    batch_plain_tokens_per_s: dict[int, float] = field(default_factory=dict)
    budget_s: float = 0.0
    elapsed_s: float = 0.0
    environment: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ms_per_token(self) -> float:
        return 1e3 / self.plain_tokens_per_s

    @property
    def decode_ms(self) -> float:
        """Plain decode time of a typical answer."""
        return self.ms_per_token * self.output_tokens

    def finalists(self) -> list[Option]:
        """The configurations measured on every prompt of the run: only they are compared (one dropped
        after the first prompts is shown, but a median over other prompts is no match for theirs)."""
        most = max((len(o.per_prompt) for o in self.options), default=0)
        return [o for o in self.options if len(o.per_prompt) == most]

    def best(self) -> Option | None:
        return max(self.finalists(), key=lambda o: o.speedup, default=None)

    def best_per_drafter(self, options: list[Option] | None = None) -> list[Option]:
        """Each drafter's fastest configuration among `options` (default: the finalists), fastest first."""
        best: dict[str, Option] = {}
        for o in self.finalists() if options is None else options:
            if o.drafter not in best or o.speedup > best[o.drafter].speedup:
                best[o.drafter] = o
        return sorted(best.values(), key=lambda o: -o.speedup)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["schema"] = "specdec.advise/1"
        for o, d in zip(self.options, out["options"]):
            d["speedup"], d["speedup_p25_p75"] = o.speedup, list(o.spread)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Measurements":
        known = {f.name for f in fields(Option)}
        options = [Option(**{k: v for k, v in o.items() if k in known}) for o in data["options"]]
        for o in options:
            o.batch_speedup = {int(k): v for k, v in o.batch_speedup.items()}
        kept = {f.name for f in fields(cls)} - {"options"}
        m = cls(options=options, **{k: v for k, v in data.items() if k in kept})
        m.batch_plain_tokens_per_s = {int(k): v for k, v in m.batch_plain_tokens_per_s.items()}
        return m

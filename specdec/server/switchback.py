"""`specdec bench-serve --switchback SECONDS`: the policies compared in turns within one continuous load.

Levels run one after another compare each policy with the machine as it was during its own level. On a
shared 2-core VM a level's wall varied by up to 12 % from one level to the next for identical work (the
same steps, tokens and prefills), so a median of four level ratios could not tell 1.00 from 0.97. Here,
at each concurrency, the clients keep the server loaded without a pause while the policies take turns of
SECONDS each, switched through /admin/spec-policy. Round r runs every policy once, in the given order in
even rounds and reversed in odd ones (bench.policy_order), so that a drift within a round favours no
policy. Drift slower than a round cancels in the ratios.

A turn's throughput: the tokens the server emitted during it (specdec_generation_tokens_total, read from
/metrics at its start and end) over its seconds. A turn starts once SETTLE_STEPS steps have been read
after the switch (`settle`): the step the old policy had in flight, and on a GPU the one queued behind it.
Counted in the next turn, such a step gave that turn a step of the policy before: on the 2-core CPU at
16 clients one gamma-4 step of `on` (about 0.2 s, five plain steps) in 8 of `cost`'s 16 turns and 3 of
`off`'s. The first SECONDS after the clients start (the load ramping up) are not timed. Per policy and
concurrency: its tokens over its seconds; against a baseline (`off`, and for `cost` also `on`), the ratio
of those, the median of the rounds' own ratios, and a 95 % bootstrap interval over rounds
(BOOTSTRAP_RESAMPLES resamples of the rounds, seeded).

The same ratios over decode steps alone ("steps": the tokens steps emitted, not a prompt's first token,
over the decode thread's time on steps, host and waiting for the device): a prefill costs the same under
every policy, but how many a turn holds moves its throughput (on the 2-core CPU at 16 clients a 5-s turn
of plain steps ranged over 106-191 tok/s with it), and this ratio leaves that out. Since prefills per
token do not depend on the policy, it lies on the same side of 1 as the throughput ratio, farther from
it. A diagnostic: the targets judge throughput.

`--control` adds an A/A comparison: each round runs `off` a second time, as CONTROL, compared with `off` as
the other policies are. The two run the same steps, so how far their ratio lands from 1.0, and its interval, show
what the harness alone does to a ratio at this load. On a 2-core AMD EPYC (EAGLE, native default model, 16
rounds of 5 s) it gave 0.994 (0.944-1.045) at 4 clients and 0.983 (0.955-1.015) at 16, beside `cost` / `off`
0.977 (0.937-1.020) and 0.979 (0.895-1.067) with every `cost` step a plain one, as `off`'s. The cost/off
target's line quotes it.

Not measured here: TTFT and request latencies (a request spans turns); plain bench-serve levels measure
them. Carried over a switch: a drafter's state (EAGLE catches up on the tokens a plain turn emitted when
drafting resumes, which `cost` pays too when it resumes drafting on its own), and what `cost` learned
(Scheduler.switch_policy).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from specdec.server.bench import (Counts, LoadPlan, TargetCheck, busy_requests, check_requests, cost_checks,
                                  counter_deltas, finish_report, fmt, forget_requests, format_checks, http_client,
                                  markdown_table, metric_total, optional_pyplot, policy_order, results_of, scrape,
                                  server_info, start_streams, steps_by_gamma, switch_policy, warm_wave, wait_for_idle)

BOOTSTRAP_RESAMPLES = 2000
UNBOUNDED = 1 << 30  # requests a load may take: the clients send until the turns are over
GENERATED = "specdec_generation_tokens_total"
FIRSTS = "specdec_time_to_first_token_seconds_count"
STEP_PARTS = ("host", "wait")  # the decode thread's time on steps (server/metrics.DECODE_PARTS)
MEASURES = ("throughput", "steps")  # what compare() compares (amounts)
CONTROL = "off-control"  # --control: `off` again under a name of its own (module docstring)
SETTLE_STEPS = 2  # steps read after a switch before a turn starts (the module docstring)
SETTLE_POLL_S = 0.01  # how often `settle` reads /metrics
SETTLE_MOST_S = 2.0  # a server taking no step meanwhile (idle, or reading prompts) starts the turn anyway
STEPS = "specdec_steps_by_gamma_total"


@dataclass
class Turn:
    policy: str
    concurrency: int
    round: int
    start_s: float  # since the load's clients started
    seconds: float
    tokens: int  # emitted by the server during the turn
    steps_by_gamma: dict[int, int] = field(default_factory=dict)
    step_tokens: int = 0  # of them, emitted by decode steps (not a prompt's first token)
    step_seconds: float = 0.0  # the decode thread's time on steps (host and waiting for the device)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Load:
    """One concurrency's continuous load: its turns, and what became of the requests sent meanwhile."""

    concurrency: int
    turns: list[Turn]
    requests: int
    ok: int
    disconnected: int
    rows_freed: bool  # after the load: no request running or waiting on the server
    errors: list[str] = field(default_factory=list)  # the first few

    @property
    def lost(self) -> int:
        return self.requests - self.ok - self.disconnected


@dataclass(frozen=True)
class Comparison:
    """A policy's turns against a baseline's at one concurrency."""

    policy: str
    baseline: str
    concurrency: int
    measure: str  # "throughput" or "steps" (amounts)
    rounds: int
    ratio: float  # (policy tokens / seconds) / (baseline tokens / seconds), over every round
    paired: float  # the median of the rounds' own ratios
    low: float  # 95 % bootstrap interval of `ratio` over rounds
    high: float


def switched_to(label: str) -> str:
    """The policy a turn labelled `label` runs (CONTROL runs `off`)."""
    return "off" if label == CONTROL else label


async def run_switchback(url: str, headers: dict, model: str, prompts: list[str], plan: LoadPlan, concurrency: int,
                         seconds: float, progress, labels: tuple[str, ...]) -> Load:
    """Every round's turns at one concurrency, under one continuous load (module docstring); `labels`: the turns
    of a round, the policies and CONTROL where asked."""
    async with http_client(url, headers, concurrency) as client:
        for policy in plan.policies:  # a wave under each: the bucket's graphs for every policy's gammas
            await asyncio.to_thread(switch_policy, url, headers, policy, plan.threshold)
            await warm_wave(client, model, prompts, plan, concurrency)
        await wait_for_idle(client)
        await forget_requests(client)  # the turns share what it learns from here on, as one server's load would
        counts = Counts(mp.get_context("spawn"))
        streams = await start_streams(client, url, headers, model, prompts, plan, UNBOUNDED, concurrency, counts)
        t0 = streams.t0
        await asyncio.sleep(seconds)  # the load ramps up
        turns = []
        for r in range(plan.repeats):
            for label in policy_order(labels, r):
                await asyncio.to_thread(switch_policy, url, headers, switched_to(label), plan.threshold)
                before, start = await settle(client)
                await asyncio.sleep(seconds)
                after, end = await scrape(client), time.monotonic()
                turns.append(measure_turn(label, concurrency, r, start - t0, end - start, before, after))
                progress.update(1)
        sent = counts.stop()
        results = results_of(await streams.done, sent)
        running, waiting = busy_requests(await wait_for_idle(client))
    good = sum(r.outcome == "ok" for r in results)
    return Load(concurrency, turns, len(results), good, sum(r.outcome == "disconnected" for r in results),
                running == 0 and waiting == 0, [f"[{r.sampling}] {r.error}" for r in results if r.outcome == "failed"][:5])


async def settle(client) -> tuple[dict[str, float], float]:
    """(/metrics, time.monotonic()) once SETTLE_STEPS steps have been read since the call (a switch), so that
    the steps counted from there on are the new policy's; at most SETTLE_MOST_S later."""
    first = await scrape(client)
    start = time.monotonic()
    metrics, now = first, start
    while steps_read(metrics) - steps_read(first) < SETTLE_STEPS and now - start < SETTLE_MOST_S:
        await asyncio.sleep(SETTLE_POLL_S)
        metrics, now = await scrape(client), time.monotonic()
    return metrics, now


def steps_read(metrics: dict[str, float]) -> int:
    return int(metric_total(metrics, STEPS) or 0)  # none before the server's first step


def measure_turn(policy: str, concurrency: int, round: int, start_s: float, seconds: float,
                 before: dict[str, float], after: dict[str, float]) -> Turn:
    """A turn from the server's /metrics at its start and end."""
    tokens = int(after[GENERATED] - before[GENERATED])
    firsts = int(after[FIRSTS] - before[FIRSTS])  # a prompt's first token, one a request
    thread = counter_deltas(before, after, "specdec_decode_thread_seconds_total", "part", float)
    on_steps = sum(thread.get(part, 0.0) for part in STEP_PARTS)
    return Turn(policy, concurrency, round, start_s, seconds, tokens, steps_by_gamma(before, after), tokens - firsts, on_steps)


def run_switchbacks(url: str, key: str | None, prompts: list[str], plan: LoadPlan, seconds: float,
                    control: bool = False) -> tuple[dict, list[Load]]:
    """A continuous load per concurrency against the server at url; (server /health, loads). control: each
    round runs `off` once more, as CONTROL (module docstring)."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model, health = server_info(url, headers)
    if plan.client_processes is None and not str(health.get("device", "")).startswith("cuda"):
        plan = replace(plan, client_processes=1)  # as run_load: a CPU server sends far less than one process parses
    labels = plan.policies + ((CONTROL,) if control else ())
    loads = []
    with tqdm(total=len(plan.concurrency) * plan.repeats * len(labels), unit="turn", desc="bench-serve") as progress:
        for c in plan.concurrency:
            progress.set_postfix_str(f"c={c}")
            loads.append(asyncio.run(run_switchback(url, headers, model, prompts, plan, c, seconds, progress, labels)))
    return health, loads


def amounts(turn: Turn, measure: str) -> tuple[float, float]:
    """(tokens, seconds) of a turn as `measure` counts them: "throughput", everything over the turn's wall;
    "steps", the decode steps' tokens over the decode thread's time on steps."""
    return (turn.tokens, turn.seconds) if measure == "throughput" else (turn.step_tokens, turn.step_seconds)


def compare(turns: list[Turn], policy: str, baseline: str, concurrency: int, measure: str = "throughput",
            seed: int = 0) -> Comparison | None:
    """`policy` against `baseline` over the rounds where both ran at this concurrency, by `measure` (amounts)."""
    by_round: dict[int, dict[str, Turn]] = {}
    for t in turns:
        if t.concurrency == concurrency:
            by_round.setdefault(t.round, {})[t.policy] = t
    pairs = [(r[policy], r[baseline]) for r in by_round.values()
             if policy in r and baseline in r and all(min(amounts(t, measure)) > 0 for t in (r[policy], r[baseline]))]
    if not pairs:
        return None
    x = np.array([[*amounts(a, measure), *amounts(b, measure)] for a, b in pairs], dtype=float)  # [rounds, 4]

    def ratio(rows: np.ndarray) -> np.ndarray:  # rows [..., rounds, 4] -> [...]
        s = rows.sum(axis=-2)
        return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])

    picks = np.random.default_rng(seed).integers(0, len(x), (BOOTSTRAP_RESAMPLES, len(x)))  # [resamples, rounds]
    low, high = np.percentile(ratio(x[picks]), [2.5, 97.5])
    paired = float(np.median(x[:, 0] / x[:, 1] / (x[:, 2] / x[:, 3])))
    return Comparison(policy, baseline, concurrency, measure, len(x), float(ratio(x)), paired, float(low), float(high))


def comparisons(loads: list[Load]) -> list[Comparison]:
    """Every policy against `off`, and `cost` against `on` too, per concurrency (where they ran), by each measure."""
    out = []
    for load in loads:
        policies = list(dict.fromkeys(t.policy for t in load.turns))
        pairs = [(p, "off") for p in policies if p != "off"] + ([("cost", "on")] if {"cost", "on"} <= set(policies) else [])
        out += [c for p, b in pairs for measure in MEASURES
                if (c := compare(load.turns, p, b, load.concurrency, measure)) is not None]
    return out


def check_switchbacks(loads: list[Load]) -> list[TargetCheck]:
    """Issue 13's `cost` targets on the turns' ratios (over every round), and no request lost or left running.
    Where the load ran CONTROL, the cost/off line quotes its A/A ratio and interval."""
    found = {(c.policy, c.baseline, c.concurrency): c for c in comparisons(loads) if c.measure == "throughput"}
    checks = []
    for load in loads:
        c = load.concurrency
        off, on, aa = found.get(("cost", "off", c)), found.get(("cost", "on", c)), found.get((CONTROL, "off", c))
        if off is not None:
            mine = cost_checks(c, off.ratio, on.ratio if on is not None else None)
            if aa is not None:
                mine[0] = replace(mine[0], note=f"A/A control, off against itself: {aa.ratio:.3f} "
                                                f"(95 % {aa.low:.3f}-{aa.high:.3f})")
            checks += mine
    return checks + check_requests(loads, "loads")


def format_comparisons(loads: list[Load]) -> str:
    """Per concurrency and policy: tokens/s over its turns, and its ratios against the baselines."""
    rows = []
    found = comparisons(loads)
    for load in loads:
        for policy in dict.fromkeys(t.policy for t in load.turns):
            mine = [t for t in load.turns if t.policy == policy]
            steps: dict[int, int] = {}
            for t in mine:
                for g, n in t.steps_by_gamma.items():
                    steps[g] = steps.get(g, 0) + n
            rate = sum(t.tokens for t in mine) / sum(t.seconds for t in mine)
            against = [c for c in found if (c.policy, c.concurrency) == (policy, load.concurrency)]
            rows.append([str(load.concurrency), policy, str(len(mine)), fmt(rate),
                         *("; ".join(f"{c.ratio:.3f} (paired {c.paired:.3f}, 95 % {c.low:.3f}-{c.high:.3f}) vs {c.baseline}"
                                     for c in against if c.measure == measure) or "-" for measure in MEASURES),
                         ", ".join(f"{g}: {n}" for g, n in sorted(steps.items())) or "-"])
    return markdown_table(["concurrency", "policy", "turns", "tokens/s", "ratio to baseline",
                           "steps' tokens per step second, ratio", "steps by gamma"], rows)


def request_line(loads: list[Load]) -> str:
    return (f"{sum(load.requests for load in loads)} requests: {sum(load.ok for load in loads)} ok, "
            f"{sum(load.disconnected for load in loads)} disconnected, {sum(load.lost for load in loads)} lost or malformed")


def write_switchback_report(out: Path, config: dict, hw: dict, loads: list[Load], seconds: float) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    checks = check_switchbacks(loads)
    results = {"config": {**config, "switchback_s": seconds}, "hardware": hw,
               "loads": [{**asdict(load), "lost": load.lost} for load in loads],
               "comparisons": [asdict(c) for c in comparisons(loads)], "targets": [asdict(c) for c in checks]}
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(results, indent=2))
    plot = plot_turns(loads, out / "turns.png")
    md = ["# specdec bench-serve, policies in turns", "",
          f"Server device: {hw['server_device']}; client CPU: {hw['cpu']} ({hw['cpu_cores']} cores); torch {hw['torch']}.",
          f"Model {config['model']}, drafter {config['drafter']}, gamma {config['gamma']}, max_tokens {config['max_tokens']}, "
          f"task {config['task']}.", "",
          f"At each concurrency the clients kept the server loaded while the policies took turns of {seconds:g} s, "
          f"{config['repeats']} rounds, each round in the given order or reversed (alternately). A turn's throughput is "
          "the tokens the server emitted during it over its seconds. Ratios: over every round (tokens over seconds), the "
          "median of the rounds' own ratios (paired), and a 95 % bootstrap interval over rounds. The steps' ratio "
          "compares decode steps alone (the tokens they emitted over the decode thread's time on them: prefills and idle "
          "time left out), which the number of prefills a turn happens to hold does not move; a diagnostic, the "
          "targets judge throughput.", "",
          *([f"`{CONTROL}` runs `off` again under its own name: its ratio to `off` (an A/A comparison) shows how far "
             "the harness alone moves a ratio here.", ""] if any(t.policy == CONTROL for load in loads for t in load.turns)
            else []),
          format_comparisons(loads), "", "## Targets (issue 13), from the turns", "", *format_checks(checks), "",
          "## Requests", "", request_line(loads) + ".",
          *[f"- c={load.concurrency}: {e}" for load in loads for e in load.errors], ""]
    return finish_report(paths, md, plot, "tokens/s of each turn")


def plot_turns(loads: list[Load], path: Path) -> Path | None:
    """Each turn's tokens/s against its start, per concurrency (a panel each), coloured by policy: drift shows."""
    plt = optional_pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(len(loads), 1, figsize=(7, 2.4 * len(loads)), squeeze=False)
    for ax, load in zip(axes[:, 0], loads):
        for policy in dict.fromkeys(t.policy for t in load.turns):
            mine = [t for t in load.turns if t.policy == policy]
            ax.plot([t.start_s for t in mine], [t.tokens_per_s for t in mine], marker="o", ms=3, lw=0.8, label=policy)
        ax.set_title(f"{load.concurrency} clients", fontsize=9)
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the load started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

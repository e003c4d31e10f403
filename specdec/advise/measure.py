"""`advise`'s measurements, within a time budget, on the user's prompts and hardware.

It is a budgeted `specdec bench` (same Runner, records and summaries, bench/runner.py) plus what
decisions need beyond a bench:
- rounds: every method runs on one prompt per round, interleaved (A B C A B C ...), and rounds go on
  while the budget allows (the last round is kept only if it finished). Plain decoding runs twice
  per round, first and last: a method's baseline is plain's speed interpolated between the two at its
  place in the round (a drift within the round favours nobody), and how their ratio varies from round
  to round is this machine's timing noise;
- fitting the budget: after the first round, when the rest of the budget cannot give every configuration
  MIN_ROUNDS prompts, the ones slowest on the first prompt are measured no further (peers first, then
  a drafter's extra gammas, then whole drafters);
- screening: from the second round on, a configuration whose best prompt is slower than the leader's
  worst is dropped (it keeps the prompts it has), so the budget goes to the contenders;
- load: for the configuration the decision tree would pick (and the fastest, if another), rows
  decoded together at each asked concurrency, plain and speculative: decode throughput ratios per
  batch size (prefill excluded), from which decide.py finds where speculation stops paying;
- costs: r(k) at the run's context length, c per drafter, the prefill time of a median prompt.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from specdec.advise.decide import build_tree
from specdec.advise.measurements import Measurements, Option
from specdec.bench.runner import (
    PLAIN,
    BenchConfig,
    Method,
    RunRecord,
    Runner,
    calibrate,
    environment,
    label_by_what_runs,
    summarize,
)
from specdec.bench.tasks import is_correct, load_tasks
from specdec.config import SamplingParams, SpecConfig
from specdec.costs import measure_forward_times, synchronize
from specdec.drafters import DRAFTERS
from specdec.errors import UserError
from specdec.models.loading import DEFAULT_MODEL

AGAIN = "specdec/none/again"  # plain decoding's second run per round: the noise reference
GAMMAS = {"ngram": (2, 4), "layer_skip": (2, 4), "quantized": (2, 4), "draft_model": (2, 4), "lookahead": (4,),
          "medusa": (3,), "eagle": (3, 5)}
LOAD_TOKENS = 64  # new tokens per row when measuring decode throughput at a batch size
WARMUP_TOKENS = 8  # enough to compile kernels and capture graphs
CPU_BUDGET_S, GPU_BUDGET_S = 300.0, 60.0
MIN_ROUNDS = 3  # prompts every kept configuration should get within the budget
RESERVE = 0.2  # of the budget, kept for the load and cost measurements after the rounds


@dataclass(frozen=True)
class AdviseConfig:
    task: str = "gsm8k-eval"
    limit: int = 10  # the most prompts; the budget may end the rounds sooner
    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"
    gguf: str = "auto"
    drafters: tuple[str, ...] | None = None  # default: every drafter that can run for this target
    peers: tuple[str, ...] = ()  # hf / llamacpp alongside, on the same budget
    concurrency: tuple[int, ...] = (1, 8, 32)
    budget_s: float | None = None  # default: CPU_BUDGET_S on a CPU, GPU_BUDGET_S on a GPU
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    threshold_ms: float = 100.0
    chat: bool = True

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise UserError(f"--limit must be >= 1, got {self.limit}")
        if self.budget_s is not None and self.budget_s <= 0:
            raise UserError(f"--budget-s must be > 0, got {self.budget_s}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise UserError(f"--concurrency needs positive numbers of clients, got {list(self.concurrency)}")
        if self.threshold_ms <= 0:
            raise UserError(f"--threshold-ms must be > 0, got {self.threshold_ms}")
        unknown = [d for d in self.drafters or () if d not in DRAFTERS or d == "none"]
        if unknown:
            raise UserError(f"unknown drafter(s) {unknown}; choose from {sorted(set(DRAFTERS) - {'none'})}")


@dataclass
class Clock:
    budget_s: float
    start: float = field(default_factory=time.perf_counter)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed


def plan(drafters: list[str]) -> list[Method]:
    methods = [Method(PLAIN, "specdec", "none", 0)]
    for d in drafters:
        methods += [Method(f"specdec/{d}/{g}", "specdec", d, g) for g in GAMMAS.get(d, (4,))]
    return methods + [Method(AGAIN, "specdec", "none", 0)]  # plain first and last: they bracket each round


def add_engines(runner: Runner, methods: list[Method], notes: list[str]) -> list[Method]:
    """Build each drafter's engine; a drafter that cannot run for this target is left out with a note."""
    kept, failed = [], set()
    for m in methods:
        if m.drafter in failed:
            continue
        try:
            runner.add(m)
            kept.append(m)
        except UserError as e:
            failed.add(m.drafter)
            notes.append(f"{m.drafter}: not measured ({e})")
    return kept


def drafter_memory_mb(engine, target) -> float:
    """MiB of weights the drafter holds beyond the target's own (shared layers count nothing)."""
    own = {p.data_ptr() for p in target.parameters()} | {b.data_ptr() for b in target.buffers()}
    seen: dict[int, int] = {}
    for value in vars(engine.drafter).values():
        if isinstance(value, torch.nn.Module):
            for t in list(value.parameters()) + list(value.buffers()):
                if t.data_ptr() not in own:
                    seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values()) / 2**20


def run_round(runner: Runner, methods: list[Method], task, prompt: list[int], max_new_tokens: int, bar,
              clock: Clock, first: bool) -> list[RunRecord] | None:
    """Every method once on one prompt; None when the budget ran out mid-round (the round is dropped).
    The first round always finishes: without it there is nothing to advise from."""
    records = []
    for method in methods:
        if clock.left <= 0 and not first:
            return None
        bar.set_postfix_str(method.name)
        ids, wall, stats = runner.run(method, prompt, max_new_tokens)
        text = runner.decode(ids)
        records.append(RunRecord(method=method.name, task_id=task.id, category=task.category, repeat=0,
                                 num_tokens=len(ids), wall_s=wall, tokens_per_s=len(ids) / wall if wall > 0 else 0.0,
                                 token_ids=ids, text=text, stats=stats,
                                 correct=is_correct(text, task.reference) if task.reference else None))
        bar.n = min(round(clock.elapsed), bar.total)
        bar.refresh()
    return records


def fit_budget(methods: list[Method], seconds: dict[str, float], speedup: dict[str, float], available_s: float,
               rounds: int, notes: list[str]) -> list[Method]:
    """After the first round: drop methods until `rounds` more rounds fit in the time available (each
    method's time from the first round). Peers go first, then a drafter's extra gammas, then whole
    drafters, each time the configuration slowest against plain on the first prompt. Plain decoding
    and its repeat always stay, and at least two speculative configurations."""
    kept = list(methods)
    while sum(seconds.get(m.name, 0.0) for m in kept) * rounds > available_s:
        spec = [m for m in kept if m.family == "specdec" and m.drafter != "none"]
        per_drafter = Counter(m.drafter for m in spec)
        peers = [m for m in kept if m.family != "specdec"]
        pools = [[m for m in spec if per_drafter[m.drafter] > 1], spec if len(spec) > 2 else []]
        if peers:
            victim = max(peers, key=lambda m: seconds.get(m.name, 0.0))
        elif pool := next((p for p in pools if p), None):
            victim = min(pool, key=lambda m: speedup.get(m.name, 0.0))  # unmeasured counts as slowest
        else:
            break
        kept.remove(victim)
        first = f", {speedup[victim.name]:.2f}x plain on the first prompt" if victim.name in speedup else ""
        notes.append(f"{victim.name}: measured on one prompt only, to fit {rounds + 1} prompts in the budget{first}")
    return kept


def per_prompt_speedups(records: list[RunRecord], name: str) -> dict[str, float]:
    """Per prompt: tokens/s / plain decoding's at the same point of the round. Plain runs first and last
    in each round; its speed is interpolated linearly between the two by the run's place in the round,
    so a drift within the round (the machine warming, caches) does not favour early or late methods."""
    out = {}
    for task_id, runs in rounds_of(records).items():
        mine = [i for i, r in enumerate(runs) if r.method == name]
        first, last = runs[0], runs[-1]
        if not mine or first.method != PLAIN or first.tokens_per_s <= 0:
            continue
        i = mine[0]
        w = i / (len(runs) - 1) if last.method == AGAIN and len(runs) > 1 else 0.0
        base = first.tokens_per_s * (1 - w) + (last.tokens_per_s if last.method == AGAIN else first.tokens_per_s) * w
        out[task_id] = runs[i].tokens_per_s / base
    return out


def rounds_of(records: list[RunRecord]) -> dict[str, list[RunRecord]]:
    """Each prompt's runs, in the order they ran (one round per prompt)."""
    out: dict[str, list[RunRecord]] = {}
    for r in records:
        out.setdefault(r.task_id, []).append(r)
    return out


def screen(methods: list[Method], records: list[RunRecord], notes: list[str]) -> list[Method]:
    """Drop speculative configurations whose best prompt is slower than the leader's worst."""
    spec = [m for m in methods if m.drafter not in (None, "none")]
    speeds = {m.name: per_prompt_speedups(records, m.name) for m in spec}
    speeds = {k: v for k, v in speeds.items() if v}
    if not speeds:
        return methods
    leader = max(speeds, key=lambda k: statistics.median(speeds[k].values()))
    floor = min(speeds[leader].values())
    dropped = {k for k, v in speeds.items() if k != leader and max(v.values()) < floor}
    for name in sorted(dropped):
        notes.append(f"{name}: dropped after {len(speeds[name])} prompts (every prompt slower than {leader}'s slowest)")
    return [m for m in methods if m.name not in dropped]


def relative_noise(records: list[RunRecord]) -> float:
    """Timing noise of a speedup: how much log(last / first) of plain decoding's two runs, which bracket
    each round, varies from prompt to prompt (1.4826 x its median absolute deviation, one standard
    deviation), halved: a speedup's baseline is interpolated between the two runs, so it is off by about
    half their disagreement. A steady drift is not noise: per_prompt_speedups corrects it. With one
    prompt, half the one ratio's size."""
    logs = [math.log(runs[-1].tokens_per_s / runs[0].tokens_per_s) for runs in rounds_of(records).values()
            if runs[0].method == PLAIN and runs[-1].method == AGAIN and min(runs[0].tokens_per_s, runs[-1].tokens_per_s) > 0]
    if len(logs) < 2:
        return math.exp(abs(logs[0]) / 2) - 1 if logs else 0.0
    mid = statistics.median(logs)
    return math.exp(1.4826 * statistics.median(abs(x - mid) for x in logs) / 2) - 1


def decode_throughput(engine, prompts: list[list[int]], sampling: SamplingParams, gamma: int) -> float:
    """Decode tokens per second of these rows decoded together: a run of LOAD_TOKENS new tokens each,
    less a run of one (the prefill, and a drafter's own pass over the prompts, which short outputs would
    otherwise weigh as heavily as the decoding). On a GPU after one untimed run of the same shapes, which
    captures their graphs."""
    def timed(new_tokens: int) -> tuple[int, float]:
        spec = SpecConfig(gamma=max(gamma, 1), max_new_tokens=new_tokens, sampling=sampling)
        synchronize(engine.device)
        t = time.perf_counter()
        out = engine.generate(prompts, spec)
        synchronize(engine.device)
        return sum(len(r.token_ids) for r in out.rows), time.perf_counter() - t

    if engine.device.type == "cuda":
        timed(LOAD_TOKENS)
    first, prefill_s = timed(1)
    tokens, total_s = timed(LOAD_TOKENS)
    return (tokens - first) / max(total_s - prefill_s, 1e-9)


def measure_load(runner: Runner, options: list[Option], prompts: list[list[int]], concurrency: tuple[int, ...],
                 sampling: SamplingParams, clock: Clock, notes: list[str]) -> dict[int, float]:
    """Plain decode tokens/s per batch size above one; fills each option's batch_speedup, at one row with
    what the rounds measured (the same quantity, over more prompts). Stops when the budget does."""
    plain: dict[int, float] = {}
    plain_engine = runner.by_drafter["none"]
    for o in options:
        o.batch_speedup[1] = o.speedup
    last: tuple[int, float] | None = None  # (rows, seconds) of the previous batch size
    for rows in sorted(set(concurrency) - {1}):
        predicted = 0.0 if last is None else last[1] * rows / last[0]  # at worst linear in rows
        if clock.left <= predicted:
            notes.append(f"load: batch sizes from {rows} rows not measured (the budget would run out)")
            break
        t = time.perf_counter()
        batch = [prompts[i % len(prompts)] for i in range(rows)]
        plain[rows] = decode_throughput(plain_engine, batch, sampling, 0)
        for o in options:
            engine = runner.by_drafter[o.drafter]
            o.batch_speedup[rows] = decode_throughput(engine, batch, sampling, o.gamma) / plain[rows]
        last = (rows, time.perf_counter() - t)
    return plain


def option_of(method: Method, summary: dict, records: list[RunRecord], runner: Runner) -> Option:
    tau, est = summary.get("mean_accepted_length"), summary.get("estimated_speedup_tau")
    engine = runner.engines[method.name]
    return Option(
        name=method.name, drafter=method.drafter, gamma=method.gamma,
        per_prompt=per_prompt_speedups(records, method.name),
        tokens_per_s=summary["tokens_per_s"]["median"], alpha=summary.get("acceptance_rate"), tau=tau,
        c=summary.get("cost_coefficient"), verified_per_step=summary.get("nodes_per_step", 0.0),
        step_cost=tau / est if tau and est else None, memory_mb=drafter_memory_mb(engine, runner.target),
        lossless=summary.get("lossless"), options=drafter_settings(engine),
    )


def drafter_settings(engine) -> dict:
    """The drafter options a configuration ran with that config.json must carry (EAGLE's tree size)."""
    tree = getattr(engine.drafter, "tree", None)
    total = getattr(tree, "total_tokens", None)
    return {"tree_nodes": total} if engine.drafter.name == "eagle" and total else {}


def prefill_ms(target, prompts: list[list[int]]) -> float:
    prompt = sorted(prompts, key=len)[len(prompts) // 2]
    return measure_forward_times(target, prompt[:1], [max(len(prompt) - 1, 1)], repeats=3)[max(len(prompt) - 1, 1)] * 1e3


def default_budget(device: torch.device) -> float:
    return GPU_BUDGET_S if device.type == "cuda" else CPU_BUDGET_S


def candidate_drafters(config: AdviseConfig, device: torch.device) -> list[str]:
    if config.drafters:
        return list(config.drafters)
    return [d for d in GAMMAS if d in DRAFTERS and not (d == "quantized" and device.type != "cpu")]


def measure(config: AdviseConfig, progress: bool = True) -> Measurements:
    """Run the budgeted measurements; see the module docstring."""
    clock = Clock(config.budget_s or CPU_BUDGET_S)
    tasks = load_tasks(config.task, config.limit)
    bench = BenchConfig(task=config.task, limit=config.limit, model=config.model, drafters=(), peers=config.peers,
                        max_new_tokens=config.max_new_tokens, sampling=config.sampling, dtype=config.dtype,
                        device=config.device, kernels=config.kernels, gguf=config.gguf, chat=config.chat)
    peers = [Method(p, p) for p in config.peers if p in ("hf", "llamacpp")]
    runner = Runner(bench, peers)
    if config.budget_s is None:
        clock.budget_s = default_budget(runner.device)
    notes: list[str] = [f"{p}: not run by advise (only hf and llamacpp are)" for p in config.peers
                        if p not in ("hf", "llamacpp")]
    methods = add_engines(runner, plan(candidate_drafters(config, runner.device)), notes) + peers
    methods, relabelled = label_by_what_runs(methods, runner.engines)
    notes += relabelled
    prompts = [runner.encode(t) for t in tasks]
    phases = {"load_s": clock.elapsed}  # where the budget went
    planned = list(methods)  # screening drops from `methods`; what it dropped keeps its prompts

    for method in tqdm(methods, desc="warm-up", disable=not progress, leave=False):
        runner.run(method, prompts[0], min(WARMUP_TOKENS, config.max_new_tokens))

    phases["warmup_s"] = clock.elapsed - phases["load_s"]
    reserve = RESERVE * clock.budget_s  # load and cost measurements after the rounds
    records: list[RunRecord] = []
    round_s = 0.0
    with tqdm(total=round(clock.budget_s), desc="advise", unit="s", disable=not progress) as bar:
        for i, (task, prompt) in enumerate(zip(tasks, prompts)):
            if i and clock.left - reserve < round_s:
                notes.append(f"rounds: stopped after {i} of {len(tasks)} prompts (budget)")
                break
            done = run_round(runner, methods, task, prompt, config.max_new_tokens, bar, clock, first=i == 0)
            if done is None:
                notes.append(f"rounds: prompt {i + 1} dropped unfinished (budget)")
                break
            records += done
            if i == 0:
                seconds = {r.method: r.wall_s for r in done}
                first = {m.name: v for m in methods if (v := per_prompt_speedups(done, m.name).get(task.id))}
                methods = fit_budget(methods, seconds, first, clock.left - reserve, min(MIN_ROUNDS, len(tasks)) - 1,
                                     notes)
            else:
                methods = screen(methods, records, notes)
            round_s = sum(r.wall_s for r in done if r.method in {m.name for m in methods})

        phases["rounds_s"] = clock.elapsed - sum(phases.values())
        ran = {r.method for r in records}
        measured = [m for m in planned if m.family == "specdec" and m.name != AGAIN and m.name in ran]
        calibration = calibrate(runner, prompts, records, measured)  # r(k) up to the widest that ran, screened or not
        greedy = config.sampling.greedy
        options = [option_of(m, summarize(m, records, calibration, greedy), records, runner)
                   for m in planned if m.drafter not in (None, "none") and m.name in ran]
        plain = summarize(planned[0], records, calibration, greedy)
        m = Measurements(
            model=config.model, device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            kernels=environment(runner)["kernels"]["name"], task=config.task, greedy=greedy,
            num_prompts=len({r.task_id for r in records}),
            plain_tokens_per_s=plain["tokens_per_s"]["median"],
            output_tokens=statistics.median(r.num_tokens for r in records if r.method == PLAIN),
            prefill_ms=prefill_ms(runner.target, prompts), threshold_ms=config.threshold_ms,
            noise=relative_noise(records), options=options, concurrency=list(config.concurrency),
            budget_s=clock.budget_s, environment=environment(runner), notes=notes,
        )
        m.environment["verify_ratio"] = {int(k): v for k, v in calibration["verify_ratio"].items()}
        m.environment["context_len"] = calibration["context_len"]
        m.environment["peers"] = {p.name: summarize(p, records, calibration, greedy)["speedup_vs_plain"]["median"]
                                  for p in peers if any(r.method == p.name for r in records)}
        bar.set_postfix_str("load")
        m.batch_plain_tokens_per_s = measure_load(runner, load_options(m), prompts, config.concurrency,
                                                  config.sampling, clock, notes)
        bar.n = min(round(clock.elapsed), bar.total)
        bar.refresh()
    phases["costs_and_load_s"] = clock.elapsed - sum(phases.values())
    m.elapsed_s = clock.elapsed
    m.environment["phases"] = phases
    return m


def load_options(m: Measurements) -> list[Option]:
    """The configurations whose batch scaling decides: the one the tree picks, and the fastest."""
    tree = build_tree(replace(m, concurrency=[1]))
    picks = [tree.recommendation.option] if tree.recommendation and tree.recommendation.option else []
    best = m.best()
    if best is not None and best not in picks:
        picks.append(best)
    return picks

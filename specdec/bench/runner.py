"""`specdec bench`: every method on the same prompts, in the same run, interleaved.

For each prompt (and repeat) the methods run one after another (A B C A B C ...) after a warm-up,
so machine drift hits them alike. Methods: plain decoding through specdec (`specdec/none`, the
baseline), each drafter x gamma (`specdec/ngram/4`), and peers (`hf`, `hf-pld/4`, `hf-assisted/4`,
`llamacpp`, `llamacpp-pld/4`). Per method it reports tokens/s (median over prompts, with quartiles),
the measured speedup (median over prompts of the per-prompt ratio to specdec/none and to hf),
acceptance, tau, the measured cost coefficient c and verify ratio r, the estimated speedups, whether
every greedy output equals plain greedy decoding, and GSM8K accuracy where references exist.
`openai:URL` peers (specdec/bench/peers.py) send the same prompts' token ids to an OpenAI-compatible
server and add the server's own spec-decode counters over the bench's requests (`server_spec_decode`).
"""

from __future__ import annotations

import platform
import statistics
import sys
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.analysis.speedup import estimated_speedup, estimated_speedup_from_tau
from specdec.costs import (
    copy_bandwidth,
    cost_coefficient,
    interpolate,
    measure_forward_times,
    verify_ratios,
    weight_bytes_per_forward,
)
from specdec.api import encode_prompt
from specdec.bench.peers import (OPENAI, PEERS, HFPeer, LlamaCppPeer, OpenAIPeer, is_openai_peer, llama_cpp_available,
                                  parse_openai_peer, spec_decode_delta)
from specdec.bench.tasks import Task, is_correct, load_tasks
from specdec.adaptive import POLICIES
from specdec.config import SamplingParams, spec_config_for
from specdec.drafters import DRAFTERS, DrafterOptions
from specdec.drafters.base import forget_requests, learns_across_requests
from specdec.drafters.draft_model import is_shared_draft, load_draft
from specdec.drafters.suffix import parse_options
from specdec.engine import SpecEngine
from specdec.errors import UserError
from specdec.models import load_model
from specdec.models import cpu_gemm
from specdec.models.kernels import draft_kernel_path, kernel_path
from specdec.models.loading import DEFAULT_MODEL, hf_folder, resolve_gguf
from specdec.models.tensor_parallel import join_group
from specdec.metrics import mean_accepted_length

PLAIN = "specdec/none"


@dataclass(frozen=True)
class BenchConfig:
    task: str = "gsm8k-eval"
    limit: int | None = 20
    model: str = DEFAULT_MODEL
    drafters: tuple[str, ...] = ("ngram",)
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    peers: tuple[str, ...] = ("hf", "hf-pld")
    pld_gammas: tuple[int, ...] | None = None  # prompt-lookup sizes for hf-pld / llamacpp-pld (default: gammas)
    draft_gguf: str | None = None  # a draft GGUF for the llamacpp-draft peer
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    repeats: int = 1
    draft_model: str | None = None
    drafter_extra: dict = field(default_factory=dict)  # DrafterOptions.extra: eagle_path, medusa_path, layers, window...
    dtype: str = "auto"
    kernels: str = "auto"  # exact | library | auto (see specdec/models/kernels.py)
    gguf: str = "auto"  # native | dequantize | auto: how a GGUF target runs (see specdec/models/loading.py)
    device: str = "auto"
    chat: bool = True
    ngram_max: int = 3
    ngram_min: int = 1
    policies: tuple[str, ...] = ()  # adaptive-gamma policies, each added per drafter as specdec/<d>/auto-<policy>
    gamma_max: int = 8
    confidence_threshold: float = 0.4
    tp: int = 1  # tensor-parallel ranks of the target (run under torchrun, or `specdec bench --tp N`)

    def __post_init__(self) -> None:
        if not self.gammas or min(self.gammas) < 1:
            raise UserError(f"gammas must be >= 1, got {list(self.gammas)}")
        if self.repeats < 1:
            raise UserError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        unknown = [d for d in self.drafters if split_variant(d)[0] not in DRAFTERS]
        if unknown:
            raise UserError(f"unknown drafter(s) {unknown}; choose from {sorted(DRAFTERS)}")
        bad_policies = [p for p in self.policies if p not in POLICIES or p == "fixed"]
        if bad_policies:
            raise UserError(f"unknown gamma policy(ies) {bad_policies}; choose from heuristic, confidence, cost")
        bad_peers = [p for p in self.peers if p not in PEERS and not is_openai_peer(p)]
        if bad_peers:
            raise UserError(f"unknown peer(s) {bad_peers}; choose from {list(PEERS)} or openai:URL")
        labels = [parse_openai_peer(p).label for p in self.peers if is_openai_peer(p)]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise UserError(f"peer(s) {twice} given twice")
        if "llamacpp-draft" in self.peers and (self.draft_gguf is None or not Path(self.draft_gguf).is_file()):
            raise UserError("the llamacpp-draft peer needs --draft-gguf FILE (benchmarks/draft_gguf.py writes specdec's draft as one)")
        if "hf-assisted" in self.peers and self.draft_model is None:
            raise UserError("the hf-assisted peer needs --draft-model")
        if "hf-assisted" in self.peers and self.draft_model is not None and is_shared_draft(self.draft_model):
            raise UserError("the hf-assisted peer cannot load a draft that borrows the target's embeddings (`specdec train draft`)")


@dataclass(frozen=True)
class Method:
    name: str  # e.g. "specdec/ngram/4", "hf", "hf-pld/4"
    family: str  # "specdec" or a peer name
    drafter: str | None = None
    gamma: int = 0  # 0 with an adaptive policy
    policy: str = "fixed"
    endpoint: str | None = None  # an openai peer's spec: openai:URL[#MODEL]
    options: tuple[tuple[str, int | float], ...] = ()  # the drafter's own options beside the run's (split_variant)

    @property
    def variant(self) -> str:
        """The drafter as --drafters named it: `suffix`, `suffix:fill=0`."""
        return variant_name(self.drafter, self.options)


def variant_name(drafter: str, options) -> str:
    return drafter + "".join(f":{key}={value}" for key, value in options)


def split_variant(text: str) -> tuple[str, tuple[tuple[str, int | float], ...]]:
    """A --drafters entry: a drafter, or `suffix:KEY=VALUE:...`, suffix with options of its own, so that two
    settings of it run side by side in one run (`--drafters suffix,suffix:fill=0`)."""
    name, *items = text.split(":")
    if not items:
        return name, ()
    if name != "suffix":
        raise UserError(f"{text}: options in --drafters are the suffix drafter's only (suffix:KEY=VALUE:...); "
                        f"give {name}'s with its own flags")
    return name, tuple(parse_options(items).items())


@dataclass
class RunRecord:
    """One method on one prompt (one repeat)."""

    method: str
    task_id: str
    category: str | None
    repeat: int
    num_tokens: int
    wall_s: float
    tokens_per_s: float
    token_ids: list[int] | None  # None: a server that gave only text (openai peers)
    text: str | None
    correct: bool | None
    stats: dict | None  # SpecStats.to_dict() for specdec methods


def plan_methods(config: BenchConfig, have_llama_cpp: bool) -> tuple[list[Method], list[str]]:
    """The methods to run, in interleaving order, and one-line notes about skipped peers."""
    methods = [Method(PLAIN, "specdec", "none", 0)]
    for variant in config.drafters:
        drafter, options = split_variant(variant)
        if drafter != "none":
            methods += [Method(f"specdec/{variant}/{g}", "specdec", drafter, g, options=options) for g in config.gammas]
            methods += [Method(f"specdec/{variant}/auto-{p}", "specdec", drafter, 0, p, options=options) for p in config.policies]
    notes = []
    pld = config.pld_gammas or config.gammas
    for peer in config.peers:
        if config.tp > 1:  # every rank runs the bench; a peer would load its own whole model, or query a server, per rank
            notes.append(f"{peer}: skipped (tensor-parallel run; bench peers in a run without --tp)")
            continue
        if is_openai_peer(peer):
            methods.append(Method(parse_openai_peer(peer).label, OPENAI, endpoint=peer))
            continue
        if peer.startswith("llamacpp") and not have_llama_cpp:
            notes.append(f"{peer}: skipped (llama-cpp-python is not installed; `pip install llama-cpp-python`)")
            continue
        if peer.startswith("llamacpp") and resolve_gguf(config.model) is None:
            notes.append(f"{peer}: skipped (llama.cpp runs GGUF files; the target {config.model} is not one)")
            continue
        if peer in ("hf", "llamacpp"):
            methods.append(Method(peer, peer))
        else:
            sizes = pld if peer.endswith("pld") else config.gammas
            methods += [Method(f"{peer}/{g}", peer, None, g) for g in sizes]
    return methods, notes


class Runner:
    """Holds the loaded models and peers; runs one method on one prompt."""

    def __init__(self, config: BenchConfig, methods: list[Method]) -> None:
        self.config = config
        # servers first: an unreachable URL fails before a model loads
        self.openai = {m.name: OpenAIPeer(m.endpoint) for m in methods if m.family == OPENAI}
        self.shard = join_group(config.tp, config.device)
        self.target = load_model(config.model, dtype=config.dtype, device=config.device, kernels=config.kernels, gguf=config.gguf,
                                 shard=self.shard)
        if self.target.tokenizer is None:
            raise UserError(f"{config.model} has no tokenizer: bench needs one to encode its prompts")
        p = next(self.target.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.draft = None
        if config.draft_model is not None:
            self.draft = load_draft(config.draft_model, self.target)  # a shared-embedding draft borrows the target's
        self.options = DrafterOptions(draft_model=self.draft, ngram_max=config.ngram_max, ngram_min=config.ngram_min,
                                      extra=config.drafter_extra)
        self.by_drafter: dict[str, SpecEngine] = {}
        self.engines: dict[str, SpecEngine] = {}
        for m in methods:
            if m.family == "specdec":
                self.add(m)
        self.hf = None
        if any(m.family.startswith("hf") for m in methods):
            self.hf = HFPeer(hf_folder(self.target), self.dtype, self.device, hf_folder(self.draft) if self.draft is not None else None)
        self.llama = None
        if any(m.family.startswith("llamacpp") for m in methods):
            self.llama = LlamaCppPeer(resolve_gguf(config.model), torch.get_num_threads(), context=4096,
                                      draft=Path(config.draft_gguf) if config.draft_gguf else None)

    def add(self, method: Method) -> SpecEngine:
        """The engine of a specdec method: one per drafter variant, which its gammas share (and its graphs);
        one per method for a drafter that learns across requests (suffix), or a gamma would draft from the
        text another gamma just produced for the same prompt."""
        engine = self.by_drafter.get(method.variant)
        if engine is None or learns_across_requests(engine.drafter):
            options = replace(self.options, extra=self.options.extra | dict(method.options))
            engine = SpecEngine(self.target, method.drafter, options)
            self.by_drafter.setdefault(method.variant, engine)
        self.engines[method.name] = engine
        return engine

    def forget_requests(self) -> None:
        """Cold-start the drafters that learn across requests (after the warm-up, which ran prompt 0)."""
        for engine in self.engines.values():
            forget_requests(engine.drafter)

    def encode(self, task: Task) -> list[int]:
        return encode_prompt(self.target.tokenizer, task.prompt, chat=self.config.chat)

    def run(self, method: Method, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float, dict | None]:
        sampling = self.config.sampling
        if method.family == "specdec":
            gamma = max(method.gamma, 1) if method.policy == "fixed" else "auto"  # plain: 0; adaptive: as `--gamma auto`
            spec = spec_config_for(gamma, method.policy, gamma_max=self.config.gamma_max,
                                   confidence_threshold=self.config.confidence_threshold, max_new_tokens=max_new_tokens,
                                   sampling=sampling)
            row = self.engines[method.name].generate([prompt], spec).rows[0]
            return row.token_ids, row.stats.wall_s, row.stats.to_dict()
        if method.family == OPENAI:
            out = self.openai[method.name].generate(prompt, max_new_tokens, sampling)
            return out.token_ids, out.wall_s, None
        peer = self.llama if method.family.startswith("llamacpp") else self.hf
        out = peer.generate(prompt, max_new_tokens, sampling, method.family, method.gamma)
        return out.token_ids, out.wall_s, None

    def decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)

    def output(self, method: Method, prompt: list[int],
               max_new_tokens: int) -> tuple[list[int] | None, float, dict | None, str, int]:
        """run()'s token ids, wall time and stats, with the text and the number of tokens: a server's own
        (openai peers), else decoded from and counted in the token ids."""
        if method.family == OPENAI:
            out = self.openai[method.name].generate(prompt, max_new_tokens, self.config.sampling)
            return out.token_ids, out.wall_s, None, out.text, out.num_tokens
        ids, wall, stats = self.run(method, prompt, max_new_tokens)
        return ids, wall, stats, self.decode(ids), len(ids)

    def spec_decode_counters(self) -> dict:
        """Each openai peer's server spec-decode counters now (None where it has none)."""
        return {name: peer.spec_decode_counters() for name, peer in self.openai.items()}


def label_by_what_runs(methods: list[Method], engines: dict) -> tuple[list[Method], list[str]]:
    """Fixed-gamma methods named by the draft depth their drafter really runs (EAGLE's tree depth, Medusa's
    heads cap it): a gamma that runs as another is dropped, with a note, or renamed when nothing else runs it."""
    kept, notes, names = [], [], {m.name for m in methods}
    for m in methods:
        if m.family != "specdec" or m.policy != "fixed" or m.drafter == "none":
            kept.append(m)
            continue
        depth = engines[m.name].drafter.shape(m.gamma).depth
        if depth == m.gamma:
            kept.append(m)
            continue
        name = f"specdec/{m.variant}/{depth}"
        notes.append(f"{m.name}: {m.variant} drafts at most {depth} tokens deep, so gamma {m.gamma} runs as {name}"
                     + (" (already measured)" if name in names else ""))
        if name not in names:
            names.add(name)
            engines[name] = engines[m.name]
            kept.append(Method(name, m.family, m.drafter, depth, m.policy, options=m.options))
    return kept, notes


def run_bench(config: BenchConfig, progress: bool = True) -> dict:
    """Run every method on every prompt, interleaved; return the results document (results.json)."""
    tasks = load_tasks(config.task, config.limit)
    methods, notes = plan_methods(config, llama_cpp_available())
    runner = Runner(config, methods)
    methods, refused = label_by_what_runs(methods, runner.engines)
    notes += refused
    prompts = [runner.encode(t) for t in tasks]
    servers: dict[str, list[str]] = {}
    for name, peer in runner.openai.items():
        servers.setdefault(peer.endpoint.root, []).append(name)
    notes += [f"{', '.join(names)} share the server {root}: its spec-decode counters cover all of their requests"
              for root, names in servers.items() if len(names) > 1]

    for method in tqdm(methods, desc="warm-up", disable=not progress, leave=False):
        runner.run(method, prompts[0], min(16, config.max_new_tokens))
    runner.forget_requests()  # a suffix drafter then learns only from the prompts before each one, as a server would

    counters_before = runner.spec_decode_counters()  # after the warm-up, so only the measured requests count
    records: list[RunRecord] = []
    total = config.repeats * len(tasks) * len(methods)
    with tqdm(total=total, desc="bench", disable=not progress, unit="run") as bar:
        for repeat in range(config.repeats):
            if repeat:  # each pass drafts from the same earlier prompts: a repeat measures again, it does not replay
                runner.forget_requests()
            for task, prompt in zip(tasks, prompts):
                for method in methods:
                    bar.set_postfix_str(method.name)
                    ids, wall, stats, text, count = runner.output(method, prompt, config.max_new_tokens)
                    records.append(RunRecord(
                        method=method.name, task_id=task.id, category=task.category, repeat=repeat,
                        num_tokens=count, wall_s=wall, tokens_per_s=count / wall if wall > 0 else 0.0,
                        token_ids=ids, text=text, stats=stats,
                        correct=is_correct(text, task.reference) if task.reference else None,
                    ))
                    bar.update()
    counters_after = runner.spec_decode_counters()

    calibration = calibrate(runner, prompts, records, methods)
    summaries = [summarize(m, records, calibration, config.sampling.greedy) for m in methods]
    for summary in summaries:
        if summary["family"] != "specdec":
            continue
        drafter = runner.engines[summary["name"]].drafter
        if draft := draft_kernel_path(drafter):
            summary["draft_kernels"] = draft.to_dict()
        if is_dataclass(tree := getattr(drafter, "tree", None)):  # the shape that ran, defaults included (eagle's lookup)
            summary["tree"] = asdict(tree)
    for summary in summaries:
        if summary["family"] == OPENAI:
            peer = runner.openai[summary["name"]]
            summary["server"] = {"url": peer.endpoint.root, "model": peer.model, "token_ids_from": peer.source}
            name = summary["name"]
            summary["server_spec_decode"] = spec_decode_delta(counters_before[name], counters_after[name])
    return {
        "schema": "specdec.bench/1",
        "config": {**asdict(config), "sampling": asdict(config.sampling)},
        "environment": environment(runner),
        "task": config.task,
        "num_prompts": len(tasks),
        "categories": sorted({t.category for t in tasks if t.category}),
        "notes": notes,
        "calibration": calibration,
        "methods": summaries,
        "runs": [asdict(r) for r in records],
    }


def calibrate(runner: Runner, prompts: list[list[int]], records: list[RunRecord], methods: list[Method]) -> dict:
    """Time target forwards over k = 1..max(gamma)+1 new tokens at a typical context length."""
    plain_outputs = [r.token_ids for r in records if r.method == PLAIN and r.repeat == 0]
    context_len = int(statistics.median(len(p) for p in prompts) + statistics.median(len(o) for o in plain_outputs) / 2)
    context = (prompts[0] + plain_outputs[0] + prompts[0] * 8)[: max(context_len, 2)]
    largest = max([1] + [runner.engines[m.name].drafter.shape(max(m.gamma, runner.config.gamma_max if m.policy != "fixed" else 0)).width
                         for m in methods if m.family == "specdec"])
    ks = list(range(1, largest + 2))
    graphs = any(e.graphs for e in runner.engines.values())
    times = measure_forward_times(runner.target, context, ks, graphs=graphs)
    calibration = {
        "context_len": len(context),
        "forward_s": {str(k): t for k, t in times.items()},
        "verify_ratio": {str(k): r for k, r in verify_ratios(times).items()},
        **one_token_forward(records, times[1]),
    }
    if runner.device.type == "cuda":  # the floor: weights read per forward / memory bandwidth
        weight_bytes, bandwidth = weight_bytes_per_forward(runner.target), copy_bandwidth(runner.device)
        calibration.update(weight_bytes=weight_bytes, copy_bandwidth_gbs=bandwidth / 1e9,
                           floor_forward_s=weight_bytes / bandwidth, floor_tokens_per_s=bandwidth / weight_bytes)
    return calibration


def one_token_forward(records: list[RunRecord], calibrated_s: float) -> dict:
    """t1, the target's one-token forward that c is counted in: the median over plain's runs of their target
    time per decode step, measured beside the methods' draft times, prompt by prompt in the same run. The
    calibrated forward (measure_forward_times) is timed once, after the run, at one context: on a 2-core VM
    whose speed drifts within a run it moved c by more than the draft's own changes (docs/design.md,
    "Integer dot products for a quantized draft"). It stays t1 where plain ran no decode step (one new token)."""
    steps = [r.stats["target_s"] / r.stats["decode_steps"] for r in records
             if r.method == PLAIN and r.stats and r.stats["decode_steps"]]
    if not steps:
        return {"t1_s": calibrated_s, "t1_from": "calibrated forward"}
    return {"t1_s": statistics.median(steps), "t1_from": "plain runs"}


def quartiles(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p25": None, "p75": None, "min": None, "max": None}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "min": min(values), "max": max(values)}


def per_prompt(records: list[RunRecord], method: str) -> dict[str, list[RunRecord]]:
    out: dict[str, list[RunRecord]] = {}
    for r in records:
        if r.method == method:
            out.setdefault(r.task_id, []).append(r)
    return out


def median_speed(runs: list[RunRecord]) -> float:
    return statistics.median(r.tokens_per_s for r in runs)


def speedups(records: list[RunRecord], method: str, baseline: str, category: str | None = None) -> list[float]:
    """Per-prompt ratio of median tokens/s (over repeats) to the baseline's on the same prompt (only the
    prompts of `category`, if given)."""
    mine, base = per_prompt(records, method), per_prompt(records, baseline)
    return [median_speed(mine[t]) / median_speed(base[t]) for t in mine
            if t in base and median_speed(base[t]) > 0 and category in (None, mine[t][0].category)]


def speedup_by_category(records: list[RunRecord], method: str) -> dict[str, float]:
    """Category -> the median over its prompts of `speedups` against plain (prompts without a category are left out)."""
    categories = sorted({r.category for r in records if r.method == method and r.category})
    return {c: statistics.median(ratios) for c in categories if (ratios := speedups(records, method, PLAIN, c))}


def repeat_spread(records: list[RunRecord], method: str) -> dict | None:
    """Quartiles of each run's tok/s over its prompt's median (None without repeats): how far the same request
    moves from run to run on this machine, the noise under every speedup of the run."""
    ratios = [r.tokens_per_s / median_speed(runs) for runs in per_prompt(records, method).values()
              if len(runs) > 1 and median_speed(runs) > 0 for r in runs]
    return quartiles(ratios) if ratios else None


def summarize(method: Method, records: list[RunRecord], calibration: dict, greedy: bool) -> dict:
    runs = per_prompt(records, method.name)
    speeds = [median_speed(v) for v in runs.values()]
    first = [v[0] for v in runs.values()]
    correct = [r.correct for r in first if r.correct is not None]
    summary = {
        **asdict(method),
        "tokens_per_s": quartiles(speeds),
        "speedup_vs_plain": quartiles(speedups(records, method.name, PLAIN)),
        "speedup_vs_hf": quartiles(speedups(records, method.name, "hf")),
        "speedup_vs_plain_by_category": speedup_by_category(records, method.name),
        "repeat_spread": repeat_spread(records, method.name),
        "accuracy": sum(correct) / len(correct) if correct else None,
        "mean_new_tokens": statistics.mean(r.num_tokens for r in first),
    }
    if greedy:
        plain = {t: v[0] for t, v in per_prompt(records, PLAIN).items()}
        mine = [r for rs in runs.values() for r in rs]
        same = [same_output(r, plain[r.task_id]) for r in mine]
        summary["matches_plain"] = sum(same)
        summary["num_outputs"] = len(same)
        summary["lossless"] = all(same)
        by_text = [r for r in mine if r.token_ids is None]
        summary["lossless_compared"] = " and ".join(
            ["token ids"] * (len(by_text) < len(mine)) + ["text"] * bool(by_text))
        if by_text:  # what a text comparison cannot see: the token counts
            summary["num_tokens_match_plain"] = sum(r.num_tokens == len(plain[r.task_id].token_ids) for r in by_text)
    if method.family == "specdec":
        summary.update(acceptance_summary(method, [r.stats for rs in runs.values() for r in rs], calibration))
    return summary


def same_output(run: RunRecord, plain: RunRecord) -> bool:
    """The run's output equals plain greedy decoding's: token for token, or, for a server that gave only
    text, its text equals the plain tokens' decoded text (leading whitespace aside: detokenizers differ on
    the first token's space)."""
    if run.token_ids is not None:
        return run.token_ids == plain.token_ids
    return run.text is not None and plain.text is not None and run.text.lstrip() == plain.text.lstrip()


def acceptance_summary(method: Method, stats: list[dict], calibration: dict) -> dict:
    """Acceptance, tau, measured c and r, and both estimated speedups for one specdec method."""
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    decode_steps = sum(s["decode_steps"] for s in stats)  # the prefill drafts nothing
    ratios = {int(k): v for k, v in calibration["verify_ratio"].items()}
    t1 = calibration["t1_s"]
    alpha = accepted / drafted if drafted else None
    tau = mean_accepted_length(sum(s["decode_emitted"] for s in stats), decode_steps)
    drafted_per_step = drafted / decode_steps if decode_steps else 0.0
    nodes_per_step = sum(s.get("draft_nodes", s["drafted"]) for s in stats) / decode_steps if decode_steps else 0.0
    draft_s = sum(s["draft_s"] for s in stats)
    out = {
        "acceptance_rate": alpha,
        "mean_accepted_length": tau,
        "drafted_per_step": drafted_per_step,
        "nodes_per_step": nodes_per_step,  # tokens verified per step besides the pending one (trees: nodes)
        "cost_coefficient": cost_coefficient(draft_s, decode_steps, method.gamma or drafted_per_step, t1),
        "verify_ratio": interpolate(ratios, nodes_per_step + 1) if method.policy != "fixed" or method.gamma == 0
        else ratios.get(method.gamma + 1),
        "estimated_speedup": None,
        "estimated_speedup_tau": None,
        "acceptance_per_position": pool_per_position(stats),
    }
    if tau is not None and decode_steps:
        out["estimated_speedup_tau"] = estimated_speedup_from_tau(tau, draft_s / decode_steps / t1, nodes_per_step, ratios)
    if method.policy == "fixed" and method.gamma and alpha is not None and out["cost_coefficient"] is not None \
            and nodes_per_step <= method.gamma:  # the chain formula; not for trees
        out["estimated_speedup"] = estimated_speedup(alpha, method.gamma, out["cost_coefficient"], ratios[method.gamma + 1])
    return out


def pool_per_position(stats: list[dict]) -> list[float | None]:
    """Per-position acceptance pooled over runs (weighted by how often each position was drafted)."""
    drafted: list[float] = []
    accepted: list[float] = []
    for s in stats:
        for i, (d, a) in enumerate(zip(s["drafted_per_position"], s["accepted_per_position"])):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    return [a / d if d else None for a, d in zip(accepted, drafted)]


def environment(runner: Runner) -> dict:
    import transformers

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "model": runner.config.model,
        "model_folder": runner.target.name,
        "kernels": kernel_path(runner.target).to_dict(),
        "tp": runner.shard.world,
        "cpu_kernel": cpu_gemm.build_status(),
    }
    if runner.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(runner.device)
    return env

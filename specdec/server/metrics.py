"""Server metrics in the Prometheus text exposition format (0.0.4), without a client library.

Names follow docs/design.md ("Vocabulary"): drafted / accepted draft tokens, acceptance per draft position (1-based
`position` label), steps = batched target verification forwards. Inter-token latency is per output
token: a step that hands a request n tokens after a gap of g seconds records g / n, n times (so
speculation shows up as shorter inter-token latency). Time to first token runs from the request's
arrival at the server to its first token. Updated from the decode thread, read from the event loop:
one lock guards everything.

vLLM's speculative-decoding counters are exposed too, under vLLM's names and labels, so dashboards
built for vLLM work unchanged: `vllm:spec_decode_num_drafts_total` (row-steps that drafted),
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total` and
`..._num_accepted_tokens_per_pos_total{position="0"}` (0-based, as vLLM counts), each with a
`model_name` label.

The garbage collector's pauses in the serving process (`specdec_gc_seconds_total` and
`specdec_gc_collections_total`, by `generation`): a full collection stops every thread, the decode loop
included, and how often one runs depends on what the loop allocates.

Memory and CPU, read at scrape time: `process_resident_memory_bytes` and `process_cpu_seconds_total` (every
thread of the process, user and system; both from /proc on Linux, absent elsewhere) and, once the process uses CUDA,
`specdec_cuda_memory_allocated_bytes` and `specdec_cuda_memory_reserved_bytes` (torch's caching
allocator) with a `device` label per device holding memory; absent on the CPU. Where HTTP is served by
processes apart from the engine (frontend.py), the engine reads theirs from /proc as well:
`specdec_frontend_resident_memory_bytes` and `specdec_frontend_cpu_seconds_total`, with a `frontend` label.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
RATE_WINDOW_S = 10.0
REQUEST_STATUSES = ("finished", "cancelled", "failed", "rejected")
DECODE_PARTS = ("idle", "prefill", "wait", "host")  # what the decode thread's time goes to (Scheduler.loop)


class GcPauses:
    """The garbage collector's collections and their seconds in this process, by generation (gc.callbacks).
    One per process (`gc_pauses`): a collection stops every thread whichever one triggered it."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self.began: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        elif self.began is not None:
            self.seconds[info["generation"]] += time.perf_counter() - self.began
            self.collections[info["generation"]] += 1
            self.began = None

    def render(self, prefix: str = "specdec", process: str = "this process", labels: str = "") -> list[str]:
        """The counters as `{prefix}_gc_seconds_total` and `{prefix}_gc_collections_total` (an HTTP frontend's
        process: prefix specdec_frontend, labels 'frontend="k"')."""
        more = f",{labels}" if labels else ""
        return [f"# HELP {prefix}_gc_seconds_total Seconds {process} spent in garbage collections, by generation.",
                f"# TYPE {prefix}_gc_seconds_total counter",
                *(f'{prefix}_gc_seconds_total{{generation="{g}"{more}}} {s:.6f}' for g, s in enumerate(self.seconds)),
                f"# HELP {prefix}_gc_collections_total Garbage collections in {process}, by generation.",
                f"# TYPE {prefix}_gc_collections_total counter",
                *(f'{prefix}_gc_collections_total{{generation="{g}"{more}}} {n}' for g, n in enumerate(self.collections)),
                *gauge(f"{prefix}_gc_frozen_objects", f"Objects {process} has frozen out of the collector's reach "
                       "(gc.freeze, once start-up is done).", gc.get_freeze_count(), labels)]


_gc_pauses: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """This process's GcPauses, registered with the collector at the first call."""
    global _gc_pauses
    if _gc_pauses is None:
        _gc_pauses = GcPauses()
        gc.callbacks.append(_gc_pauses)
    return _gc_pauses


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf; not cumulative
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.count += times

    def render(self, name: str, about: str) -> list[str]:
        lines = [f"# HELP {name} {about}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return lines + [f"{name}_sum {self.total:.6f}", f"{name}_count {self.count}"]


class ServerMetrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = {status: 0 for status in REQUEST_STATUSES}
        self.prompt_tokens = self.generation_tokens = 0
        self.steps = self.drafted = self.accepted = 0
        self.drafts = 0  # row-steps that drafted at least one token (vLLM's num_drafts)
        self.drafted_per_position: list[int] = []
        self.accepted_per_position: list[int] = []
        self.gamma = 0  # chosen for the last step
        self.steps_by_gamma: dict[int, int] = {}  # gamma asked -> steps
        self.cost_moves = {"switch": 0, "probe": 0}  # `cost`: choices changed, explorations started
        self.prefill_forwards = {"graph": 0, "eager": 0}  # prefill chunks read by a captured graph, or eagerly
        self.prefills_during_step = 0  # of them, read while the decode thread waited for a step (Scheduler.admit_during)
        self.decode_s = {part: 0.0 for part in DECODE_PARTS}  # the decode thread's seconds, by what it did
        self.idle_since: float | None = None  # when the decode thread began waiting for work, while it does
        self.ttft = Histogram(TTFT_BUCKETS)
        self.queue_time = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens emitted) for tokens/s
        self.started = time.monotonic()
        self.gc = gc_pauses()

    def count_request(self, status: str) -> None:
        with self.lock:
            self.requests[status] += 1

    def count_prompt(self, tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += tokens

    def observe_queue_time(self, seconds: float) -> None:
        """A request's wait from arrival to the start of its prefill."""
        with self.lock:
            self.queue_time.observe(seconds)

    def count_prefill(self, graphed: bool, during_step: bool = False) -> None:
        with self.lock:
            self.prefill_forwards["graph" if graphed else "eager"] += 1
            self.prefills_during_step += during_step

    def add_decode_time(self, part: str, seconds: float) -> None:
        """Seconds of the decode thread's time spent on `part` (DECODE_PARTS)."""
        with self.lock:
            self.decode_s[part] += seconds

    def start_idle(self) -> None:
        """The decode thread waits for work from now on: its idle time counts as it goes, so a scrape during a
        busy spell that follows a long idle one does not see the whole idle spell land in it."""
        with self.lock:
            self.idle_since = time.perf_counter()

    def end_idle(self) -> None:
        with self.lock:
            self.decode_s["idle"] += time.perf_counter() - self.idle_since
            self.idle_since = None

    def decode_seconds(self) -> dict[str, float]:
        """decode_s with the idle spell in progress; call under the lock."""
        idle = 0.0 if self.idle_since is None else time.perf_counter() - self.idle_since
        return {**self.decode_s, "idle": self.decode_s["idle"] + idle}

    def observe_tokens(self, n: int, gap_s: float | None, first: bool, arrival_gap_s: float) -> None:
        """n tokens handed to one request; gap_s since its previous tokens (None for the first)."""
        with self.lock:
            self.generation_tokens += n
            self.recent.append((time.monotonic(), n))
            self.forget_old_tokens()
            if first:
                self.ttft.observe(arrival_gap_s)
            elif n and gap_s is not None:
                self.itl.observe(gap_s / n, n)

    def observe_step(self, batch_size: int, gamma: int, drafted: list[int], accepted: list[int]) -> None:
        with self.lock:
            self.steps += 1
            self.gamma = gamma
            self.steps_by_gamma[gamma] = self.steps_by_gamma.get(gamma, 0) + 1
            self.batch_size.observe(batch_size)
            for d, a in zip(drafted, accepted):
                self.drafts += d > 0
                self.drafted += d
                self.accepted += a
                grow = d - len(self.drafted_per_position)
                if grow > 0:
                    self.drafted_per_position += [0] * grow
                    self.accepted_per_position += [0] * grow
                for i in range(d):
                    self.drafted_per_position[i] += 1
                for i in range(a):
                    self.accepted_per_position[i] += 1

    def count_cost_move(self, kind: str) -> None:
        with self.lock:
            self.cost_moves[kind] += 1

    def observe_latency(self, seconds: float) -> None:
        with self.lock:
            self.latency.observe(seconds)

    def forget_old_tokens(self) -> None:
        horizon = time.monotonic() - RATE_WINDOW_S
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()

    def tokens_per_s(self) -> float:
        """Tokens emitted over the last RATE_WINDOW_S seconds (or since start, if sooner); call under the lock."""
        self.forget_old_tokens()
        window = min(RATE_WINDOW_S, time.monotonic() - self.started)
        return sum(n for _, n in self.recent) / window if window > 0 else 0.0

    def render(self, running: int, waiting: int, policy: str, model_name: str = "") -> str:
        with self.lock:
            acceptance = self.accepted / self.drafted if self.drafted else 0.0
            lines = [
                "# HELP specdec_requests_total Requests by outcome (rejected: queue full or shutting down).",
                "# TYPE specdec_requests_total counter",
                *(f'specdec_requests_total{{status="{s}"}} {n}' for s, n in self.requests.items()),
                *counter("specdec_prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens),
                *counter("specdec_generation_tokens_total", "Tokens generated (emitted to requests).",
                         self.generation_tokens),
                *counter("specdec_steps_total", "Batched target verification forwards (decode steps).", self.steps),
                *counter("specdec_drafted_tokens_total", "Draft tokens proposed.", self.drafted),
                *counter("specdec_accepted_tokens_total", "Draft tokens accepted by the verifier.", self.accepted),
                "# HELP specdec_drafted_per_position_total Draft tokens proposed at each draft position (1-based).",
                "# TYPE specdec_drafted_per_position_total counter",
                *per_position("specdec_drafted_per_position_total", self.drafted_per_position),
                "# HELP specdec_accepted_per_position_total Draft tokens accepted at each draft position (1-based).",
                "# TYPE specdec_accepted_per_position_total counter",
                *per_position("specdec_accepted_per_position_total", self.accepted_per_position),
                *gauge("specdec_acceptance_rate", "accepted / drafted since start.", acceptance),
                *gauge("specdec_requests_running", "Requests in the running batch.", running),
                *gauge("specdec_requests_waiting", "Requests queued for the batch.", waiting),
                *gauge("specdec_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.",
                       self.tokens_per_s()),
                *gauge("specdec_spec_gamma", "Draft tokens per row chosen for the last step.", self.gamma),
                "# HELP specdec_steps_by_gamma_total Decode steps by the draft tokens per row the policy chose (a step cut "
                "to what was drafted counts at that choice).",
                "# TYPE specdec_steps_by_gamma_total counter",
                *(f'specdec_steps_by_gamma_total{{gamma="{g}"}} {n}' for g, n in sorted(self.steps_by_gamma.items())),
                "# HELP specdec_cost_moves_total The cost policy's moves: a changed choice of gamma (switch), an exploration (probe).",
                "# TYPE specdec_cost_moves_total counter",
                *(f'specdec_cost_moves_total{{kind="{k}"}} {n}' for k, n in self.cost_moves.items()),
                "# HELP specdec_prefill_forwards_total Prefill chunks read, by a captured graph or eagerly.",
                "# TYPE specdec_prefill_forwards_total counter",
                *(f'specdec_prefill_forwards_total{{kind="{k}"}} {n}' for k, n in self.prefill_forwards.items()),
                *counter("specdec_prefill_during_step_total", "Prefill chunks read while a step ran (requests admitted "
                         "without waiting for the step).", self.prefills_during_step),
                "# HELP specdec_decode_thread_seconds_total The decode thread's time: idle (no request), prefill "
                "(admitting requests, reading their prompts, first tokens handed out), wait (for a step's outcome), "
                "host (launching steps, handing their tokens out).",
                "# TYPE specdec_decode_thread_seconds_total counter",
                *(f'specdec_decode_thread_seconds_total{{part="{k}"}} {s:.6f}' for k, s in self.decode_seconds().items()),
                "# HELP specdec_spec_policy_info The speculation policy in force.",
                "# TYPE specdec_spec_policy_info gauge",
                f'specdec_spec_policy_info{{policy="{policy}"}} 1',
                *self.ttft.render("specdec_time_to_first_token_seconds", "Arrival to first token."),
                *self.queue_time.render("specdec_request_queue_time_seconds", "Arrival to the start of the prefill."),
                *self.itl.render("specdec_inter_token_latency_seconds", "Seconds per output token after the first."),
                *self.latency.render("specdec_request_latency_seconds", "Arrival to last token of finished requests."),
                *self.batch_size.render("specdec_batch_size", "Rows in the batch at each step."),
                *self.render_vllm(model_name),
                *self.gc.render(),
            ]
        usage = read_process_usage("self")
        if usage is not None:
            lines += gauge("process_resident_memory_bytes", "Resident memory size in bytes.", usage.rss_bytes)
            lines += counter("process_cpu_seconds_total", "User and system CPU time of every thread of the process.",
                             usage.cpu_seconds)
        lines += cuda_memory_lines(read_cuda_memory())
        return "\n".join(lines) + "\n"


    def render_vllm(self, model_name: str) -> list[str]:
        """The same counters under vLLM's names (call under the lock)."""
        label = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines = []
        for name, about, value in (("drafts", "Row-steps that drafted.", self.drafts),
                                   ("draft_tokens", "Draft tokens proposed.", self.drafted),
                                   ("accepted_tokens", "Draft tokens accepted.", self.accepted)):
            lines += [f"# HELP vllm:spec_decode_num_{name}_total {about}", f"# TYPE vllm:spec_decode_num_{name}_total counter",
                      f"vllm:spec_decode_num_{name}_total{{{label}}} {value}"]
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Draft tokens accepted at each draft position (0-based).", f"# TYPE {name} counter"]
        return lines + [f'{name}{{{label},position="{i}"}} {n}' for i, n in enumerate(self.accepted_per_position)]


def counter(name: str, about: str, value: float) -> list[str]:
    return [f"# HELP {name} {about}", f"# TYPE {name} counter", f"{name} {value}"]


def per_position(name: str, counts: list[int]) -> list[str]:
    return [f'{name}{{position="{i + 1}"}} {n}' for i, n in enumerate(counts)]


def gauge(name: str, about: str, value: float, labels: str = "") -> list[str]:
    """One gauge series; `labels` as 'frontend="0"' (none by default)."""
    series = f"{name}{{{labels}}}" if labels else name
    return [f"# HELP {name} {about}", f"# TYPE {name} gauge", f"{series} {value}"]


@dataclass(frozen=True)
class ProcessUsage:
    rss_bytes: int
    cpu_seconds: float  # user + system, every thread


def read_process_usage(pid: int | str) -> ProcessUsage | None:
    """A process's resident memory and CPU time: this one's ("self") or another's, e.g. an HTTP frontend's
    (Linux /proc/PID/stat; None elsewhere or once it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": fields 3.. of proc(5)
    tick = os.sysconf("SC_CLK_TCK")
    return ProcessUsage(rss_bytes=int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
                        cpu_seconds=(int(fields[11]) + int(fields[12])) / tick)


def frontend_usage_lines(pids: list[int | None]) -> list[str]:
    """The HTTP frontend processes' memory and CPU, labelled by their index (frontend.Frontends)."""
    usage = {k: read_process_usage(pid) for k, pid in enumerate(pids) if pid is not None}
    usage = {k: u for k, u in usage.items() if u is not None}
    if not usage:
        return []
    rss, cpu = "specdec_frontend_resident_memory_bytes", "specdec_frontend_cpu_seconds_total"
    return [f"# HELP {rss} Resident memory of each HTTP frontend process.", f"# TYPE {rss} gauge",
            *(f'{rss}{{frontend="{k}"}} {u.rss_bytes}' for k, u in usage.items()),
            f"# HELP {cpu} User and system CPU time of each HTTP frontend process.", f"# TYPE {cpu} counter",
            *(f'{cpu}{{frontend="{k}"}} {u.cpu_seconds:.2f}' for k, u in usage.items())]


@dataclass(frozen=True)
class CudaMemory:
    device: int  # CUDA device index
    allocated: int  # bytes in tensors (torch.cuda.memory_allocated)
    reserved: int  # bytes held by torch's caching allocator (torch.cuda.memory_reserved)


def read_cuda_memory() -> list[CudaMemory]:
    """Torch's CUDA allocator now, per device this process holds memory on; [] when CUDA is not in use."""
    import torch

    if not torch.cuda.is_initialized():
        return []
    devices = [CudaMemory(d, torch.cuda.memory_allocated(d), torch.cuda.memory_reserved(d))
               for d in range(torch.cuda.device_count())]
    return [m for m in devices if m.reserved]


def cuda_memory_lines(devices: list[CudaMemory]) -> list[str]:
    """Gauges specdec_cuda_memory_allocated_bytes and ..._reserved_bytes, labelled by device; none without devices."""
    lines = []
    for kind, about in (("allocated", "Bytes in tensors (torch.cuda.memory_allocated)."),
                        ("reserved", "Bytes held by the caching allocator (torch.cuda.memory_reserved).")):
        name = f"specdec_cuda_memory_{kind}_bytes"
        if devices:
            lines += [f"# HELP {name} {about}", f"# TYPE {name} gauge",
                      *(f'{name}{{device="{m.device}"}} {getattr(m, kind)}' for m in devices)]
    return lines


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} from Prometheus text (comments skipped): for tests and bench-serve."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out

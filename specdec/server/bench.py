"""`specdec bench-serve`: a load generator against the server on loopback, per policy and concurrency.

One warm server (started here with --enable-admin and a random API key, or an existing one at --url
started with --enable-admin) serves every level; the speculation policy is switched between levels
through POST /admin/spec-policy. At concurrency c, c clients send streamed chat completions back to
back until --requests have finished. Request i of a level (plan_request) takes the prompts in turn
and its sampling parameters from --temperature, or with --sampling-mix from SAMPLING_MIX in turn
(greedy, top_p, top_k, seeded; shifted by one at every pass over the prompts, so each prompt meets
every set), so the batch holds rows that sample differently. With --disconnect-fraction F,
floor(n x F) of a level's n requests, evenly spread, close their stream after DISCONNECT_AFTER_CHUNKS
chunks. Before each level, one untimed wave of c requests (none disconnecting) lets the server capture
the CUDA graphs of the level's batch bucket, so the level times serving, not capturing; then the
drafter forgets what it learned from earlier requests (POST /admin/forget), so a drafter that learns
across requests (suffix) drafts in a level only from that level's earlier requests. A level's streams
are shared by client processes (client_processes: for a GPU server one per STREAMS_PER_PROCESS streams,
at most one per CPU, since one Python process parses about 10k chunks/s and a single one would time
itself at dozens of streams; for a CPU server one, which leaves it the CPUs it shares on loopback). They
connect before the level's clock starts and take the level's requests from one shared counter. Measured
on the client:
- throughput: completion tokens of the level's completed requests / its wall seconds (the tokens a
  disconnected request received are not counted);
- TTFT: request sent to the first chunk (it comes with the first token); ITL: (last chunk - first) /
  (completion tokens - 1) per request, i.e. time per output token; p50 and p99 over the level's
  completed requests;
- every response is checked: HTTP 200, each chunk well-formed, a finish reason, usage, then [DONE]; a
  disconnected one up to where it closed. A request neither complete nor disconnected is lost;
- after each level, /metrics must show no running or waiting request (every row freed) within
  DRAIN_TIMEOUT_S; the server's count of cancelled requests over the level is kept beside the
  client's disconnects;
- server memory from /metrics: RSS (process_resident_memory_bytes, plus the HTTP frontend process's,
  specdec_frontend_resident_memory_bytes, where it has one) and, on CUDA, the torch
  allocator's allocated and reserved bytes (specdec_cuda_memory_*_bytes, summed over devices), at the
  level's start, after every MEMORY_EVERY requests and at its end (after the drain); growth = last
  sample - first;
- the client itself: its processes' CPU time over the level's wall, and how late their event loops run
  a 5-ms timer (sample_lag), which a response also waits before it is read: TTFT and ITL include it.
The targets of issue 13 are checked from the measured levels (check_targets): `cost` / `off` >= 1.0
and `cost` / the better of `off` and `on` >= 0.95 at each concurrency, TTFT p50 at c = 32 (and at the
largest concurrency) <= 2x TTFT p50 at c = 1 per policy, no request lost, every row freed.
Writes results.json, report.md and throughput.png (tokens/s vs concurrency per policy).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import platform
import queue as queue_module
import secrets
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import httpx

from specdec.errors import UserError
from specdec.server.metrics import parse_metrics

SHORT_PROMPTS = (
    "Say hello in one short sentence.",
    "Name three colours.",
    "Count from one to ten.",
    "What is the capital of France?",
    "Give me a synonym for happy.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "List the days of the week.",
)
MEMORY_EVERY = 250  # requests between server memory samples within a level
# Default requests per level: max(32, 8 x concurrency). With max(8, 4c) (levels of 1-3 s on an H200), two
# sweeps of one server in a row gave `on` / `off` 0.97 and 0.74 at 64 clients, 1.13 and 1.32 at 8: far
# more than the 5 % a cost target asks to resolve.
LEVEL_REQUESTS = (32, 8)
# A level shorter than this is flagged (short_level_note). On an H200 at the default size levels lasted 0.45 s
# (4 clients) to 3.5 s (64): at 64 clients `cost` and `on` ran the same 269-271 gamma-5 steps in 2.79 and 2.56 s.
STEADY_LEVEL_S = 3.0
STREAMS_PER_PROCESS = 8  # concurrent streams one client process drives (against a GPU server)
LAG_TICK_S = 0.005  # the timer whose lateness samples a client's event loop (sample_lag): 200 wake-ups a second
DISCONNECT_AFTER_CHUNKS = 3  # chunks with a choice a disconnecting client reads before closing
GOLDEN = (5**0.5 - 1) / 2  # index x GOLDEN mod 1 spreads request lengths evenly (plan_request)
DRAIN_TIMEOUT_S = 30.0  # after a level, for the server's running and waiting requests to reach 0
COST_VS_OFF_TARGET = 1.0  # issue 13: `cost` >= 1.0x `off` ...
COST_VS_BEST_TARGET = 0.95  # ... and within 5 % of the better of `off` and `on`
TTFT_TARGET_CONCURRENCY = 32  # issue 13: TTFT p50 at c = 32 <= 2x TTFT p50 at c = 1
TTFT_TARGET_RATIO = 2.0


@dataclass(frozen=True)
class SamplingSet:
    """One request's sampling parameters, under the body field names the server accepts (app.py's
    SamplingFields: temperature, top_p, top_k, min_p, seed)."""

    name: str
    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seeded: bool = False  # seed = the request's index in its level: reproducible, different per request


SAMPLING_MIX = (
    SamplingSet("greedy", 0.0),
    SamplingSet("t=0.7 top_p=0.95", 0.7, top_p=0.95),
    SamplingSet("t=1.0 top_k=50", 1.0, top_k=50),
    SamplingSet("t=0.8 min_p=0.05 seeded", 0.8, min_p=0.05, seeded=True),
    SamplingSet("t=0.6 top_k=20 top_p=0.9 seeded", 0.6, top_p=0.9, top_k=20, seeded=True),
)


def fixed_sampling(temperature: float) -> tuple[SamplingSet, ...]:
    """Every request at one temperature (greedy at 0)."""
    return (SamplingSet("greedy" if temperature == 0 else f"t={temperature:g}", temperature),)


@dataclass(frozen=True)
class RequestSpec:
    index: int  # in its level
    prompt: str
    sampling: SamplingSet
    disconnect_after: int | None  # chunks read before closing the stream; None: read it to the end
    max_tokens: int


@dataclass
class RequestResult:
    outcome: str  # "ok", "disconnected" (closed by the client, as planned) or "failed"
    sampling: str  # the SamplingSet's name
    error: str | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class MemorySample:
    requests_done: int
    rss_mib: float | None  # the server's processes together (engine, and frontend where it is one apart)
    gpu_allocated_mib: float | None  # torch's CUDA allocator, summed over devices; None without CUDA
    gpu_reserved_mib: float | None


@dataclass
class LevelResult:
    policy: str
    concurrency: int
    requests: int
    ok: int
    disconnected: int
    wall_s: float
    completion_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    acceptance_rate: float | None
    running_after: int  # requests running on the server after the level's drain (0: every row freed)
    waiting_after: int
    server_cancelled: int  # requests the server counted as cancelled during the level
    server_ttft_mean_ms: float | None = None  # the server's own TTFT (queued to first token handed over), mean
    server_queue_mean_ms: float | None = None  # of which waiting for the prefill to start, mean
    steps_by_gamma: dict[int, int] = field(default_factory=dict)  # the server's decode steps over the level, by gamma
    cost_moves: dict[str, int] = field(default_factory=dict)  # `cost`'s switches and probes over the level
    prefill_forwards: dict[str, int] = field(default_factory=dict)  # its prefill chunks over the level: graph, eager
    decode_shares: dict[str, float] = field(default_factory=dict)  # its decode thread's time by part (decode_shares)
    gc_seconds: dict[str, float] = field(default_factory=dict)  # its garbage collections' seconds over the level, by generation
    cpu_cores: dict[str, float] = field(default_factory=dict)  # CPU seconds over the level's wall: engine, frontends (cpu_cores)
    memory: list[MemorySample] = field(default_factory=list)
    rss_growth_mib: float | None = None  # last memory sample - first
    gpu_allocated_growth_mib: float | None = None
    gpu_reserved_growth_mib: float | None = None
    sampling: dict[str, dict[str, int]] = field(default_factory=dict)  # set name -> {outcome: requests}
    errors: list[str] = field(default_factory=list)  # the first few
    client_processes: int = 1  # processes that drove the level's streams
    client_lag_p50_ms: float | None = None  # how late the clients' event loops ran a 5-ms timer (sample_lag):
    client_lag_p99_ms: float | None = None  # a response waits about that long in its client before it is read
    repeat: int = 0  # which pass over the policies and concurrencies (LoadPlan.repeats)

    @property
    def lost(self) -> int:
        return self.requests - self.ok - self.disconnected

    @property
    def rows_freed(self) -> bool:
        return self.running_after == 0 and self.waiting_after == 0


@dataclass(frozen=True)
class LoadPlan:
    concurrency: tuple[int, ...]
    policies: tuple[str, ...]
    requests: int | None  # per level; None: max(32, per_client x concurrency) (LEVEL_REQUESTS)
    max_tokens: int
    sampling: tuple[SamplingSet, ...]  # taken in turn (plan_request)
    threshold: int
    disconnect_fraction: float = 0.0  # of each level's requests, in [0, 1)
    warmup: bool = True  # one untimed wave of `concurrency` requests before each level (see run_level)
    client_processes: int | None = None  # processes sharing a level's streams; None: client_processes()
    repeats: int = 1  # passes over every policy x concurrency, interleaved, so drift hits every policy alike
    max_tokens_low: int | None = None  # each request's max_tokens spread over [low, max_tokens] (plan_request)
    per_client: int = LEVEL_REQUESTS[1]  # requests per client of a level, when `requests` is None

    def requests_at(self, concurrency: int) -> int:
        return self.requests or max(LEVEL_REQUESTS[0], self.per_client * concurrency)


@dataclass(frozen=True)
class TargetCheck:
    name: str  # what is compared, e.g. "cost / off at c=8"
    value: float | int  # a ratio, or a count
    target: str  # e.g. ">= 1.00"
    met: bool
    note: str = ""  # what the line adds, e.g. an A/A control's spread (switchback.check_switchbacks)


def plan_request(plan: LoadPlan, prompts: list[str], index: int) -> RequestSpec:
    """Request `index` of a level: the prompts in turn; the sampling sets in turn, one further on at
    every pass over the prompts; a disconnect when floor((index + 1) x F) > floor(index x F), F being
    disconnect_fraction (floor(n x F) of n requests, evenly spread: every 10th at 0.1); max_tokens the
    plan's, or with max_tokens_low spread evenly over [low, max_tokens] by the golden-ratio sequence (the
    same for every policy). Closed-loop clients whose requests all stop at one length stay in lockstep
    under plain decoding (they arrive together and their prompts share prefill forwards) until a step
    emits more than one token; spread lengths take that artefact out of the comparison."""
    passes, position = divmod(index, len(prompts))
    sampling = plan.sampling[(position + passes) % len(plan.sampling)]
    f = plan.disconnect_fraction
    leaves = int((index + 1) * f) > int(index * f)
    max_tokens = plan.max_tokens
    if plan.max_tokens_low is not None:
        span = plan.max_tokens - plan.max_tokens_low + 1
        max_tokens = plan.max_tokens_low + int((index * GOLDEN) % 1 * span)
    return RequestSpec(index, prompts[position], sampling, DISCONNECT_AFTER_CHUNKS if leaves else None, max_tokens)


def sampling_fields(sampling: SamplingSet, index: int) -> dict:
    """The request body's sampling fields for request `index` of a level."""
    fields = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
              "min_p": sampling.min_p, "seed": index if sampling.seeded else None}
    return {name: value for name, value in fields.items() if value is not None}


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def chunk_problem(chunk: object) -> str | None:
    """Why a streamed chat chunk is not well-formed OpenAI, or None."""
    if not isinstance(chunk, dict):
        return "chunk is not a JSON object"
    if "error" in chunk:
        return f"server error: {chunk['error'].get('message') if isinstance(chunk['error'], dict) else chunk['error']}"
    if chunk.get("object") != "chat.completion.chunk" or not isinstance(chunk.get("choices"), list):
        return f"unexpected chunk: {json.dumps(chunk)[:120]}"
    for choice in chunk["choices"]:
        if not isinstance(choice.get("delta"), dict) or choice.get("finish_reason") not in (None, "stop", "length"):
            return f"malformed choice: {json.dumps(choice)[:120]}"
    usage = chunk.get("usage")
    if usage is not None and not isinstance(usage.get("completion_tokens"), int):
        return "malformed usage"
    return None


async def one_request(client, model: str, spec: RequestSpec) -> RequestResult:
    """Send one streamed chat completion and check every chunk; close early if the spec says so."""
    body = {"model": model, "messages": [{"role": "user", "content": spec.prompt}], "max_tokens": spec.max_tokens,
            **sampling_fields(spec.sampling, spec.index), "stream": True, "stream_options": {"include_usage": True}}
    name = spec.sampling.name
    t0 = time.perf_counter()
    first = last = None
    finish = usage = None
    done = False
    chunks = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult("failed", name, f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: ") or done:
                    return RequestResult("failed", name, f"malformed stream line: {line[:120]!r}")
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                problem = chunk_problem(chunk)
                if problem is not None:
                    return RequestResult("failed", name, problem)
                for choice in chunk["choices"]:  # the server sends a chunk when tokens arrive (text may lag)
                    last = time.perf_counter()
                    first = first or last
                    finish = choice["finish_reason"] or finish
                    chunks += 1
                usage = chunk.get("usage") or usage
                if chunks == spec.disconnect_after and finish is None:  # leaving the block closes the connection
                    return RequestResult("disconnected", name, ttft_s=first - t0, latency_s=time.perf_counter() - t0)
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return RequestResult("failed", name, f"{type(e).__name__}: {e}")
    if not (done and finish and usage):
        return RequestResult("failed", name, f"incomplete stream (done={done}, finish_reason={finish}, "
                                             f"usage={usage is not None})")
    n = usage["completion_tokens"]
    spec_usage = usage.get("speculation") or {}
    return RequestResult(
        "ok", name, ttft_s=None if first is None else first - t0,
        itl_s=(last - first) / (n - 1) if first is not None and n > 1 else None,
        latency_s=time.perf_counter() - t0, completion_tokens=n,
        drafted=spec_usage.get("drafted", 0), accepted=spec_usage.get("accepted", 0),
    )


async def forget_requests(client) -> None:
    """The drafter forgets what it learned from earlier requests (POST /admin/forget; suffix's index), so
    a level drafts from its own earlier requests only, never from the warm wave's or an earlier level's
    answers to the same prompts (as `bench` forgets before each pass)."""
    response = await client.post("/admin/forget")
    if response.status_code == 404:
        raise UserError("the server has no POST /admin/forget: start it with `specdec serve --enable-admin` (specdec of this version or later)")
    response.raise_for_status()


async def scrape(client) -> dict[str, float]:
    """The server's /metrics, parsed."""
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


def metric_total(metrics: dict[str, float], name: str) -> float | None:
    """A metric summed over its label sets; None when the server does not expose it."""
    values = [v for key, v in metrics.items() if key == name or key.startswith(name + "{")]
    return sum(values) if values else None


def sample_memory(requests_done: int, metrics: dict[str, float]) -> MemorySample:
    def mib(name: str) -> float | None:
        total = metric_total(metrics, name)
        return None if total is None else total / 2**20

    engine, frontend = mib("process_resident_memory_bytes"), mib("specdec_frontend_resident_memory_bytes")
    rss = None if engine is None else engine + (frontend or 0.0)  # a leak in either process shows
    return MemorySample(requests_done, rss, mib("specdec_cuda_memory_allocated_bytes"),
                        mib("specdec_cuda_memory_reserved_bytes"))


def memory_growth(samples: list[MemorySample], name: str) -> float | None:
    """Last sample - first of one MemorySample field (MiB); None when either is missing."""
    if not samples:
        return None
    first, last = getattr(samples[0], name), getattr(samples[-1], name)
    return None if first is None or last is None else last - first


def busy_requests(metrics: dict[str, float]) -> tuple[int, int]:
    """(running, waiting) requests on the server."""
    return int(metrics["specdec_requests_running"]), int(metrics["specdec_requests_waiting"])


async def wait_for_idle(client, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, float]:
    """/metrics once no request runs or waits (every row freed), or the last reading after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = await scrape(client)
        if busy_requests(metrics) == (0, 0) or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.1)


@dataclass
class Driven:
    """What one driver of a level's streams answers (drive: this process, or a client process)."""

    end: float  # monotonic time its last request finished
    results: list[RequestResult]
    cpu_s: float = 0.0  # its process's CPU seconds while it drove
    lag_ms: list[float] = field(default_factory=list)  # its event loop's lateness, sampled while it drove (sample_lag)


@dataclass
class Streams:
    """A level's client streams once started: their future (a Driven per driver), and /metrics, the
    monotonic time and the client processes at their start."""

    done: asyncio.Future
    start: dict[str, float]
    t0: float
    processes: int


async def warm_wave(client, model: str, prompts: list[str], plan: LoadPlan, concurrency: int) -> None:
    """One untimed wave of `concurrency` requests (none disconnecting): the batch bucket captures its graphs
    here, not in timed requests."""
    await asyncio.gather(*(one_request(client, model, replace(plan_request(plan, prompts, i), disconnect_after=None))
                           for i in range(concurrency)))


async def start_streams(client, url: str, headers: dict, model: str, prompts: list[str], plan: LoadPlan, n: int,
                        concurrency: int, counts: Counts) -> Streams:
    """Start `concurrency` streams taking requests from `counts` until n are taken, in this process or in
    client processes (client_processes), which connect first: their imports and connections are not timed
    (nor the server's idle wait)."""
    procs = client_processes(concurrency, plan.client_processes)
    if procs == 1:
        start, t0 = await scrape(client), time.monotonic()
        return Streams(asyncio.gather(drive(client, model, prompts, plan, n, concurrency, counts)), start, t0, procs)
    started = start_clients(url, headers, model, prompts, plan, n, concurrency, procs, counts)
    while counts.ready.value < procs and all(proc.is_alive() for proc, _ in started):
        await asyncio.sleep(0.02)
    start, t0 = await scrape(client), time.monotonic()
    counts.go.set()
    return Streams(asyncio.gather(*(asyncio.to_thread(wait_for, proc, queue) for proc, queue in started)), start, t0, procs)


async def run_level(url: str, headers: dict, model: str, prompts: list[str], policy: str, concurrency: int,
                    plan: LoadPlan, progress) -> LevelResult:
    n = plan.requests_at(concurrency)
    async with http_client(url, headers, concurrency) as client:
        if plan.warmup:
            await warm_wave(client, model, prompts, plan, concurrency)
            await wait_for_idle(client)
        await forget_requests(client)
        counts = Counts(mp.get_context("spawn"))
        streams = await start_streams(client, url, headers, model, prompts, plan, n, concurrency, counts)
        drivers = streams.done
        memory = [sample_memory(0, streams.start)]
        seen = 0
        while not drivers.done():  # progress, and memory every MEMORY_EVERY finished requests
            await asyncio.wait({drivers}, timeout=0.05)
            finished = counts.finished.value
            progress.update(finished - seen)
            if finished // MEMORY_EVERY > seen // MEMORY_EVERY and finished < n:
                memory.append(sample_memory(finished, await scrape(client)))
            seen = finished
        progress.update(counts.finished.value - seen)
        driven = drivers.result()
        wall = max(d.end for d in driven) - streams.t0
        results = results_of(driven, n)
        end = await wait_for_idle(client)
        memory.append(sample_memory(len(results), end))
    level = summarize(policy, concurrency, results, wall, memory, streams.start, end)
    lags = [lag for d in driven for lag in d.lag_ms]
    clients = {"clients": sum(d.cpu_s for d in driven) / wall} if wall > 0 else {}
    return replace(level, cpu_cores={**level.cpu_cores, **clients}, client_processes=streams.processes,
                   client_lag_p50_ms=percentile(lags, 50), client_lag_p99_ms=percentile(lags, 99))



def results_of(driven: list[Driven], sent: int) -> list[RequestResult]:
    """Every stream driver's results (Streams.done), and a failure for each of the `sent` requests that a
    client process took and never answered (it died)."""
    results = [r for d in driven for r in d.results]
    return results + [RequestResult("failed", "-", "its client process ended without results")] * (sent - len(results))


def client_processes(concurrency: int, asked: int | None) -> int:
    """Processes that share a level's streams: one Python process parses about 10k chunks/s, which
    bounds what it can measure (a fast server at dozens of streams sends more); at most the CPUs this
    process may run on. `asked` (--client-processes; run_load asks 1 of a server on the CPU) overrides."""
    if asked:
        return max(1, min(asked, concurrency))
    return max(1, min(-(-concurrency // STREAMS_PER_PROCESS), usable_cpus()))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one: Linux; else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def http_client(url: str, headers: dict, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    return httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(600, connect=30))


class Counts:
    """What a level's client processes share: the next request index to send, the requests finished,
    the processes ready to send, and the start signal."""

    def __init__(self, ctx) -> None:
        self.next, self.finished, self.ready, self.go = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()

    def take(self, n: int) -> int | None:
        with self.next.get_lock():
            i = self.next.value
            if i >= n:
                return None
            self.next.value = i + 1
            return i

    def stop(self) -> int:
        """No more requests are taken; how many were."""
        with self.next.get_lock():
            taken, self.next.value = self.next.value, 2**31 - 1  # above any level's n (a C int)
            return taken

    def add(self, counter) -> None:
        with counter.get_lock():
            counter.value += 1


async def drive(client, model: str, prompts: list[str], plan: LoadPlan, n: int, streams: int,
                counts: Counts) -> Driven:
    """`streams` clients send the level's requests back to back until n are taken; when the last finished,
    their results, and this process's CPU time and event-loop lateness meanwhile."""
    results: list[RequestResult] = []
    lags: list[float] = []
    cpu = time.process_time()

    async def worker() -> None:
        while (i := counts.take(n)) is not None:
            results.append(await one_request(client, model, plan_request(plan, prompts, i)))
            counts.add(counts.finished)

    sampler = asyncio.create_task(sample_lag(lags))
    await asyncio.gather(*(worker() for _ in range(streams)))
    sampler.cancel()
    return Driven(time.monotonic(), results, time.process_time() - cpu, lags)


async def sample_lag(lags: list[float]) -> None:
    """Append how late (ms) the event loop runs a timer of LAG_TICK_S, again and again until cancelled. A
    chunk that arrives while the loop is busy with other streams waits about as long before this client
    reads it, so a client's TTFT and ITL include its lateness: a large one means the client, not the
    server, is timing itself (more --client-processes share the streams). A timer of 5 ms wakes the loop
    200 times a second, a fifth of what 1 ms would, where the client shares a CPU server's cores (the
    sampling's own CPU share was not measured)."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        lags.append(1000 * max(0.0, time.perf_counter() - t - LAG_TICK_S))


def start_clients(url: str, headers: dict, model: str, prompts: list[str], plan: LoadPlan, n: int, concurrency: int,
                  procs: int, counts: Counts) -> list[tuple[mp.Process, mp.Queue]]:
    """Client processes sharing the level's `concurrency` streams, each with the queue it answers on."""
    ctx = mp.get_context("spawn")
    started = []
    for k in range(procs):
        streams = concurrency // procs + (k < concurrency % procs)
        queue = ctx.Queue()
        proc = ctx.Process(target=client_process, args=(url, headers, model, prompts, plan, n, streams, counts, queue),
                           daemon=True)
        proc.start()
        started.append((proc, queue))
    return started


def client_process(url: str, headers: dict, model: str, prompts: list[str], plan: LoadPlan, n: int, streams: int,
                   counts: Counts, queue: mp.Queue) -> None:
    """One client process: connect, say it is ready, wait for the start, drive its streams, answer (a Driven)."""
    async def main() -> Driven:
        async with http_client(url, headers, streams) as client:
            counts.add(counts.ready)
            await asyncio.to_thread(counts.go.wait)
            return await drive(client, model, prompts, plan, n, streams, counts)

    queue.put(asyncio.run(main()))


def wait_for(proc: mp.Process, queue: mp.Queue) -> Driven:
    """A client process's answer (Driven); one that died without answering gives no results (its requests then
    count as lost). A process can answer and exit between a timed-out get and the liveness check: its
    answer is then still in the pipe, so a dead process's queue is read once more before giving up."""
    try:
        while True:
            try:
                return queue.get(timeout=1.0)
            except queue_module.Empty:
                if proc.is_alive():
                    continue
                try:
                    return queue.get(timeout=1.0)
                except queue_module.Empty:
                    return Driven(time.monotonic(), [])
    finally:
        proc.join(timeout=10)


def summarize(policy: str, concurrency: int, results: list[RequestResult], wall: float,
              memory: list[MemorySample], start: dict[str, float], end: dict[str, float]) -> LevelResult:
    """One level from its requests, memory samples and the server's /metrics before and after it."""
    good = [r for r in results if r.outcome == "ok"]
    tokens = sum(r.completion_tokens for r in good)
    drafted = sum(r.drafted for r in good)
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    itl = [r.itl_s for r in good if r.itl_s is not None]
    running, waiting = busy_requests(end)
    cancelled = 'specdec_requests_total{status="cancelled"}'
    by_set: dict[str, dict[str, int]] = {}
    for r in results:
        counts = by_set.setdefault(r.sampling, {})
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return LevelResult(
        policy=policy, concurrency=concurrency, requests=len(results), ok=len(good),
        disconnected=sum(r.outcome == "disconnected" for r in results), wall_s=wall,
        completion_tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50_ms=milliseconds(percentile(ttft, 50)), ttft_p99_ms=milliseconds(percentile(ttft, 99)),
        itl_p50_ms=milliseconds(percentile(itl, 50)), itl_p99_ms=milliseconds(percentile(itl, 99)),
        acceptance_rate=sum(r.accepted for r in good) / drafted if drafted else None,
        running_after=running, waiting_after=waiting,
        server_cancelled=int(end.get(cancelled, 0) - start.get(cancelled, 0)), memory=memory,
        server_ttft_mean_ms=histogram_mean_ms(start, end, "specdec_time_to_first_token_seconds"),
        server_queue_mean_ms=histogram_mean_ms(start, end, "specdec_request_queue_time_seconds"),
        steps_by_gamma=steps_by_gamma(start, end),
        cost_moves=counter_deltas(start, end, "specdec_cost_moves_total", "kind"),
        prefill_forwards=counter_deltas(start, end, "specdec_prefill_forwards_total", "kind"),
        decode_shares=decode_shares(start, end),
        gc_seconds=counter_deltas(start, end, "specdec_gc_seconds_total", "generation", float),
        cpu_cores=cpu_cores(start, end, wall),
        rss_growth_mib=memory_growth(memory, "rss_mib"),
        gpu_allocated_growth_mib=memory_growth(memory, "gpu_allocated_mib"),
        gpu_reserved_growth_mib=memory_growth(memory, "gpu_reserved_mib"),
        sampling=by_set, errors=[f"[{r.sampling}] {r.error}" for r in results if r.outcome == "failed"][:5],
    )


def histogram_mean_ms(start: dict[str, float], end: dict[str, float], name: str) -> float | None:
    """The mean of one of the server's histograms over a level, in ms. Its TTFT is a request's time from
    joining the queue to its first token handed to the event loop (the client's TTFT adds HTTP, tokenizing
    and the loop's delivery); its queue time, from joining the queue to the start of its prefill."""
    count = end.get(name + "_count", 0) - start.get(name + "_count", 0)
    return 1000 * (end.get(name + "_sum", 0) - start.get(name + "_sum", 0)) / count if count > 0 else None


def steps_by_gamma(start: dict[str, float], end: dict[str, float]) -> dict[int, int]:
    """The server's decode steps over a level by the gamma its policy chose."""
    steps = counter_deltas(start, end, "specdec_steps_by_gamma_total", "gamma")
    return {int(g): n for g, n in sorted(steps.items(), key=lambda item: int(item[0])) if n}


def counter_deltas(start: dict[str, float], end: dict[str, float], name: str, label: str, cast=int) -> dict:
    """A labelled counter's growth over a level, by the label's value."""
    prefix = f'{name}{{{label}="'
    return {key[len(prefix):-2]: cast(v - start.get(key, 0)) for key, v in end.items() if key.startswith(prefix)}


def decode_shares(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """The server's decode thread over a level: the share of its time idle, admitting and reading prompts,
    waiting for steps' outcomes and on the host's side of steps (server/metrics.DECODE_PARTS). Where a
    first token waits shows here: a thread that waits is paced by the device, one that does not by the host."""
    seconds = counter_deltas(start, end, "specdec_decode_thread_seconds_total", "part", float)
    total = sum(seconds.values())
    return {part: s / total for part, s in seconds.items()} if total > 0 else {}


def cpu_cores(start: dict[str, float], end: dict[str, float], wall: float) -> dict[str, float]:
    """The server's processes' CPU time over a level, in cores busy over its wall: the engine (decode thread,
    bridges; HTTP too with a thread frontend) and the HTTP frontend processes together. A frontend near one
    core per process is where new requests queue before the engine sees them."""
    cores = {}
    for part, name in (("engine", "process_cpu_seconds_total"), ("frontends", "specdec_frontend_cpu_seconds_total")):
        before, after = metric_total(start, name), metric_total(end, name)
        if before is not None and after is not None and wall > 0:
            cores[part] = (after - before) / wall
    return cores


def mean_gamma(steps: dict[int, int]) -> float | None:
    total = sum(steps.values())
    return sum(g * n for g, n in steps.items()) / total if total else None


def prompts_for(task: str, limit: int | None) -> list[str]:
    if task == "short":
        return list(SHORT_PROMPTS[:limit])
    from specdec.bench.tasks import load_tasks

    return [t.prompt for t in load_tasks(task, limit)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(server_args: list[str], log_path: Path, timeout_s: float) -> Iterator[tuple[str, str]]:
    """Start `specdec serve` on a free loopback port with admin on and a fresh API key; (url, key)."""
    port, key = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--enable-admin", *server_args]
    env = {**os.environ, "SPECDEC_API_KEY": key}  # not on the command line, where `ps` shows it
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise UserError(f"the server exited with status {proc.returncode}; see {log_path}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise UserError(f"the server did not come up within {timeout_s:g} s; see {log_path}")
                time.sleep(0.5)
            yield url, key
        finally:
            proc.terminate()  # SIGTERM: uvicorn's graceful shutdown
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def server_info(url: str, headers: dict) -> tuple[str, dict]:
    """(served model id, /health body) of the server at url."""
    try:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=10)
        health = httpx.get(url + "/health", timeout=10)
    except httpx.HTTPError as e:
        raise UserError(f"no server at {url}: {e}") from e
    if models.status_code != 200:
        raise UserError(f"{url}/v1/models answered HTTP {models.status_code}: {models.text[:200]}")
    return models.json()["data"][0]["id"], health.json()


def switch_policy(url: str, headers: dict, policy: str, threshold: int) -> None:
    response = httpx.post(url + "/admin/spec-policy", headers=headers, json={"policy": policy, "threshold": threshold},
                          timeout=30)
    if response.status_code == 404:
        raise UserError(f"{url} has no admin switch: start it with `specdec serve --enable-admin`")
    if response.status_code != 200:
        raise UserError(f"switching to policy {policy!r} failed: HTTP {response.status_code}: {response.text[:200]}")


def policy_order(policies: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The order of the policies' levels at one concurrency in pass `repeat` (from 0): as given in passes 0,
    2, 4, ..., reversed in 1, 3, ..., so that a drift within a concurrency's run favours no policy."""
    return policies if repeat % 2 == 0 else policies[::-1]


def run_load(url: str, key: str | None, prompts: list[str], plan: LoadPlan,
             after_pass: Callable[[dict, list[LevelResult]], None] | None = None) -> tuple[dict, list[LevelResult]]:
    """Every policy x concurrency level against the server at url; (server /health, levels). `after_pass`
    gets (health, the levels so far) after each pass but the last (bench-serve writes its report there)."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model, health = server_info(url, headers)
    if plan.client_processes is None and not str(health.get("device", "")).startswith("cuda"):
        plan = replace(plan, client_processes=1)  # a CPU server sends far less than one process parses, on CPUs it shares
    total = plan.repeats * len(plan.policies) * sum(plan.requests_at(c) for c in plan.concurrency)
    levels = []
    with tqdm(total=total, unit="req", desc="bench-serve") as progress:
        for repeat in range(plan.repeats):
            for c in plan.concurrency:  # the policies compared at c run back to back: what drifts between them is least
                for policy in policy_order(plan.policies, repeat):
                    switch_policy(url, headers, policy, plan.threshold)
                    which = f" pass {repeat + 1}/{plan.repeats}" if plan.repeats > 1 else ""
                    progress.set_postfix_str(f"{policy} c={c}{which}")
                    level = asyncio.run(run_level(url, headers, model, prompts, policy, c, plan, progress))
                    levels.append(replace(level, repeat=repeat))
            if after_pass is not None and repeat < plan.repeats - 1:
                after_pass(health, levels)
    return health, levels


def hardware(health: dict) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"server_device": health.get("device"), "cpu": cpu, "cpu_cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(levels: list[LevelResult]) -> str:
    """A markdown table (readable in a terminal too), with each level's throughput against `off` and the
    server's memory growth over the level (last sample - first, MiB)."""
    off = off_by_pass(levels)
    several = max(lv.repeat for lv in levels) > 0
    head = [*(["pass"] if several else []), "policy", "concurrency", "client procs", "sent", "ok", "disconnected", "lost",
            "tokens/s", "vs off", "TTFT p50 ms", "TTFT p99 ms", "server TTFT ms", "server queue ms", "mean gamma",
            "ITL p50 ms", "ITL p99 ms", "acceptance",
            "RSS growth MiB", "GPU alloc growth MiB", "GPU resv growth MiB"]
    rows = []
    for lv in levels:
        base = off.get((lv.repeat, lv.concurrency))
        ratio = lv.tokens_per_s / base if base else None
        rows.append([*([str(lv.repeat + 1)] if several else []), lv.policy, str(lv.concurrency),
                     str(lv.client_processes), str(lv.requests), str(lv.ok),
                     str(lv.disconnected), str(lv.lost),
                     fmt(lv.tokens_per_s), fmt(ratio, 2), fmt(lv.ttft_p50_ms), fmt(lv.ttft_p99_ms),
                     fmt(lv.server_ttft_mean_ms), fmt(lv.server_queue_mean_ms), fmt(mean_gamma(lv.steps_by_gamma), 2),
                     fmt(lv.itl_p50_ms, 2), fmt(lv.itl_p99_ms, 2), fmt(lv.acceptance_rate, 3),
                     fmt(lv.rss_growth_mib), fmt(lv.gpu_allocated_growth_mib), fmt(lv.gpu_reserved_growth_mib)])
    return markdown_table(head, rows)


def off_by_pass(levels: list[LevelResult]) -> dict[tuple[int, int], float]:
    """(pass, concurrency) -> `off`'s tok/s: what each level is compared with, in its own pass."""
    return {(lv.repeat, lv.concurrency): lv.tokens_per_s for lv in levels if lv.policy == "off"}


def format_medians(levels: list[LevelResult]) -> str:
    """With several passes: per policy and concurrency, the median tok/s and TTFT p50 over passes, the
    median against `off`'s (what the targets judge), the median of the passes' own ratios to their
    pass's `off` ("paired": it cancels what drifts between passes, such as a shared machine's load, where
    the first mixes passes), and the lowest and highest of those ratios (how far one pass can mislead)."""
    tok, ttft = median_by_level(levels, "tokens_per_s"), median_by_level(levels, "ttft_p50_ms")
    off = off_by_pass(levels)
    head = ["policy", "concurrency", "passes", "median tokens/s", "vs off", "paired vs off", "passes' vs off",
            "median TTFT p50 ms"]
    rows = []
    for (policy, c), t in tok.items():
        ratios = [lv.tokens_per_s / off[lv.repeat, c] for lv in levels
                  if (lv.policy, lv.concurrency) == (policy, c) and off.get((lv.repeat, c))]
        passes = sum((lv.policy, lv.concurrency) == (policy, c) for lv in levels)
        rows.append([policy, str(c), str(passes), fmt(t), fmt(t / tok["off", c], 2) if tok.get(("off", c)) else "-",
                     fmt(statistics.median(ratios), 2) if ratios else "-",
                     f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-", fmt(ttft.get((policy, c)))])
    return markdown_table(head, rows)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def check_targets(levels: list[LevelResult]) -> list[TargetCheck]:
    """Issue 13's targets, from whichever levels were measured."""
    return [*check_cost(levels), *check_ttft(levels), *check_requests(levels)]


def median_by_level(levels: list[LevelResult], name: str) -> dict[tuple[str, int], float]:
    """(policy, concurrency) -> the median over passes of a level's figure `name` (passes without it skipped)."""
    values: dict[tuple[str, int], list[float]] = {}
    for lv in levels:
        if getattr(lv, name) is not None:
            values.setdefault((lv.policy, lv.concurrency), []).append(getattr(lv, name))
    return {key: statistics.median(v) for key, v in values.items()}


def check_cost(levels: list[LevelResult]) -> list[TargetCheck]:
    """Per concurrency: `cost` against `off`, and against the better of `off` and `on` where `on` ran
    (medians over passes)."""
    by = median_by_level(levels, "tokens_per_s")
    checks = []
    for c in sorted({lv.concurrency for lv in levels}):
        cost, off, on = by.get(("cost", c)), by.get(("off", c)), by.get(("on", c))
        if cost is not None and off:
            checks += cost_checks(c, cost / off, cost / on if on else None)
    return checks


def cost_checks(concurrency: int, vs_off: float, vs_on: float | None) -> list[TargetCheck]:
    """Issue 13's `cost` targets at one concurrency, from cost / off and cost / on (None: `on` did not run):
    levels (check_cost) and turns (switchback.check_switchbacks) measure the ratios their own ways."""
    checks = [TargetCheck(f"cost / off at c={concurrency}", vs_off, f">= {COST_VS_OFF_TARGET:.2f}", vs_off >= COST_VS_OFF_TARGET)]
    if vs_on is not None:
        best = min(vs_off, vs_on)  # cost / max(off, on)
        checks.append(TargetCheck(f"cost / max(off, on) at c={concurrency}", best, f">= {COST_VS_BEST_TARGET:.2f}",
                                  best >= COST_VS_BEST_TARGET))
    return checks


def check_ttft(levels: list[LevelResult]) -> list[TargetCheck]:
    """Per policy: TTFT p50 at c = TTFT_TARGET_CONCURRENCY and at the largest concurrency / at c = 1
    (medians over passes)."""
    checks = []
    medians = median_by_level(levels, "ttft_p50_ms")
    for policy in dict.fromkeys(lv.policy for lv in levels):
        p50 = {c: t for (p, c), t in medians.items() if p == policy and t}
        if 1 not in p50:
            continue
        for c in sorted({TTFT_TARGET_CONCURRENCY, max(p50)} & p50.keys() - {1}):
            ratio = p50[c] / p50[1]
            checks.append(TargetCheck(f"{policy}: TTFT p50 at c={c} / at c=1", ratio, f"<= {TTFT_TARGET_RATIO:.2f}",
                                      ratio <= TTFT_TARGET_RATIO))
    return checks


def check_requests(levels: list, noun: str = "levels") -> list[TargetCheck]:
    """No request lost or malformed; every level (or switchback load: anything with requests, lost and
    rows_freed) ends with no request running or waiting."""
    lost = sum(lv.lost for lv in levels)
    busy = sum(not lv.rows_freed for lv in levels)
    return [TargetCheck(f"requests lost or malformed, of {sum(lv.requests for lv in levels)}", lost, "= 0", lost == 0),
            TargetCheck(f"{noun} leaving requests running or waiting, of {len(levels)}", busy, "= 0", busy == 0)]


def short_level_note(levels: list[LevelResult]) -> str | None:
    """A warning where a level ran for less than STEADY_LEVEL_S: its ratios are then noise at the few-percent
    scale the cost targets ask about."""
    short = min(levels, key=lambda lv: lv.wall_s, default=None)
    if short is None or short.wall_s >= STEADY_LEVEL_S:
        return None
    return (f"note: the shortest level ({level_name(short)}) lasted {short.wall_s:.2f} s; ratios of levels under "
            f"{STEADY_LEVEL_S:g} s move by several percent from pass to pass: --requests-per-client lengthens them")


def format_checks(checks: list[TargetCheck]) -> list[str]:
    return [f"- {c.name} = {c.value if isinstance(c.value, int) else f'{c.value:.3f}'}: target {c.target} "
            f"{'met' if c.met else 'missed'}" + (f" ({c.note})" if c.note else "") for c in checks]


def level_name(lv: LevelResult) -> str:
    """How a report's lines name a level: "cost c=32", and its pass after the first ("cost c=32 (pass 2)")."""
    return f"{lv.policy} c={lv.concurrency}" + (f" (pass {lv.repeat + 1})" if lv.repeat else "")


def request_lines(levels: list[LevelResult]) -> list[str]:
    """Per level: outcomes, the server's cancellations, what was left running, outcomes per sampling set."""
    lines = []
    for lv in levels:
        sets = "; ".join(f"{name}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
                         for name, counts in lv.sampling.items())
        lines.append(f"- {level_name(lv)}: {lv.requests} sent, {lv.ok} ok, {lv.disconnected} "
                     f"disconnected, {lv.lost} lost; server cancelled {lv.server_cancelled}; running / waiting after "
                     f"the level {lv.running_after} / {lv.waiting_after} ({sets})")
    return lines


def memory_lines(levels: list[LevelResult]) -> list[str]:
    lines = []
    for lv in levels:
        samples = ", ".join(f"{m.requests_done}: {fmt(m.rss_mib)}" + (
            "" if m.gpu_reserved_mib is None else f" / {fmt(m.gpu_allocated_mib)} / {fmt(m.gpu_reserved_mib)}")
            for m in lv.memory)
        lines.append(f"- {level_name(lv)}: growth RSS {fmt(lv.rss_growth_mib)}, GPU allocated "
                     f"{fmt(lv.gpu_allocated_growth_mib)}, GPU reserved {fmt(lv.gpu_reserved_growth_mib)} MiB; "
                     f"after N requests ({samples})")
    return lines


def cost_lines(levels: list[LevelResult]) -> list[str]:
    """Per `cost` level: its steps by gamma and its moves (choices changed, explorations started)."""
    return [f"- {level_name(lv)}: steps by gamma {lv.steps_by_gamma or '-'}; switches {lv.cost_moves.get('switch', '-')}, "
            f"probes {lv.cost_moves.get('probe', '-')}" for lv in levels if lv.policy == "cost"]


def decode_lines(levels: list[LevelResult]) -> list[str]:
    """Per level: the shares of the server's decode thread's time (decode_shares), and the seconds its
    process spent collecting garbage (every thread stops meanwhile), by generation, as a share of the wall."""
    return [f"- {level_name(lv)}: " + ", ".join(f"{part} {100 * share:.0f} %" for part, share in lv.decode_shares.items())
            + ("; garbage collection " + ", ".join(f"gen {g} {100 * s / lv.wall_s:.1f} %" for g, s in lv.gc_seconds.items())
               if lv.gc_seconds and lv.wall_s > 0 else "")
            + ("; CPU cores busy: " + ", ".join(f"{part} {cores:.2f}" for part, cores in lv.cpu_cores.items())
               if lv.cpu_cores else "")
            for lv in levels if lv.decode_shares]


def client_lines(levels: list[LevelResult]) -> list[str]:
    """Per level: the client processes that drove it, their CPU cores busy and their event loops' lateness."""
    return [f"- {level_name(lv)}: {lv.client_processes} process{'es' if lv.client_processes > 1 else ''}, "
            f"CPU cores busy {fmt(lv.cpu_cores.get('clients'), 2)}, event loop late by p50 {fmt(lv.client_lag_p50_ms, 2)} / "
            f"p99 {fmt(lv.client_lag_p99_ms, 2)} ms" for lv in levels]


def describe_sampling(config: dict) -> str:
    sets = config["sampling"]
    return sets[0]["name"] if len(sets) == 1 else "mixed, in turn: " + ", ".join(s["name"] for s in sets)


def write_report(out: Path, config: dict, hw: dict, levels: list[LevelResult]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    checks = check_targets(levels)
    results = {"config": config, "hardware": hw, "levels": [{**asdict(lv), "lost": lv.lost} for lv in levels],
               "targets": [asdict(c) for c in checks]}
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(results, indent=2))
    plot = plot_throughput(levels, out / "throughput.png")
    md = [
        "# specdec bench-serve", "",
        f"Server device: {hw['server_device']}; client CPU: {hw['cpu']} ({hw['cpu_cores']} cores); torch {hw['torch']}.",
        f"Model {config['model']}, drafter {config['drafter']}, gamma {config['gamma']}, "
        f"max_tokens {config['max_tokens']}, sampling {describe_sampling(config)}, task {config['task']}, "
        f"batch-threshold {config['threshold']}, disconnect fraction {config['disconnect_fraction']:g} "
        f"(after {DISCONNECT_AFTER_CHUNKS} chunks).", "",
        "Throughput = completion tokens of the completed requests / wall seconds of the level; TTFT = request "
        "sent to the first chunk (sent with the first token); ITL = per-request time per output token after the "
        "first; both over completed requests. All measured on the client, in one run. Memory growth = the "
        "server's last sample of the level - its first (MiB).", "",
        format_table(levels), "",
        *(["## Medians over passes", "", "Each pass ran every concurrency once, and at each every policy, back to back (in the given order in odd passes, reversed in even ones).", "",
            format_medians(levels), ""] if max(lv.repeat for lv in levels) else []),
        "## Targets (issue 13), from the levels above (medians over passes)", "", *format_checks(checks),
        *([f"- {note}"] if (note := short_level_note(levels)) else []), "",
        "## Requests", "", *request_lines(levels),
        *[f"- {level_name(lv)}: {e}" for lv in levels for e in lv.errors],
        "", "## Server memory", "",
        "MiB, RSS (/ GPU allocated / GPU reserved on CUDA), sampled after N requests of the level.", "",
        *memory_lines(levels), "",
        *(["## The cost policy's choices", "", "Over each level: the server's steps by the gamma chosen, how often "
           "`cost` changed its choice (switches) and how often it explored another gamma for a few steps "
           "(probes).", "", *cost_lines(levels), ""] if any(lv.policy == "cost" for lv in levels) else []),
        *(["## The server's decode thread", "", "Its time over each level: idle (no request), prefill (admitting "
           "requests, reading their prompts, handing first tokens out), wait (for a step's outcome from the "
           "device), host (launching steps, handing their tokens out). CPU cores busy: the server's processes' "
           "CPU seconds over the level's wall (the engine; the HTTP frontend processes together, where HTTP is "
           "served apart), and the clients' (below).", "", *decode_lines(levels), ""]
          if any(lv.decode_shares for lv in levels) else []),
        "## The client", "", "The processes that drove each level's streams, their CPU seconds over the level's wall, "
        "and how late their event loops ran a 5-ms timer, sampled throughout: a chunk that arrives while a loop "
        "is busy with other streams waits about that long before it is read, so TTFT and ITL include it. Where "
        "it is a sizeable part of TTFT, the client is timing itself: `--client-processes` spreads the streams "
        "over more processes.", "", *client_lines(levels), "",
    ]
    return finish_report(paths, md, plot, "throughput vs concurrency")


def finish_report(paths: list[Path], md: list[str], plot: Path | None, caption: str) -> list[Path]:
    """Write report.md (paths[1]) with the plot, where there is one, at its end; every file written."""
    if plot is not None:
        md += [f"![{caption}]({plot.name})", ""]
        paths.append(plot)
    paths[1].write_text("\n".join(md))
    return paths


def optional_pyplot():
    """matplotlib's pyplot on the Agg backend, or None without the `report` extra (the plots are skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_throughput(levels: list[LevelResult], path: Path) -> Path | None:
    plt = optional_pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(lv.policy for lv in levels):
        points = sorted((lv.concurrency, lv.tokens_per_s) for lv in levels if lv.policy == policy)
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (clients)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("specdec serve: throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

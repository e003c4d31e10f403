"""`specdec bench-serve`: a load generator against the server on loopback, per policy and concurrency.

One warm server (started here with --enable-admin and a random API key, or an existing one at --url
started with --enable-admin) serves every level; the speculation policy is switched between levels
through POST /admin/spec-policy. At concurrency c, c clients send streamed chat completions back to
back, cycling through the prompt set, until --requests have finished. Measured on the client:
- throughput: completion tokens of the level / its wall seconds;
- TTFT: request sent to the first chunk (it comes with the first token); ITL: (last chunk - first) /
  (completion tokens - 1) per request, i.e. time per output token; p50 and p99 over the level's requests;
- every response is checked: HTTP 200, each chunk well-formed, a finish reason, usage, then [DONE];
- server RSS (process_resident_memory_bytes from /metrics) at the level's start, after every 1,000
  requests and at its end.
Writes results.json, report.md and throughput.png (tokens/s vs concurrency per policy).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

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
RSS_EVERY = 1000


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class LevelResult:
    policy: str
    concurrency: int
    requests: int
    ok: int
    wall_s: float
    completion_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    acceptance_rate: float | None
    rss_mib: list[tuple[int, float | None]] = field(default_factory=list)  # (requests done, MiB)
    errors: list[str] = field(default_factory=list)  # the first few

    @property
    def lost(self) -> int:
        return self.requests - self.ok


@dataclass(frozen=True)
class LoadPlan:
    concurrency: tuple[int, ...]
    policies: tuple[str, ...]
    requests: int | None  # per level; None: max(8, 4 x concurrency)
    max_tokens: int
    temperature: float
    threshold: int

    def requests_at(self, concurrency: int) -> int:
        return self.requests or max(8, 4 * concurrency)


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


async def one_request(client, model: str, prompt: str, max_tokens: int, temperature: float) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    finish = usage = None
    done = False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(False, f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: ") or done:
                    return RequestResult(False, f"malformed stream line: {line[:120]!r}")
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                problem = chunk_problem(chunk)
                if problem is not None:
                    return RequestResult(False, problem)
                for choice in chunk["choices"]:  # the server sends a chunk when tokens arrive (text may lag)
                    last = time.perf_counter()
                    first = first or last
                    finish = choice["finish_reason"] or finish
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return RequestResult(False, f"{type(e).__name__}: {e}")
    if not (done and finish and usage):
        return RequestResult(False, f"incomplete stream (done={done}, finish_reason={finish}, usage={usage is not None})")
    n = usage["completion_tokens"]
    spec = usage.get("speculation") or {}
    return RequestResult(
        True, ttft_s=None if first is None else first - t0,
        itl_s=(last - first) / (n - 1) if first is not None and n > 1 else None,
        latency_s=time.perf_counter() - t0, completion_tokens=n,
        drafted=spec.get("drafted", 0), accepted=spec.get("accepted", 0),
    )


async def read_rss_mib(client) -> float | None:
    response = await client.get("/metrics")
    rss = parse_metrics(response.text).get("process_resident_memory_bytes")
    return None if rss is None else rss / 2**20


async def run_level(url: str, headers: dict, model: str, prompts: list[str], policy: str, concurrency: int,
                    plan: LoadPlan, progress) -> LevelResult:
    n = plan.requests_at(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(600, connect=30)) as client:
        rss = [(0, await read_rss_mib(client))]
        results: list[RequestResult] = []
        sent = 0

        async def worker() -> None:
            nonlocal sent
            while sent < n:
                i, sent = sent, sent + 1
                results.append(await one_request(client, model, prompts[i % len(prompts)], plan.max_tokens, plan.temperature))
                progress.update(1)
                if len(results) % RSS_EVERY == 0 and len(results) < n:
                    rss.append((len(results), await read_rss_mib(client)))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        rss.append((len(results), await read_rss_mib(client)))
    return summarize(policy, concurrency, results, wall, rss)


def summarize(policy: str, concurrency: int, results: list[RequestResult], wall: float,
              rss: list[tuple[int, float | None]]) -> LevelResult:
    good = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in good)
    drafted = sum(r.drafted for r in good)
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    itl = [r.itl_s for r in good if r.itl_s is not None]
    return LevelResult(
        policy=policy, concurrency=concurrency, requests=len(results), ok=len(good), wall_s=wall,
        completion_tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50_ms=milliseconds(percentile(ttft, 50)), ttft_p99_ms=milliseconds(percentile(ttft, 99)),
        itl_p50_ms=milliseconds(percentile(itl, 50)), itl_p99_ms=milliseconds(percentile(itl, 99)),
        acceptance_rate=sum(r.accepted for r in good) / drafted if drafted else None,
        rss_mib=rss, errors=[r.error for r in results if not r.ok][:5],
    )


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


def run_load(url: str, key: str | None, prompts: list[str], plan: LoadPlan) -> tuple[dict, list[LevelResult]]:
    """Every policy x concurrency level against the server at url; (server /health, levels)."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model, health = server_info(url, headers)
    total = len(plan.policies) * sum(plan.requests_at(c) for c in plan.concurrency)
    levels = []
    with tqdm(total=total, unit="req", desc="bench-serve") as progress:
        for policy in plan.policies:
            switch_policy(url, headers, policy, plan.threshold)
            for c in plan.concurrency:
                progress.set_postfix_str(f"{policy} c={c}")
                levels.append(asyncio.run(run_level(url, headers, model, prompts, policy, c, plan, progress)))
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
    """A markdown table (readable in a terminal too), with each level's throughput against `off`."""
    off = {lv.concurrency: lv.tokens_per_s for lv in levels if lv.policy == "off"}
    head = ["policy", "concurrency", "ok / sent", "tokens/s", "vs off", "TTFT p50 ms", "TTFT p99 ms",
            "ITL p50 ms", "ITL p99 ms", "acceptance"]
    rows = []
    for lv in levels:
        ratio = lv.tokens_per_s / off[lv.concurrency] if off.get(lv.concurrency) else None
        rows.append([lv.policy, str(lv.concurrency), f"{lv.ok} / {lv.requests}", fmt(lv.tokens_per_s),
                     fmt(ratio, 2), fmt(lv.ttft_p50_ms), fmt(lv.ttft_p99_ms), fmt(lv.itl_p50_ms, 2),
                     fmt(lv.itl_p99_ms, 2), fmt(lv.acceptance_rate, 3)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def cost_summary(levels: list[LevelResult]) -> list[str]:
    """Per concurrency: `cost` against `off` and against the better of `off` and `on` (the issue's targets)."""
    by = {(lv.policy, lv.concurrency): lv.tokens_per_s for lv in levels}
    lines = []
    for c in sorted({lv.concurrency for lv in levels}):
        cost, off, on = by.get(("cost", c)), by.get(("off", c)), by.get(("on", c))
        if cost is None or not off:
            continue
        best = max(x for x in (off, on) if x is not None)
        lines.append(f"- concurrency {c}: cost / off = {cost / off:.2f}, cost / best(off, on) = {cost / best:.2f}")
    return lines


def rss_lines(levels: list[LevelResult]) -> list[str]:
    lines = []
    for lv in levels:
        samples = ", ".join(f"{n}: {fmt(m)}" for n, m in lv.rss_mib)
        lines.append(f"- {lv.policy} at concurrency {lv.concurrency}: server RSS MiB after N requests ({samples})")
    return lines


def write_report(out: Path, config: dict, hw: dict, levels: list[LevelResult]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": config, "hardware": hw, "levels": [{**asdict(lv), "lost": lv.lost} for lv in levels]}
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(results, indent=2))
    plot = plot_throughput(levels, out / "throughput.png")
    lost = sum(lv.lost for lv in levels)
    md = [
        "# specdec bench-serve", "",
        f"Server device: {hw['server_device']}; client CPU: {hw['cpu']} ({hw['cpu_cores']} cores); torch {hw['torch']}.",
        f"Model {config['model']}, drafter {config['drafter']}, gamma {config['gamma']}, "
        f"max_tokens {config['max_tokens']}, temperature {config['temperature']}, task {config['task']}, "
        f"batch-threshold {config['threshold']}.", "",
        "Throughput = completion tokens / wall seconds of the level; TTFT = request sent to the first chunk "
        "(sent with the first token); ITL = per-request time per output token after the first. "
        "All measured on the client, in one run.", "",
        format_table(levels), "",
        *(["## cost policy against off and on", "", *cost_summary(levels), ""] if cost_summary(levels) else []),
        "## Requests", "",
        f"{sum(lv.requests for lv in levels)} sent, {lost} lost or malformed.", "",
        *[f"- {lv.policy} c={lv.concurrency}: {e}" for lv in levels for e in lv.errors],
        "", "## Server memory", "", *rss_lines(levels), "",
    ]
    if plot is not None:
        md += [f"![throughput vs concurrency]({plot.name})", ""]
        paths.append(plot)
    paths[1].write_text("\n".join(md))
    return paths


def plot_throughput(levels: list[LevelResult], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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

"""`specdec bench-serve`: the load generator against the server on loopback over a tiny random model
(every level measured, mixed sampling, disconnecting clients, rows freed, memory samples), the targets
computed from the levels, the CUDA memory gauges, and one-line errors for bad arguments."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections import Counter
from dataclasses import replace

import pytest

from specdec.server.app import SamplingFields
from specdec.server.bench import (DISCONNECT_AFTER_CHUNKS, SAMPLING_MIX, STEADY_LEVEL_S, Driven, LevelResult, LoadPlan,
                                  MemorySample, check_targets, client_processes, fixed_sampling, format_medians,
                                  plan_request, run_load, sample_lag, sample_memory, sampling_fields, short_level_note,
                                  wait_for, write_report)
from specdec.server.metrics import CudaMemory, ServerMetrics, parse_metrics, read_cuda_memory
from specdec.server.policy import measure_batch_costs
from test_server import KEY, MODEL, PROMPTS, make_scheduler, model, serving  # noqa: F401 (model: the fixture)

HARDWARE = {"server_device": "cpu", "cpu": "x", "cpu_cores": 1, "torch": "t"}


def report_config(plan: LoadPlan) -> dict:
    return {"model": MODEL, "drafter": "ngram", "gamma": 3, "max_tokens": plan.max_tokens, "task": "test",
            "threshold": plan.threshold, "sampling": [vars(s) for s in plan.sampling],
            "disconnect_fraction": plan.disconnect_fraction}


def test_bench_serve_measures_every_level(model, tmp_path):
    costs = measure_batch_costs(model, [1, 2], [1, 2, 3, 4], context=16, repeats=1)
    scheduler = make_scheduler(model, policy="off", costs=costs)
    plan = LoadPlan(concurrency=(1, 2), policies=("off", "on", "cost"), requests=3, max_tokens=8,
                    sampling=fixed_sampling(0.0), threshold=2)
    with serving(scheduler, admin=True) as (url, _):
        health, levels = run_load(url, KEY, PROMPTS, plan)
    assert [(lv.policy, lv.concurrency) for lv in levels] == [(p, c) for c in (1, 2) for p in plan.policies]  # concurrency-major
    assert all(lv.ok == lv.requests == 3 and lv.completion_tokens == 24 and lv.tokens_per_s > 0 for lv in levels)
    assert all(lv.ttft_p50_ms is not None and lv.memory[-1].rss_mib > 0 for lv in levels)
    assert all(lv.rows_freed and lv.disconnected == lv.server_cancelled == 0 for lv in levels)
    assert all(lv.client_processes == 1 for lv in levels)  # 2 streams: one process (and one for a CPU server)
    assert levels[0].acceptance_rate is None and levels[1].acceptance_rate is not None  # off never drafts, on does
    assert set(levels[0].steps_by_gamma) == {0} and max(levels[1].steps_by_gamma) == scheduler.policy.gamma
    assert all(0 < lv.server_ttft_mean_ms <= lv.ttft_p99_ms for lv in levels)  # the client's TTFT holds the server's
    assert all(0 <= lv.server_queue_mean_ms < lv.server_ttft_mean_ms for lv in levels)  # the queue is part of it
    assert all(sum(lv.prefill_forwards.values()) >= 1 for lv in levels)  # each request's prompt was read
    assert all(abs(sum(lv.decode_shares.values()) - 1) < 1e-6 and lv.decode_shares["host"] > 0 for lv in levels)
    files = write_report(tmp_path, {**report_config(plan), "model": health["model"]}, HARDWARE, levels)
    assert {f.name for f in files} == {"results.json", "report.md", "throughput.png"}
    report = (tmp_path / "report.md").read_text()
    assert "| cost" in report and "cost / off at c=2 = " in report and "cost / max(off, on) at c=1 = " in report
    assert "## The server's decode thread" in report and "- on c=2: idle " in report
    assert all(lv.cpu_cores["clients"] > 0 and 0 <= lv.client_lag_p50_ms <= lv.client_lag_p99_ms for lv in levels)
    assert "- on c=2: 1 process, CPU cores busy " in report
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["levels"][5]["lost"] == 0 and results["levels"][5]["rss_growth_mib"] is not None
    assert {t["name"] for t in results["targets"]} >= {"cost / off at c=1", "off: TTFT p50 at c=2 / at c=1"}


def test_mixed_sampling_and_disconnects_lose_nothing_and_free_every_row(model):
    scheduler = make_scheduler(model, policy="on", max_batch=4)
    plan = LoadPlan(concurrency=(4,), policies=("on",), requests=12, max_tokens=96, sampling=SAMPLING_MIX,
                    threshold=2, disconnect_fraction=0.25, client_processes=2)  # two processes share the 4 streams
    with serving(scheduler, admin=True) as (url, _):
        _, [level] = run_load(url, KEY, PROMPTS, plan)
    assert level.client_processes == 2
    assert level.cpu_cores["clients"] > 0 and level.client_lag_p99_ms is not None  # both processes' answers
    assert (level.requests, level.ok, level.disconnected, level.lost) == (12, 9, 3, 0), level.errors
    assert level.rows_freed and not scheduler.batch.active.any()
    assert 0 < level.server_cancelled <= level.disconnected  # the server saw clients leave mid-stream
    assert set(level.sampling) == {s.name for s in SAMPLING_MIX}
    assert sum(counts.get("disconnected", 0) for counts in level.sampling.values()) == 3
    assert [m.requests_done for m in level.memory] == [0, 12] and level.rss_growth_mib is not None
    assert (level.gpu_reserved_growth_mib is None) == (read_cuda_memory() == [])  # measured where CUDA holds memory


def test_a_busy_client_loop_shows_as_lateness():
    """sample_lag: while the loop is blocked (a client parsing other streams' chunks), its timer runs late by
    about as long; an idle loop's barely."""
    async def measure(blocked_s: float) -> list[float]:
        lags: list[float] = []
        sampler = asyncio.create_task(sample_lag(lags))
        for _ in range(5):
            await asyncio.sleep(0.006)
            time.sleep(blocked_s)  # holds the loop past the sampler's timer
        sampler.cancel()
        return lags

    busy, idle = asyncio.run(measure(0.03)), asyncio.run(measure(0.0))
    assert max(busy) >= 15 and len(busy) >= 3
    assert sorted(idle)[len(idle) // 2] < 5


class ExitedProcess:
    """A client process that has exited: alive no more, joined at once."""

    def is_alive(self) -> bool:
        return False

    def join(self, timeout=None) -> None:
        pass


class LateQueue:
    """A queue whose answer lands just after the first get timed out (the process answered, then exited)."""

    def __init__(self, answer):
        self.answers = [None, answer]

    def get(self, timeout=None):
        answer = self.answers.pop(0)
        if answer is None:
            raise queue.Empty
        return answer


def test_a_client_process_that_answers_as_it_exits_is_not_counted_lost():
    answer = Driven(12.5, ["a result"], 0.5, [0.1])
    assert wait_for(ExitedProcess(), LateQueue(answer)) == answer
    lost = wait_for(ExitedProcess(), queue.Queue())  # died without answering: its requests are lost
    assert lost.results == [] and lost.end > 0


def test_client_processes_share_the_streams_up_to_the_cpus(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    assert [client_processes(c, None) for c in (1, 8, 9, 32, 64)] == [1, 1, 2, 4, 6]
    monkeypatch.delattr("os.sched_getaffinity")  # macOS has no affinity: all its CPUs count
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    assert client_processes(64, None) == 3
    assert client_processes(4, 3) == 3 and client_processes(2, 8) == 2  # asked; never more than the streams


def test_requests_spread_disconnects_and_meet_every_sampling_set():
    plan = LoadPlan(concurrency=(1,), policies=("on",), requests=2000, max_tokens=8, sampling=SAMPLING_MIX,
                    threshold=2, disconnect_fraction=0.1)
    specs = [plan_request(plan, PROMPTS, i) for i in range(2000)]
    leaving = [s.index for s in specs if s.disconnect_after is not None]
    assert len(leaving) == 200 and leaving[:3] == [9, 19, 29]  # every 10th
    assert {s.disconnect_after for s in specs} == {None, DISCONNECT_AFTER_CHUNKS}
    pairs = Counter((s.prompt, s.sampling.name) for s in specs[: len(PROMPTS) * len(SAMPLING_MIX)])
    assert len(pairs) == len(PROMPTS) * len(SAMPLING_MIX)  # each prompt with every set
    assert Counter(s.sampling.name for s in specs[:10]) == Counter({s.name: 2 for s in SAMPLING_MIX})  # mixed at once
    none_leave = LoadPlan((1,), ("on",), 50, 8, fixed_sampling(0.5), 2)
    assert all(plan_request(none_leave, PROMPTS, i).disconnect_after is None for i in range(50))
    assert {s.max_tokens for s in specs} == {8}


def test_request_lengths_spread_evenly_over_a_range():
    plan = LoadPlan((4,), ("off", "cost"), 200, 128, fixed_sampling(0.0), 2, max_tokens_low=64)
    lengths = [plan_request(plan, PROMPTS, i).max_tokens for i in range(200)]
    assert min(lengths) == 64 and max(lengths) == 128
    assert len(set(lengths[:4])) == 4  # a wave of closed-loop clients asks for different lengths
    halves = Counter(n < 96 for n in lengths)
    assert abs(halves[True] - halves[False]) <= 4  # even: about as many below the middle as above
    assert lengths == [plan_request(plan, PROMPTS, i).max_tokens for i in range(200)]  # the same for every policy


def test_sampling_fields_are_ones_the_server_reads():
    accepted = set(SamplingFields.model_fields)
    for i, sampling in enumerate(SAMPLING_MIX):
        fields = sampling_fields(sampling, 7)
        assert set(fields) <= accepted and SamplingFields(**fields)  # named and ranged as the server wants
        assert fields.get("seed") == (7 if sampling.seeded else None)
    assert sampling_fields(SAMPLING_MIX[0], 3) == {"temperature": 0.0}
    assert fixed_sampling(0.0)[0].name == "greedy" and fixed_sampling(0.7)[0].name == "t=0.7"


def level(policy: str, concurrency: int, tokens_per_s: float, ttft_ms: float, ok: int = 4, disconnected: int = 0,
          running_after: int = 0) -> LevelResult:
    return LevelResult(policy, concurrency, requests=4, ok=ok, disconnected=disconnected, wall_s=1.0, completion_tokens=0,
                       tokens_per_s=tokens_per_s, ttft_p50_ms=ttft_ms, ttft_p99_ms=None, itl_p50_ms=None,
                       itl_p99_ms=None, acceptance_rate=None, running_after=running_after, waiting_after=0,
                       server_cancelled=disconnected)


def test_targets_come_from_the_measured_levels():
    levels = [level("off", 1, 100, 10), level("off", 32, 1000, 15), level("off", 64, 1500, 40),
              level("on", 1, 150, 10), level("on", 32, 900, 25), level("on", 64, 1200, 50),
              level("cost", 1, 148, 10), level("cost", 32, 990, 19), level("cost", 64, 1400, 30, ok=3, disconnected=1)]
    checks = {c.name: c for c in check_targets(levels)}
    assert checks["cost / off at c=1"].met and checks["cost / off at c=1"].value == pytest.approx(1.48)
    assert checks["cost / max(off, on) at c=1"].met  # 148 / 150 >= 0.95
    assert not checks["cost / off at c=32"].met and checks["cost / max(off, on) at c=32"].met  # 0.99 x off
    assert not checks["cost / off at c=64"].met and not checks["cost / max(off, on) at c=64"].met  # 0.93
    assert checks["off: TTFT p50 at c=32 / at c=1"].met and not checks["on: TTFT p50 at c=32 / at c=1"].met
    assert checks["cost: TTFT p50 at c=64 / at c=1"].value == pytest.approx(3.0)
    assert checks["requests lost or malformed, of 36"].met  # a disconnect is not a loss
    assert checks["levels leaving requests running or waiting, of 9"].met
    bad = check_targets([level("on", 1, 1, 1, ok=3), level("on", 2, 1, 1, running_after=1)])
    assert [(c.name, c.value, c.met) for c in bad[-2:]] == [("requests lost or malformed, of 8", 1, False),
                                                           ("levels leaving requests running or waiting, of 2", 1, False)]


def test_a_short_level_is_flagged():
    long, short = replace(level("on", 64, 1, 1), wall_s=STEADY_LEVEL_S), replace(level("off", 4, 1, 1), wall_s=0.45)
    assert short_level_note([long]) is None and short_level_note([]) is None
    note = short_level_note([long, short])
    assert "off c=4" in note and "0.45 s" in note and "--requests-per-client" in note


def test_repeats_interleave_the_policies(model):
    """--repeats N: N passes, each over every concurrency and at each every policy, in the given order in the
    first pass and reversed in the second (a drift favours neither), each level tagged with its pass."""
    costs = measure_batch_costs(model, [1], [1, 2, 3, 4], context=16, repeats=1)
    plan = LoadPlan(concurrency=(1,), policies=("off", "cost"), requests=2, max_tokens=4,
                    sampling=fixed_sampling(0.0), threshold=2, repeats=2)
    saved = []
    with serving(make_scheduler(model, policy="off", costs=costs), admin=True) as (url, _):
        _, levels = run_load(url, KEY, PROMPTS, plan, after_pass=lambda health, done: saved.append(len(done)))
    assert [(lv.repeat, lv.policy) for lv in levels] == [(0, "off"), (0, "cost"), (1, "cost"), (1, "off")]
    assert saved == [2]  # after the first pass (the caller writes the last)
    assert all(lv.ok == 2 and lv.rows_freed for lv in levels)
    assert all(set(lv.cost_moves) == {"switch", "probe"} for lv in levels)  # scraped from /metrics at every level
    assert all(not any(lv.cost_moves.values()) for lv in levels if lv.policy == "off")


def test_a_policy_switched_back_to_resumes_what_it_learned(model):
    """bench-serve switches policies between levels; `cost` switched back to keeps its measured steps and
    acceptance, as a server running it all along would, instead of starting cold at every level."""
    import httpx

    costs = measure_batch_costs(model, [1], [1, 2, 3, 4], context=16, repeats=1)
    scheduler = make_scheduler(model, policy="off", costs=costs)
    headers = {"Authorization": f"Bearer {KEY}"}
    with serving(scheduler, admin=True) as (url, _):
        def switch(policy: str, threshold: int | None = None):
            body = {"policy": policy} if threshold is None else {"policy": policy, "threshold": threshold}
            assert httpx.post(url + "/admin/spec-policy", headers=headers, json=body).status_code == 200
            return scheduler.policy

        off = scheduler.policy
        cost = switch("cost")
        cost.observe_step_time(1, 2, 0.5)
        assert switch("on") is not cost and switch("off") is off
        assert switch("cost") is cost and list(cost.steps.seen[1, 2]) == [0.5]
        assert switch("batch-threshold", 2) is not switch("batch-threshold", 3)  # a threshold is part of the policy
        assert httpx.post(url + "/admin/spec-policy", headers=headers, json={"policy": "sometimes"}).status_code == 400


def test_targets_take_medians_over_interleaved_passes(tmp_path):
    """With --repeats the targets judge each level's median over passes: one pass at 0.90x `off` does not
    decide "cost >= off" when the other two run at 1.05 and 1.10; the report gives the passes' range."""
    levels = [replace(lv, repeat=r) for r, (cost, ttft) in enumerate([(90, 9), (110, 12), (105, 30)])
              for lv in (level("off", 1, 100, 10), level("cost", 1, cost, ttft))]
    checks = {c.name: c for c in check_targets(levels)}
    assert checks["cost / off at c=1"].value == pytest.approx(1.05) and checks["cost / off at c=1"].met
    table = format_medians(levels)
    assert "| cost   | 1           | 3      | 105.0           | 1.05   | 1.05          | 0.90-1.10" in table
    assert "| 12.0" in table  # the cost level's median TTFT p50 (9, 12, 30)
    plan = LoadPlan((1,), ("off", "cost"), 4, 8, fixed_sampling(0.0), 2)
    write_report(tmp_path, report_config(plan), HARDWARE, levels)
    report = (tmp_path / "report.md").read_text()
    assert "## Medians over passes" in report and "| pass | policy |" in report
    assert "## The cost policy's choices" in report and "- cost c=1 (pass 2): steps by gamma -; switches -" in report


def test_paired_ratios_cancel_what_drifts_between_passes():
    """`off` at 100, 120 and 80 tok/s over three passes (a shared machine's load), `cost` 1.00x, 1.05x and
    1.05x its pass's `off`: the medians over passes give 1.00, the passes' own ratios 1.05."""
    levels = [replace(lv, repeat=r) for r, (off, cost) in enumerate([(100, 100), (120, 126), (80, 84)])
              for lv in (level("off", 4, off, 10), level("cost", 4, cost, 10))]
    table = format_medians(levels)
    assert "| cost   | 4           | 3      | 100.0           | 1.00   | 1.05          | 1.00-1.05" in table


def test_cuda_memory_gauges_are_scraped_per_device(monkeypatch):
    import specdec.server.metrics as metrics

    monkeypatch.setattr(metrics, "read_cuda_memory", lambda: [])
    assert "specdec_cuda_memory" not in ServerMetrics().render(0, 0, "on")  # none where CUDA holds no memory
    devices = [CudaMemory(0, 3 << 20, 8 << 20), CudaMemory(1, 1 << 20, 2 << 20)]
    monkeypatch.setattr(metrics, "read_cuda_memory", lambda: devices)
    scraped = parse_metrics(ServerMetrics().render(0, 0, "on"))
    assert scraped['specdec_cuda_memory_reserved_bytes{device="1"}'] == 2 << 20
    sample = sample_memory(5, scraped)
    assert (sample.requests_done, sample.gpu_allocated_mib, sample.gpu_reserved_mib) == (5, 4.0, 10.0)
    assert sample.rss_mib > 0
    frontend = {**scraped, "specdec_frontend_resident_memory_bytes": 3 << 20}  # HTTP in a process of its own
    assert sample_memory(5, frontend).rss_mib == pytest.approx(sample.rss_mib + 3, abs=1.0)


def test_cpu_cores_are_the_processes_cpu_seconds_over_the_wall(tmp_path):
    """The engine's process_cpu_seconds_total and every frontend's, summed, over a level's wall; a server
    without frontend processes (the CPU's thread frontend) has the engine's only."""
    import os

    from specdec.server.bench import cpu_cores
    from specdec.server.metrics import frontend_usage_lines

    start = {"process_cpu_seconds_total": 10.0, 'specdec_frontend_cpu_seconds_total{frontend="0"}': 1.0,
             'specdec_frontend_cpu_seconds_total{frontend="1"}': 2.0}
    end = {"process_cpu_seconds_total": 13.0, 'specdec_frontend_cpu_seconds_total{frontend="0"}': 2.5,
           'specdec_frontend_cpu_seconds_total{frontend="1"}': 3.5}
    assert cpu_cores(start, end, 2.0) == {"engine": 1.5, "frontends": 1.5}
    assert cpu_cores({"process_cpu_seconds_total": 1.0}, {"process_cpu_seconds_total": 2.0}, 4.0) == {"engine": 0.25}
    mine = parse_metrics("\n".join(frontend_usage_lines([os.getpid(), None])))  # this process stands in for one
    assert mine['specdec_frontend_resident_memory_bytes{frontend="0"}'] > 0 and len(mine) == 2
    plan = LoadPlan((4,), ("cost",), 4, 8, SAMPLING_MIX, 2, 0.0)
    write_report(tmp_path, report_config(plan), HARDWARE, [replace(level("cost", 4, 100, 10), decode_shares={"host": 1.0},
                                                                   cpu_cores={"engine": 1.25, "frontends": 0.5})])
    assert "- cost c=4: host 100 %; CPU cores busy: engine 1.25, frontends 0.50" in (tmp_path / "report.md").read_text()


def test_write_report_shows_memory_growth_and_disconnects(tmp_path):
    lv = level("cost", 64, 100, 10, ok=3, disconnected=1)
    lv.memory = [MemorySample(0, 100.0, 10.0, 20.0), MemorySample(4, 101.5, 10.0, 20.0)]
    lv.rss_growth_mib, lv.gpu_allocated_growth_mib, lv.gpu_reserved_growth_mib = 1.5, 0.0, 0.0
    plan = LoadPlan((64,), ("cost",), 4, 8, SAMPLING_MIX, 2, 0.25)
    write_report(tmp_path, report_config(plan), HARDWARE, [lv])
    report = (tmp_path / "report.md").read_text()
    assert "sampling mixed, in turn: greedy, t=0.7 top_p=0.95" in report and "disconnect fraction 0.25" in report
    assert "4 sent, 3 ok, 1 disconnected, 0 lost" in report and "growth RSS 1.5, GPU allocated 0.0" in report
    assert "requests lost or malformed, of 4 = 0: target = 0 met" in report


@pytest.mark.parametrize("argv, message", [
    (["--disconnect-fraction", "1"], "--disconnect-fraction must be in [0, 1), got 1.0"),
    (["--disconnect-fraction", "-0.1"], "--disconnect-fraction must be in [0, 1)"),
    (["--sampling-mix", "--temperature", "0.5"], "--sampling-mix sets each request's temperature"),
    (["--frontends", "0"], "--frontends must be >= 1, got 0"),
    (["--frontends", "2", "--url", "http://127.0.0.1:1"], "--frontends is for the server bench-serve starts"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--max-tokens", "128-64"], "expected N or LOW-HIGH with 1 <= LOW <= HIGH, got '128-64'"),
    (["--max-tokens", "0"], "expected N or LOW-HIGH"),
    (["--requests-per-client", "0"], "--requests and --requests-per-client must be >= 1"),
])
def test_bench_serve_argument_errors_are_one_line(capsys, argv, message):
    from specdec.cli import main

    assert main(["bench-serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bench_serve_defaults_reach_concurrency_64():
    from specdec.cli import build_parser

    args = build_parser().parse_args(["bench-serve"])
    assert max(args.concurrency) == 64 and args.max_batch is None  # None: the server's batch = the largest concurrency
    assert args.requests is None and LoadPlan((1, 64), ("off",), None, 8, (), 2).requests_at(1) == 32  # max(32, 8c)
    assert LoadPlan((1, 64), ("off",), None, 8, (), 2, per_client=args.requests_per_client).requests_at(16) == 128
    assert LoadPlan((1, 64), ("off",), None, 8, (), 2, per_client=32).requests_at(16) == 512
    assert args.temperature is None and not args.sampling_mix and args.disconnect_fraction == 0.0


def test_the_admin_forget_empties_what_suffix_learned_before_the_next_request(model):
    """bench-serve asks POST /admin/forget before each timed level: the suffix drafter's global index then
    holds only the level's own requests, never the warm wave's or an earlier level's answers to the same
    prompts. The decode thread forgets before the next join, so a row retired after the ask is dropped too."""
    from specdec.drafters import build_drafter
    from test_server import post

    drafter = build_drafter("suffix", model)
    scheduler = make_scheduler(model, drafter=drafter)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6}
    with serving(scheduler, admin=True) as (url, _):
        post(url, "/v1/completions", body)
        post(url, "/v1/completions", body)  # its join added the first request to the index
        assert drafter.index.tokens > 0
        assert post(url, "/admin/forget", {}).json() == {"drafter": "suffix", "forgets": True}
        post(url, "/v1/completions", body)  # forgot before joining: the second request never enters the index
        assert drafter.index.tokens == 0
        post(url, "/v1/completions", body)
        assert drafter.index.tokens > 0  # the third request, retired at this one's join
    with serving(make_scheduler(model), admin=True) as (url, _):
        assert post(url, "/admin/forget", {}).json() == {"drafter": "ngram", "forgets": False}

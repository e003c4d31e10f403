"""`bench-serve --switchback`: the policies in turns within one continuous load (server/switchback.py): the
turns against a tiny server, the ratios and their bootstrap interval, the targets, and argument errors."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from specdec.server.bench import Counts, LoadPlan, fixed_sampling, format_checks
from specdec.server.policy import measure_batch_costs
from specdec.server.switchback import (CONTROL, Load, Turn, check_switchbacks, compare, format_comparisons, measure_turn,
                                       run_switchbacks, write_switchback_report)
from test_server import KEY, MODEL, PROMPTS, make_scheduler, model, serving  # noqa: F401 (model: the fixture)


def turns_of(rates: dict[str, list[float]], concurrency: int = 4, seconds: float = 100.0) -> list[Turn]:
    """Turns of `seconds` at the given tokens/s, round by round."""
    return [Turn(policy, concurrency, r, 0.0, seconds, int(rate * seconds))
            for policy, per_round in rates.items() for r, rate in enumerate(per_round)]


def test_turns_alternate_under_one_load_and_free_every_row(model, tmp_path):
    """With the A/A control: `off` runs a second turn a round under CONTROL's name, compared with `off`."""
    costs = measure_batch_costs(model, [1, 2], [1, 2, 3, 4], context=16, repeats=1)
    plan = LoadPlan(concurrency=(2,), policies=("off", "cost"), requests=None, max_tokens=6,
                    sampling=fixed_sampling(0.0), threshold=2, repeats=3)
    with serving(make_scheduler(model, policy="off", costs=costs), admin=True) as (url, _):
        health, loads = run_switchbacks(url, KEY, PROMPTS, plan, seconds=0.3, control=True)
    [load] = loads
    assert [(t.round, t.policy) for t in load.turns] == [(0, "off"), (0, "cost"), (0, CONTROL), (1, CONTROL), (1, "cost"),
                                                         (1, "off"), (2, "off"), (2, "cost"), (2, CONTROL)]  # reversed
    assert all(t.tokens > 0 and 0.25 < t.seconds < 1.5 for t in load.turns)
    assert all(set(t.steps_by_gamma) <= {0} for t in load.turns if t.policy in ("off", CONTROL))
    # A step counts whole when it is read, so the one that straddles a turn's start adds time from before it: on
    # a busy machine a turn's steps can sum past its wall time, though not to twice it. A counter taken whole, not
    # as the turn's difference, would be several turns' worth.
    figures = [(t.tokens, t.step_tokens, t.seconds, t.step_seconds) for t in load.turns]
    assert all(0 < t.step_tokens <= t.tokens and 0 < t.step_seconds < 2 * t.seconds for t in load.turns), figures
    assert [t.start_s for t in load.turns] == sorted(t.start_s for t in load.turns) and load.turns[0].start_s >= 0.3  # after the ramp
    assert load.requests > 2 and load.ok == load.requests and load.lost == 0 and load.rows_freed  # stopped cleanly
    files = write_switchback_report(tmp_path, {"model": health["model"], "drafter": "ngram", "gamma": 3, "max_tokens": 6,
                                               "task": "test", "repeats": 3}, {"server_device": "cpu", "cpu": "x",
                                                                               "cpu_cores": 1, "torch": "t"}, loads, 0.4)
    assert {f.name for f in files} == {"results.json", "report.md", "turns.png"}
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["switchback_s"] == 0.4 and len(results["loads"][0]["turns"]) == 9
    assert [(c["policy"], c["measure"]) for c in results["comparisons"]] == [
        ("cost", "throughput"), ("cost", "steps"), (CONTROL, "throughput"), (CONTROL, "steps")]
    assert results["comparisons"][0]["rounds"] == 3
    [cost_vs_off] = [t for t in results["targets"] if t["name"] == "cost / off at c=2"]
    assert cost_vs_off["note"].startswith("A/A control, off against itself: ")
    assert "cost / off at c=2" in (tmp_path / "report.md").read_text()


def test_a_turn_counts_only_its_own_policys_steps(model):
    """A turn starts once the steps launched before its switch are read (switchback.settle): `off`'s turns
    count no drafting step of the `on` turn before, and `on`'s no plain one of `off`'s."""
    plan = LoadPlan(concurrency=(2,), policies=("off", "on"), requests=None, max_tokens=12,
                    sampling=fixed_sampling(0.0), threshold=2, repeats=4)
    with serving(make_scheduler(model, policy="off"), admin=True) as (url, _):
        _, [load] = run_switchbacks(url, KEY, PROMPTS, plan, seconds=0.3)
    assert [set(t.steps_by_gamma) for t in load.turns if t.policy == "off"] == [{0}] * 4
    assert all(0 not in t.steps_by_gamma and t.steps_by_gamma for t in load.turns if t.policy == "on")


def test_ratios_pair_the_rounds_and_their_interval_holds_the_estimate():
    """`off` drifts 100 -> 60 tok/s over the run; `cost` runs 1.02x `off` in every round: every ratio is 1.02
    (a level-by-level comparison would see the drift), and the interval is that one value."""
    off = [100, 90, 80, 70, 60]
    c = compare(turns_of({"off": off, "cost": [1.02 * x for x in off]}), "cost", "off", 4)
    assert c.rounds == 5 and c.ratio == pytest.approx(1.02, abs=2e-3) and c.paired == pytest.approx(1.02, abs=2e-3)
    assert c.low == pytest.approx(1.02, abs=3e-3) and c.high == pytest.approx(1.02, abs=3e-3)
    noisy = compare(turns_of({"off": [100, 110, 90, 105, 95, 100], "cost": [104, 96, 99, 108, 93, 101]}), "cost", "off", 4)
    assert noisy.low < noisy.ratio < noisy.high and noisy.high - noisy.low > 0.03
    assert noisy == compare(turns_of({"off": [100, 110, 90, 105, 95, 100], "cost": [104, 96, 99, 108, 93, 101]}),
                            "cost", "off", 4)  # seeded
    assert compare(turns_of({"off": [100]}), "cost", "off", 4) is None


def test_targets_judge_cost_against_off_and_the_better_of_off_and_on():
    load = Load(8, turns_of({"off": [100, 100], "on": [150, 150], "cost": [140, 140]}, concurrency=8), 10, 9, 1, True)
    checks = {c.name: c for c in check_switchbacks([load])}
    assert checks["cost / off at c=8"].value == pytest.approx(1.4, abs=0.01) and checks["cost / off at c=8"].met
    assert checks["cost / max(off, on) at c=8"].value == pytest.approx(140 / 150, abs=0.01)
    assert not checks["cost / max(off, on) at c=8"].met
    assert checks["requests lost or malformed, of 10"].value == 0
    table = format_comparisons([load])
    assert "1.400 (paired 1.400, 95 % 1.400-1.400) vs off; 0.933 (paired 0.933" in table
    assert not checks["cost / off at c=8"].note  # no control ran


def test_the_cost_target_quotes_the_a_a_controls_spread():
    """`off` against itself (CONTROL) is compared as a policy is, and the cost/off line carries its ratio and
    interval; the judgement stays the point estimate's."""
    load = Load(4, turns_of({"off": [100, 104, 96], "cost": [99, 101, 97], CONTROL: [102, 98, 97]}), 10, 10, 0, True)
    [check] = [c for c in check_switchbacks([load]) if c.name == "cost / off at c=4"]
    aa = compare(load.turns, CONTROL, "off", 4)
    assert not check.met and check.value == pytest.approx(297 / 300)
    assert check.note == f"A/A control, off against itself: {aa.ratio:.3f} (95 % {aa.low:.3f}-{aa.high:.3f})"
    assert f"target >= 1.00 missed ({check.note})" in format_checks([check])[0]
    assert "vs off" in format_comparisons([load]).split(CONTROL)[1]


def test_a_stopped_count_hands_out_no_more_requests():
    counts = Counts(mp.get_context("spawn"))
    assert [counts.take(1 << 30) for _ in range(3)] == [0, 1, 2]
    assert counts.stop() == 3 and counts.take(1 << 30) is None


@pytest.mark.parametrize("argv, message", [
    (["--switchback", "0"], "--switchback must be a positive number of seconds, got 0.0"),
    (["--switchback", "2", "--disconnect-fraction", "0.1"], "--switchback measures throughput only"),
    (["--control"], "--control is an A/A turn of --switchback: add --switchback SECONDS"),
    (["--switchback", "2", "--control", "--policies", "on,cost"], "--control compares `off` with itself: add off"),
])
def test_switchback_argument_errors_are_one_line(capsys, argv, message):
    from specdec.cli import main

    assert main(["bench-serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_turns_step_figures_leave_its_prefills_out():
    """A turn's steps' tokens are its tokens less one first token per request that started; their seconds,
    the decode thread's host and waiting time. Two turns alike but for a prefill more: equal by steps."""
    def metrics(tokens, firsts, host, wait, prefill):
        return {"specdec_generation_tokens_total": tokens, "specdec_time_to_first_token_seconds_count": firsts,
                **{f'specdec_decode_thread_seconds_total{{part="{k}"}}': v
                   for k, v in (("host", host), ("wait", wait), ("prefill", prefill), ("idle", 0.0))}}

    zero = metrics(0, 0, 0.0, 0.0, 0.0)
    off = measure_turn("off", 4, 0, 0.0, 2.0, zero, metrics(201, 1, 1.5, 0.5, 0.0))
    cost = measure_turn("cost", 4, 0, 2.0, 2.0, zero, metrics(152, 2, 1.0, 0.5, 0.5))  # a prefill took 0.5 s
    assert (off.step_tokens, off.step_seconds) == (200, 2.0) and (cost.step_tokens, cost.step_seconds) == (150, 1.5)
    assert compare([off, cost], "cost", "off", 4).ratio == pytest.approx(152 / 201)
    assert compare([off, cost], "cost", "off", 4, "steps").ratio == pytest.approx(1.0)

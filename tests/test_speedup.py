"""Speedup arithmetic and bench summaries on hand-computed cases."""

from __future__ import annotations

import pytest

from specdec.analysis.speedup import estimated_speedup, estimated_speedup_from_tau, expected_tokens_per_step
from specdec.costs import cost_coefficient, interpolate, verify_ratios
from specdec.bench.runner import Method, RunRecord, pool_per_position, quartiles, speedups, summarize


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_step(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens_per_step(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens_per_step(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_estimated_speedup_formula():
    # (1 - 0.5^3) / ((1 - 0.5) (2 * 0.1 + 1.2)) = 1.75 / 1.4
    assert estimated_speedup(0.5, 2, 0.1, 1.2) == pytest.approx(1.25)
    # free drafting and verification: the speedup is the expected tokens per step
    assert estimated_speedup(0.9, 4, 0.0, 1.0) == pytest.approx(expected_tokens_per_step(0.9, 4))
    # nothing accepted: pure overhead
    assert estimated_speedup(0.0, 3, 0.05, 1.3) == pytest.approx(1 / 1.45)


def test_estimate_from_tau_and_interpolation():
    ratios = {1: 1.0, 2: 1.2, 4: 1.5}
    assert interpolate(ratios, 3) == pytest.approx(1.35)
    assert interpolate(ratios, 0.5) == 1.0 and interpolate(ratios, 9) == 1.5
    # tau 2 over a step whose drafting costs 0.3 plain steps and which verifies 3 drafts (4 tokens): 2 / (0.3 + 1.5)
    assert estimated_speedup_from_tau(2.0, 0.3, 3.0, ratios) == pytest.approx(2 / 1.8)


def test_cost_coefficient_and_ratios():
    assert cost_coefficient(draft_s=0.5, steps=10, gamma=5, t1=0.1) == pytest.approx(0.1)
    assert cost_coefficient(0.5, 0, 5, 0.1) is None
    assert verify_ratios({1: 0.02, 4: 0.03}) == {1: 1.0, 4: pytest.approx(1.5)}


def record(method: str, task: str, tps: float, ids=(1, 2), stats=None) -> RunRecord:
    return RunRecord(method=method, task_id=task, category=None, repeat=0, num_tokens=len(ids), wall_s=len(ids) / tps,
                     tokens_per_s=tps, token_ids=list(ids), text="", correct=None, stats=stats)


def test_quartiles_and_per_prompt_speedups():
    q = quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert q == {"median": 3.0, "p25": 2.0, "p75": 4.0, "min": 1.0, "max": 5.0}
    records = [record("specdec/none", "a", 10), record("specdec/none", "b", 20),
               record("x", "a", 15), record("x", "b", 50)]
    assert sorted(speedups(records, "x", "specdec/none")) == [pytest.approx(1.5), pytest.approx(2.5)]


def test_pool_per_position_weights_by_counts():
    stats = [{"drafted_per_position": [4, 2], "accepted_per_position": [2, 1]},
             {"drafted_per_position": [6], "accepted_per_position": [6]}]
    assert pool_per_position(stats) == [pytest.approx(0.8), pytest.approx(0.5)]


def test_summarize_acceptance_and_estimates():
    # two prompts; each: 5 steps (1 prefill + 4 decode), 8 drafted, 4 accepted, 9 emitted
    stats = {"steps": 5, "decode_steps": 4, "drafted": 8, "accepted": 4, "emitted": 9, "decode_emitted": 8, "draft_s": 0.04,
             "drafted_per_position": [4, 4], "accepted_per_position": [3, 1]}
    records = [record("specdec/none", "a", 10), record("specdec/none", "b", 10),
               record("specdec/ngram/2", "a", 12, stats=stats), record("specdec/ngram/2", "b", 14, stats=stats)]
    calibration = {"forward_s": {"1": 0.125, "2": 0.11, "3": 0.12}, "verify_ratio": {"1": 1.0, "2": 1.1, "3": 1.2},
                   "t1_s": 0.1, "t1_from": "plain runs"}  # c counts in t1_s (plain's steps), not the calibrated forward
    s = summarize(Method("specdec/ngram/2", "specdec", "ngram", 2), records, calibration, greedy=True)
    assert s["acceptance_rate"] == pytest.approx(0.5)
    assert s["mean_accepted_length"] == pytest.approx(2.0)  # (9 - 1) / (5 - 1) per prompt
    assert s["drafted_per_step"] == pytest.approx(2.0)
    assert s["cost_coefficient"] == pytest.approx(0.08 / 8 / 2 / 0.1)
    assert s["verify_ratio"] == pytest.approx(1.2)
    assert s["estimated_speedup"] == pytest.approx(estimated_speedup(0.5, 2, 0.05, 1.2))
    assert s["acceptance_per_position"] == [pytest.approx(0.75), pytest.approx(0.25)]
    assert s["speedup_vs_plain"]["median"] == pytest.approx(1.3)
    assert s["lossless"] is True and s["matches_plain"] == 2

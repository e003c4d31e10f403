"""Rejection analysis: token classes, the recorder against the engine's own counters, the aggregation
arithmetic on hand-made records, findings that quote the aggregates, and `analyze` end to end on a
tiny model with a small word-level tokenizer."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from conftest import DEVICE, tiny_folder_with_tokenizer, tiny_pair
from specdec.analysis.analyze import run_analyze
from specdec.cli import build_parser
from specdec.analysis.rejections import (
    ANALYSIS_SCHEMA,
    TOKEN_CLASSES,
    DraftTokenRecord,
    RejectionRecorder,
    build_analysis,
    classify_token,
)
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import DrafterOptions
from specdec.engine import SpecEngine
from specdec.errors import UserError

CLASSES = [
    ("4", "number"), (" 24", "number"), ("3.5", "number"), ("1,200", "number"),
    ("+", "operator"), (" =", "operator"), ("-", "operator"), ("×", "operator"), ("<<", "operator"), (" >>", "operator"),
    ("\n", "newline"), ("\n\n", "newline"), (".\n", "newline"), (" \n", "newline"),
    (" ", "whitespace"), ("   ", "whitespace"), ("\t", "whitespace"),
    (".", "punctuation"), (",", "punctuation"), (" (", "punctuation"), ("$", "punctuation"), ("?!", "punctuation"),
    (" sold", "word_start"), (" été", "word_start"), ("She", "word_start"), ("N", "word_start"),
    ("atal", "word_continuation"), ("ia", "word_continuation"), ("'t", "word_continuation"),
    ("<|im_end|>", "other"), ("", "other"), ("x2", "other"), ("\ufffd", "other"), ("  cat", "other"),
]


@pytest.mark.parametrize("text,expected", CLASSES)
def test_classify_token(text, expected):
    assert classify_token(text) == expected


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("analysis")
    target, _ = tiny_pair(tmp, "llama", seed=0, logit_scale=8.0)
    draft, _ = tiny_pair(tmp, "llama", seed=1, logit_scale=2.0, num_hidden_layers=1)
    return target, draft


PROMPTS = [[5, 17, 3, 9, 44, 2, 71, 5, 17, 3], [12, 8], [30, 31, 32, 33, 34, 35, 30, 31, 32, 33]]


def record(target, draft, drafter, prompts, sampling, gamma=4, max_new=32):
    engine = SpecEngine(target, drafter, DrafterOptions(draft_model=draft))
    recorder = RejectionRecorder(sampling, lambda ids: str(ids[0]))
    out = engine.generate(prompts, SpecConfig(gamma=gamma, max_new_tokens=max_new, sampling=sampling), observer=recorder)
    return recorder, out


@pytest.mark.parametrize(
    "drafter,sampling",
    [("ngram", SamplingParams()), ("draft_model", SamplingParams()), ("draft_model", SamplingParams(temperature=1.0, seed=3))],
)
def test_recorder_agrees_with_engine_stats(pair, drafter, sampling):
    recorder, out = record(*pair, drafter, PROMPTS, sampling)
    records, stats = recorder.records, out.stats
    assert stats.drafted > 0
    assert sum(r.accepted for r in records) == stats.accepted
    assert len(records) + sum(recorder.not_reached) == stats.drafted
    for i, drafted in enumerate(stats.drafted_per_position):
        at_i = [r for r in records if r.draft_position == i]
        assert len(at_i) + recorder.not_reached[i] == drafted
        assert sum(r.accepted for r in at_i) == stats.accepted_per_position[i]
    for r in records:
        assert 0 <= r.target_prob <= r.target_top1_prob <= 1 + 1e-6
        assert 0 <= r.target_entropy <= math.log(96) + 1e-4
        assert r.token_text == str(r.token_id) and r.token_class == "number"
        if sampling.greedy:
            assert r.draft_prob is None and r.p_over_q is None
            assert r.accepted == (r.token_id == r.target_token)
        else:
            assert r.p_over_q == pytest.approx(r.target_prob / r.draft_prob)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)])
def test_tree_steps_are_recorded_along_the_walked_path(pair, sampling):
    """A tree drafter (lookahead): the records are the accepted path plus the rejected first child."""
    recorder, out = record(*pair, "lookahead", PROMPTS, sampling)
    assert sum(r.accepted for r in recorder.records) == out.stats.accepted > 0
    assert any(not r.accepted for r in recorder.records)
    emitted = {(row, i): t for row, r in enumerate(out.rows) for i, t in enumerate(r.token_ids)}
    for r in recorder.records:
        assert r.token_class == "number" and 0 <= r.target_prob <= 1 + 1e-6
        if sampling.greedy:
            assert r.accepted == (r.token_id == r.target_token)
        if r.accepted:
            assert r.token_id in {t for (_, i), t in emitted.items() if i == r.output_position}


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)])
def test_records_point_at_the_emitted_tokens(pair, sampling):
    recorder, out = record(*pair, "draft_model", PROMPTS[:1], sampling)
    emitted = out.rows[0].token_ids
    assert any(not r.accepted for r in recorder.records)
    for r in recorder.records:
        assert emitted[r.output_position] == r.target_token  # accepted draft, argmax or recovered token
        assert r.accepted == (r.token_id == r.target_token)  # a recovered token never equals the rejected draft


def test_greedy_entropy_is_the_softmax_entropy(pair):
    target, draft = pair
    recorder, out = record(target, draft, "draft_model", PROMPTS[:1], SamplingParams(), gamma=2, max_new=6)
    first = recorder.records[0]
    ids = torch.tensor([PROMPTS[0] + out.rows[0].token_ids[: first.output_position]], device=DEVICE)  # [1, T]
    cache = target.new_cache(1, ids.shape[1])
    logits = target(ids, torch.arange(ids.shape[1], device=DEVICE)[None], cache).logits[0, -1]  # [V]
    p = logits.float().softmax(-1)
    assert first.target_entropy == pytest.approx(float(-(p * p.log()).sum()), abs=1e-4)
    assert first.target_top1_prob == pytest.approx(float(p.max()), abs=1e-5)


def rec(accepted, pos, out_pos, cls="number", entropy=0.0, top1=1.0, p=1.0, q=None, token=1, target=1):
    return DraftTokenRecord(
        accepted=accepted, draft_position=pos, output_position=out_pos, token_id=token, token_text=f"t{token}",
        token_class=cls, target_token=target, target_text=f"t{target}", target_entropy=entropy, target_top1_prob=top1,
        target_prob=p, draft_prob=q, p_over_q=None if q is None else p / q,
    )


HAND = [
    rec(True, 0, 0, "number", entropy=0.05, top1=0.995),
    rec(True, 1, 1, "number", entropy=0.1, top1=0.9),  # edge values fall into the upper bucket
    rec(False, 2, 31, "number", entropy=0.7, top1=0.6, p=0.2, token=7, target=8),
    rec(True, 0, 32, "word_start", entropy=0.0, top1=1.0),
    rec(False, 1, 33, "word_start", entropy=3.0, top1=0.4, p=0.05, token=7, target=8),
    rec(False, 0, 300, "operator", entropy=9.0, top1=0.2, p=0.001, token=5, target=6),
    rec(True, 0, 64, "newline", entropy=2.5, top1=0.7),
    rec(False, 0, 256, "newline", entropy=2.0, top1=0.5, p=0.3, token=7, target=8),
]
NOT_REACHED = [0, 1, 1, 2]  # per draft position


def test_aggregation_arithmetic():
    a = build_analysis(HAND, NOT_REACHED, gamma=4, run={}, stats={}, min_count=1)
    o = a.overall
    assert (o.verified, o.accepted, o.rejected, o.not_reached, o.drafted) == (8, 4, 4, 4, 12)
    assert o.acceptance_rate == pytest.approx(4 / 12) and o.verified_acceptance_rate == 0.5
    by_class = {r.key: r for r in a.by_token_class}
    assert [r.key for r in a.by_token_class] == list(TOKEN_CLASSES)
    assert (by_class["number"].verified, by_class["number"].rejected) == (3, 1)
    assert by_class["number"].rejection_rate == pytest.approx(1 / 3)
    assert by_class["operator"].rejection_rate == 1.0 and by_class["punctuation"].rejection_rate is None
    pos = a.by_draft_position
    assert [(r.verified, r.accepted, r.not_reached, r.drafted) for r in pos] == [(5, 3, 0, 5), (2, 1, 1, 3), (1, 0, 1, 2), (0, 0, 2, 2)]
    assert pos[1].acceptance_rate == pytest.approx(1 / 3) and pos[3].verified_acceptance_rate is None
    assert [(r.key, r.verified, r.accepted) for r in a.by_output_position] == [
        ("0-31", 3, 2), ("32-63", 2, 1), ("64-127", 1, 1), ("128-255", 0, 0), ("256+", 2, 0)
    ]
    assert [r.verified for r in a.by_target_entropy] == [2, 1, 1, 0, 3, 1]  # [0,.1) [.1,.5) [.5,1) [1,2) [2,4) [4,inf)
    assert a.by_target_entropy[-1].hi is None and a.by_target_entropy[-1].key == "[4, inf)"
    assert [r.verified for r in a.by_target_top1_prob] == [2, 2, 1, 1, 2]  # top1 == 1.0 is in the last bucket
    assert a.by_target_top1_prob[-1].key == "[0.99, 1]"
    assert [r.verified for r in a.by_target_prob] == [1, 1, 2, 0, 4]
    assert a.by_p_over_q == []
    pairs = a.top_rejection_pairs
    assert [(p.draft_token, p.target_token, p.count) for p in pairs] == [(7, 8, 3), (5, 6, 1)]
    assert pairs[0].share == 0.75 and pairs[0].draft_text == "t7" and pairs[0].target_text == "t8"


def test_p_over_q_buckets_only_where_q_exists():
    records = [rec(True, 0, 0, p=0.5, q=0.25), rec(False, 0, 1, p=0.1, q=0.5), rec(True, 1, 2)]
    a = build_analysis(records, [], gamma=2, run={}, stats={}, min_count=1)
    assert sum(r.verified for r in a.by_p_over_q) == 2
    assert [r.key for r in a.by_p_over_q if r.verified] == ["[0.1, 0.25)", "[1, inf)"]


def test_findings_quote_the_aggregates():
    a = build_analysis(HAND, NOT_REACHED, gamma=4, run={"greedy": True}, stats={}, min_count=1)
    text = " ".join(a.findings)
    o = a.overall
    assert f"Of {o.drafted} drafted tokens, {o.verified} reached the verifier and {o.accepted} were accepted" in text
    assert f"{o.acceptance_rate:.1%} of drafted" in text and f"{o.not_reached} were never verified" in text
    # operator: 1 of 1 rejected, the worst class; newline / word_start / number tie lower, number the lowest
    assert f"'operator' drafts are rejected most often: 100.0% of 1 vs {o.rejection_rate:.1%} overall (+50.0 points)" in text
    assert "'number' drafts least often (33.3% of 3)" in text
    assert "falls from 60.0% at draft position 0 (n = 5) to 0.0% at position 2 (n = 1)" in text
    # the split with the widest gap: below 0.5 nats 3 of 3 accepted, 1 of 5 at or above
    assert "entropy (temperature-1 softmax of the target logits) is below 0.5 nats, 100.0% of 3 verified drafts" in text
    assert "vs 20.0% of 5 at or above 0.5 nats" in text
    assert "is 66.7% at output positions 0-31 (n = 3) and 0.0% at 256+ (n = 2)" in text
    assert "'t7' -> 't8' (3 of 4 rejections, 75.0%); the 2 most common pairs cover 100.0%" in text
    assert len(a.findings) == 6


def test_findings_skip_thin_data():
    a = build_analysis(HAND, NOT_REACHED, gamma=4, run={}, stats={}, min_count=30)
    assert a.findings == ["Only 8 draft tokens were verified (fewer than 30): too few for findings."]
    a = build_analysis(HAND, NOT_REACHED, gamma=4, run={}, stats={}, min_count=3)
    assert len(a.findings) == 3  # overall, entropy split (3 | 5) and top pair; no class, position has 2 groups of 3+


def test_json_keys_match_the_documented_schema():
    a = build_analysis(HAND, NOT_REACHED, gamma=4, run={}, stats={}, min_count=1)
    d = json.loads(json.dumps(a.to_dict()))
    assert set(d) == {k for k in ANALYSIS_SCHEMA if " " not in k}
    assert set(d["by_token_class"][0]) == {"key", "verified", "accepted", "rejected", "verified_acceptance_rate", "rejection_rate"}
    assert set(d["by_target_entropy"][0]) - set(d["by_token_class"][0]) == {"lo", "hi"}
    assert set(d["overall"]) - set(d["by_token_class"][0]) == {"drafted", "not_reached", "acceptance_rate"}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The tiny target folder with its word-level tokenizer, and a prompt file in its words."""
    tmp = tmp_path_factory.mktemp("analyze-cli")
    prompts = tmp / "prompts.txt"
    prompts.write_text("the cat sat on the mat . the cat sat on\n1 + 2 = 3 . 4 + 5 = 9 . 1 + 2 =\nThe Cat sat on the mat ?\n")
    return tiny_folder_with_tokenizer(tmp), prompts


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["analyze", *argv])


def test_analyze_end_to_end(model_folder, tmp_path, capsys):
    folder, prompts = model_folder
    out = tmp_path / "out"
    args = parse("--task", str(prompts), "--model", str(folder), "--drafter", "ngram", "--gamma", "3",
                 "--max-new-tokens", "32", "--out", str(out), "--json")
    assert run_analyze(args) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "analysis.json").read_text())
    assert printed == saved
    o, stats = saved["overall"], saved["stats"]
    assert o["drafted"] == stats["drafted"] > 0 and o["accepted"] == stats["accepted"]
    assert saved["run"]["prompts"] == 3 and len(saved["by_draft_position"]) == 3
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == o["verified"] and set(json.loads(lines[0])) >= {"accepted", "token_class", "target_entropy"}
    md = (out / "analysis.md").read_text()
    for name in ["rejection_by_token_class", "acceptance_by_draft_position", "acceptance_by_target_entropy",
                 "acceptance_by_output_position"]:
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG" and f"({name}.png)" in md
    assert all(s in md for s in saved["findings"])


def test_analyze_summary(model_folder, tmp_path, capsys):
    folder, prompts = model_folder
    args = parse("--task", str(prompts), "--limit", "1", "--model", str(folder), "--max-new-tokens", "16", "--out", str(tmp_path))
    assert run_analyze(args) == 0
    printed = capsys.readouterr().out
    assert "verified" in printed and f"written to {tmp_path}/" in printed


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--drafter", "none"], "drafts nothing"),
        (["--drafter", "layer_skip", "--layers", "0", "--layer-skip-config", "x.json"], "not both"),
        (["--limit", "0"], "limit must be a positive"),
        (["--task", "no-such-set"], "unknown task set"),
        (["--gamma", "0"], "gamma must be >= 1"),
    ],
)
def test_analyze_bad_input(argv, message, tmp_path):
    with pytest.raises(UserError, match=message):
        run_analyze(parse(*argv, "--out", str(tmp_path)))

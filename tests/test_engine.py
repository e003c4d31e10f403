"""Greedy losslessness: every drafter x gamma x batch size emits exactly the target's own greedy
decode (float32), compared with specdec's plain decoding and with transformers `generate`."""

from __future__ import annotations

import re

import pytest
import torch

import specdec
from conftest import DEVICE, on_device, tiny_pair
from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.drafters import DrafterOptions
from specdec.models import load_model

PROMPTS = [[5, 17, 3, 9, 44, 2, 71], [12, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 30, 31]]
MAX_NEW = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    target, hf = tiny_pair(tmp, "llama", seed=0, logit_scale=8.0)
    draft, _ = tiny_pair(tmp, "llama", seed=1, logit_scale=8.0, num_hidden_layers=1)
    return target, hf, draft


@pytest.fixture(scope="module")
def plain(models):
    target, _, _ = models
    out = specdec.generate(PROMPTS, model=target, drafter="none", max_new_tokens=MAX_NEW)
    return [r.token_ids for r in out.rows]


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)  # [1, T]
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_plain_decoding_matches_transformers(models, plain):
    _, hf, _ = models
    assert plain == [hf_greedy(hf, p) for p in PROMPTS]
    assert all(len(ids) == MAX_NEW for ids in plain)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_greedy_equals_plain(models, plain, drafter, gamma, batch):
    target, _, draft = models
    prompts = PROMPTS[:batch] if batch == 3 else PROMPTS[2:3]
    expected = plain[:batch] if batch == 3 else plain[2:3]
    out = specdec.generate(prompts, model=target, drafter=drafter, gamma=gamma, max_new_tokens=MAX_NEW, draft_model=draft)
    assert [r.token_ids for r in out.rows] == expected
    assert out.stats.drafted > 0
    assert out.stats.emitted == sum(len(e) for e in expected)


def test_everything_runs_on_the_test_device(models):
    """Models, caches, drafts, logits and verification results all live on DEVICE (SPECDEC_TEST_DEVICE)."""
    target, hf, draft = models
    assert all(on_device(p) for m in (target, hf, draft) for p in m.parameters())
    assert on_device(target.new_cache(1, 4).k) and on_device(target.inv_freq)
    steps = []
    engine = SpecEngine(target, "draft_model", DrafterOptions(draft_model=draft))
    sampling = SamplingParams(temperature=1.0, seed=0)
    engine.generate(PROMPTS, SpecConfig(gamma=3, max_new_tokens=8, sampling=sampling), observer=steps.append)
    assert steps
    for s in steps:
        tensors = [s.draft_tokens, s.q, s.num_drafted, s.target_logits, s.result.tokens, s.result.num_accepted]
        assert all(on_device(t) for t in tensors)


def test_draft_model_of_itself_accepts_everything(models):
    target, _, _ = models
    out = specdec.generate(PROMPTS, model=target, drafter="draft_model", gamma=4, max_new_tokens=MAX_NEW, draft_model=target)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.acceptance_per_position == [1.0] * 4


def test_rows_stop_on_their_own(models, plain):
    target, _, _ = models
    eos = plain[1][10]  # a token row 1 emits at step 11: declare it EOS
    target_eos = target.config.eos_token_ids
    object.__setattr__(target.config, "eos_token_ids", (eos,))
    try:
        out = specdec.generate(PROMPTS, model=target, drafter="ngram", gamma=4, max_new_tokens=MAX_NEW)
    finally:
        object.__setattr__(target.config, "eos_token_ids", target_eos)
    for row, full in zip(out.rows, plain):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row.token_ids == full[:cut]
        assert row.finish_reason == ("eos" if eos in full else "length")


def test_stats_are_consistent(models):
    target, _, draft = models
    out = specdec.generate(PROMPTS, model=target, drafter="draft_model", gamma=3, max_new_tokens=MAX_NEW, draft_model=draft)
    s = out.stats
    assert s.accepted <= s.drafted
    assert sum(s.accepted_per_position) == s.accepted and sum(s.drafted_per_position) == s.drafted
    assert s.emitted == s.accepted + s.steps  # every step emits accepted + 1
    rows = len(PROMPTS)  # each row's prefill emits its first token and is not a decode step
    assert (s.decode_steps, s.decode_emitted) == (s.steps - rows, s.emitted - rows)
    assert s.mean_accepted_length == pytest.approx((s.emitted - rows) / (s.steps - rows))


def test_generate_reuses_its_model_and_engine_across_calls(tmp_path, monkeypatch):
    """specdec.generate keeps the engine (drafter, graphs) for the same model, drafter and options, and a
    model loaded by name; a different drafter gets its own engine; clear_cache lets them go."""
    from specdec import api

    tiny_pair(tmp_path, "llama", seed=4, logit_scale=8.0)  # saves the folder llama-4
    folder = str(tmp_path / "llama-4")
    api.clear_cache()
    loads, engines = [], []
    load = api.load_model
    monkeypatch.setattr(api, "load_model", lambda name: loads.append(name) or load(name, dtype="float32", device=DEVICE))
    init = SpecEngine.__init__
    monkeypatch.setattr(SpecEngine, "__init__", lambda self, *a, **k: engines.append(a[1]) or init(self, *a, **k))
    first = specdec.generate(PROMPTS, model=folder, drafter="ngram", max_new_tokens=8)
    again = specdec.generate(PROMPTS, model=folder, drafter="ngram", max_new_tokens=8)
    other = specdec.generate(PROMPTS, model=folder, drafter="none", max_new_tokens=8)
    assert loads == [folder] and engines == ["ngram", "none"]
    assert [r.token_ids for r in first.rows] == [r.token_ids for r in again.rows] == [r.token_ids for r in other.rows]
    api.clear_cache()
    assert not api.MODELS and not api.ENGINES


def test_generate_takes_gamma_auto_as_the_cli_does(tmp_path):
    """specdec.generate(gamma="auto") drafts by the cost policy (the CLI's --gamma auto) and gives plain greedy's
    tokens; a gamma that is neither a whole number nor "auto" is one clear error, not a TypeError."""
    from specdec.config import AUTO_GAMMA_START, spec_config_for
    from specdec.errors import UserError

    tiny_pair(tmp_path, "llama", seed=4, logit_scale=8.0)
    target = load_model(str(tmp_path / "llama-4"), dtype="float32", device=DEVICE)
    auto = specdec.generate(PROMPTS, model=target, drafter="ngram", gamma="auto", max_new_tokens=8)
    plain = specdec.generate(PROMPTS, model=target, drafter="none", max_new_tokens=8)
    assert [r.token_ids for r in auto.rows] == [r.token_ids for r in plain.rows]
    config = spec_config_for("auto", max_new_tokens=8)
    assert (config.gamma, config.gamma_policy) == (AUTO_GAMMA_START, "cost")
    assert spec_config_for(3).gamma_policy == "fixed"
    for bad, message in (("four", "gamma must be a whole number or 'auto', got 'four'"),
                         (2.5, "gamma must be a whole number, got 2.5"), (0, "gamma must be >= 1, got 0")):
        with pytest.raises(UserError, match=re.escape(message)):
            specdec.generate(PROMPTS, model=target, gamma=bad, max_new_tokens=8)


def test_the_cost_policy_prices_whole_steps_by_the_hosts_clock(models, monkeypatch):
    """The engine's cost policy learns a step's time from its launch to the end of its read (StepReport.wall_s,
    as the server's does), host work included: handing a step's tokens to the rows, here slowed by 20 ms,
    counts; the phase timers around drafting and verifying would not see it (nor, on a GPU, a host
    drafter's bubble)."""
    import time

    from specdec.adaptive import CostModel
    from specdec.step import Stepper

    target, _, _ = models
    absorb, observe_step, seen = Stepper.absorb, CostModel.observe_step, []

    def slow_absorb(self, *args):
        time.sleep(0.02)
        return absorb(self, *args)

    def record(self, gamma, seconds):
        seen.append(seconds)
        return observe_step(self, gamma, seconds)

    monkeypatch.setattr(Stepper, "absorb", slow_absorb)
    monkeypatch.setattr(CostModel, "observe_step", record)
    SpecEngine(target, "ngram").generate([PROMPTS[0]], SpecConfig(gamma_policy="cost", max_new_tokens=8))
    assert seen and min(seen) >= 0.02


@pytest.mark.parametrize("compiles", [True, False])
def test_a_step_timed_across_a_compile_teaches_the_cost_policy_nothing(models, monkeypatch, compiles):
    """A drafting step during which torch compiled a graph (a host drafter's device part meeting a new
    shape on a GPU: seconds) is timed with the compiler in it. Learnt from, it priced a draft token at
    hundreds of plain steps, and `cost` never drafted again in that engine (`suffix` on `mixed`, H200).
    Here a draft of the target itself (every token accepted) has its second drafting step slowed by 0.3 s,
    as a compile would (its first catches the row up, which is not learnt from either). Where that step
    counts as a compile, c stays a draft's own and the next call drafts; where it does not (the control),
    c takes the 0.3 s and the next call drafts nothing."""
    import time

    from torch._dynamo.utils import counters

    from specdec import step as step_module

    target, _, _ = models
    propose, drafting = step_module.propose, []

    def propose_slowly_once(drafter, batch, gamma, shape, any_sampled):
        if gamma:
            drafting.append(gamma)
        if len(drafting) == 2 and gamma:
            time.sleep(0.3)
            if compiles:
                counters["stats"]["unique_graphs"] += 1
        return propose(drafter, batch, gamma, shape, any_sampled)

    monkeypatch.setattr(step_module, "propose", propose_slowly_once)
    engine = SpecEngine(target, "draft_model", DrafterOptions(draft_model=target))
    config = SpecConfig(gamma_policy="cost", max_new_tokens=24)
    engine.generate([PROMPTS[0]], config)
    assert len(drafting) >= 2
    second = engine.generate([PROMPTS[0]], config)
    if compiles:
        assert engine.cost_model.c < 10 and second.stats.drafted > 0
    else:
        assert engine.cost_model.c > 10 and second.stats.drafted == 0


@pytest.mark.parametrize("policy, temperature, gammas", [("cost", 0.0, [0, 1, 2, 3]), ("fixed", 0.8, [3])])
def test_every_step_shape_a_policy_may_choose_is_captured_before_the_clock(models, monkeypatch, policy, temperature,
                                                                          gammas):
    """generate captures, before its clock starts, each step shape its policy may run at, in the call's
    sampling mode, and its prompts' prefill shape; nothing is captured while the rows decode (on a GPU, a
    capture met mid-call stalled it 1-6 s inside the request's time). On the CPU, without graphs, the ask
    is checked, and no capture."""
    from specdec import engine as engine_module
    from specdec.step import Stepper

    target, _, draft = models
    capture, capture_shapes, decode_rows = Stepper.capture, Stepper.capture_shapes, engine_module.decode_rows
    capture_prefill = Stepper.capture_prefill
    asked, late, decoding = [], [], [False]

    def spy_capture_shapes(self, gammas, done=lambda: None, modes=None):
        asked.append((gammas, modes, decoding[0]))
        return capture_shapes(self, gammas, done, modes)

    def spy_capture(self, key, shape):
        if decoding[0]:
            late.append(key)
        return capture(self, key, shape)

    def spy_capture_prefill(self, key):
        if decoding[0]:
            late.append(("prefill", key))
        return capture_prefill(self, key)

    def spy_decode_rows(*args):
        decoding[0] = True
        try:
            return decode_rows(*args)
        finally:
            decoding[0] = False

    monkeypatch.setattr(Stepper, "capture_shapes", spy_capture_shapes)
    monkeypatch.setattr(Stepper, "capture", spy_capture)
    monkeypatch.setattr(Stepper, "capture_prefill", spy_capture_prefill)
    monkeypatch.setattr(engine_module, "decode_rows", spy_decode_rows)
    engine = SpecEngine(target, "draft_model", DrafterOptions(draft_model=draft))
    config = SpecConfig(gamma=3, gamma_max=3, gamma_policy=policy, max_new_tokens=24,
                        sampling=SamplingParams(temperature=temperature, seed=0))
    engine.generate(PROMPTS[:2], config)
    assert asked == [(gammas, ((temperature > 0, 0),), False)]
    assert late == []

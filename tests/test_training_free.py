"""Training-free drafters (lookahead, layer_skip, quantized) and adaptive draft length: lossless in
greedy (equal to plain decoding, batch 1 and 3) and in sampling (the target's distribution), and the
policies' arithmetic on hand-computed cases."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import specdec
from conftest import DEVICE, tiny_pair
from specdec import SamplingParams
from specdec.adaptive import (EXPLORE_EVERY, EXPLORE_MOST, FRESH_RATE, FRESH_WEIGHT, PRIOR_WEIGHT, REPRICE_EVERY,
                              RETRY_MIN_WAIT, RETRY_SHARE, STEP_SAMPLES, CostModel, GammaPolicy, StepSeconds, best_gamma,
                              expected_tokens, pooled_prior, retry_wait)
from specdec.drafters import DrafterOptions
from specdec.drafters.base import Proposal
from specdec.errors import UserError
from specdec.drafters.lookahead import LookaheadConfig, LookaheadDrafter, add_to_pool
from specdec.models.views import quantized_copy, layer_subset
from specdec.transfer import pack_rows
from specdec.tune import neighbours, structured_candidates
from test_engine import MAX_NEW, PROMPTS
from test_sampling_e2e import ALPHA, PROMPT, ROWS, VOCAB, distribution_pvalues, tokens_of

CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="the quantized drafter runs on the CPU int8 kernel only")
DRAFTERS = [("lookahead", {}), ("layer_skip", {}), ("layer_skip", {"layers": [0, 2]}),
            pytest.param("quantized", {}, marks=CPU_ONLY)]


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 4-layer tiny target (so layer subsets differ from it) and its plain greedy outputs."""
    target = tiny_pair(tmp_path_factory.mktemp("free"), "llama", seed=0, logit_scale=8.0, num_hidden_layers=4)[0]
    plain = specdec.generate(PROMPTS, model=target, drafter="none", max_new_tokens=MAX_NEW)
    return target, [r.token_ids for r in plain.rows]


@pytest.mark.parametrize("drafter,extra", DRAFTERS, ids=["lookahead", "layer_skip", "layer_skip-0,2", "quantized"])
@pytest.mark.parametrize("gamma", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_plain(deep, drafter, extra, gamma, batch):
    target, plain = deep
    prompts, expected = (PROMPTS, plain) if batch == 3 else (PROMPTS[2:], plain[2:])
    engine = specdec.SpecEngine(target, drafter, DrafterOptions(extra=extra))
    out = engine.generate(prompts, specdec.SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == expected
    assert out.stats.drafted > 0


def test_lookahead_takes_a_step_without_a_proposal():
    """The cost policy may choose gamma 0 for a step: the step then verifies no draft and commits a
    one-entry block. Lookahead must not read the previous step's window nodes then."""
    from specdec.batch import Request, RowBatch, append
    from specdec.drafters.base import Verified

    V = 16
    drafter = LookaheadDrafter(LookaheadConfig(window=3, ngram=3, guesses=2))
    batch = RowBatch(1, 64, [], torch.device("cpu"))
    drafter.attach(batch)
    batch.occupy([0], [Request([1, 2, 3, 1], max_new_tokens=8)])
    append(batch, torch.tensor([[2]]), torch.tensor([1]))
    drafter.join(batch, torch.tensor([0]), torch.zeros(1, 4, 8))
    proposal = drafter.propose(batch, 3, None)
    append(batch, torch.tensor([[7]]), torch.tensor([1]))  # a step that verified the tree and kept one token
    one = torch.tensor([1])
    tree_logits = torch.randn(1, proposal.tokens.shape[1] + 1, V)
    drafter.commit(batch, Verified(proposal, torch.tensor([0]), one, torch.zeros(1, 1, 8), tree_logits))
    append(batch, torch.tensor([[9]]), one)  # the next step proposed nothing: the pending token alone
    empty = Proposal(torch.zeros(1, 0, dtype=torch.long))
    drafter.commit(batch, Verified(empty, torch.tensor([0]), one, torch.zeros(1, 1, 8), torch.randn(1, 1, V)))
    assert drafter.propose(batch, 3, None).tokens.shape[1] >= 1


@pytest.mark.parametrize("policy", ["heuristic", "confidence", "cost"])
@pytest.mark.parametrize("drafter", ["ngram", pytest.param("quantized", marks=CPU_ONLY), "lookahead"])
def test_adaptive_gamma_is_lossless(deep, policy, drafter):
    target, plain = deep
    config = specdec.SpecConfig(gamma=2, gamma_policy=policy, gamma_max=6, max_new_tokens=MAX_NEW)
    out = specdec.SpecEngine(target, drafter).generate(PROMPTS, config)
    assert [r.token_ids for r in out.rows] == plain


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_confidence_policy_cuts_drafts_of_a_draft_model(deep, threshold):
    """Threshold 0: every row drafts gamma_max, as fixed gamma 4 does; threshold 1: no draft
    probability reaches it, so each row drafts only its first token, as fixed gamma 1 does; lossless."""
    target, plain = deep
    engine = specdec.SpecEngine(target, "layer_skip")
    config = specdec.SpecConfig(gamma_policy="confidence", gamma_max=4, confidence_threshold=threshold,
                                max_new_tokens=MAX_NEW)
    out = engine.generate(PROMPTS, config)
    assert [r.token_ids for r in out.rows] == plain
    fixed = engine.generate(PROMPTS, specdec.SpecConfig(gamma=1 if threshold else 4, max_new_tokens=MAX_NEW))
    assert out.stats.drafted == fixed.stats.drafted and out.stats.steps == fixed.stats.steps


@pytest.mark.skipif(DEVICE == "cpu", reason="off the CPU there is no int8 kernel to draft with")
def test_quantized_is_refused_off_the_cpu(deep):
    target, _ = deep
    with pytest.raises(UserError, match="needs specdec's CPU kernels"):
        specdec.SpecEngine(target, "quantized")


@CPU_ONLY
def test_quantized_draft_agrees_often_and_layer_subset_shares_weights(deep):
    target, _ = deep
    out = specdec.generate(PROMPTS, model=target, drafter="quantized", gamma=4, max_new_tokens=MAX_NEW)
    assert out.stats.acceptance_rate > 0.8  # the same model in int8
    view = layer_subset(target, [1, 3])
    assert view.layers[0] is target.layers[1] and view.lm_head is target.lm_head
    assert quantized_copy(target).layers[0].self_attn.qkv_proj is not target.layers[0].self_attn.qkv_proj


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("free-e2e"), "llama", seed=0, logit_scale=4.0, vocab_size=VOCAB,
                     num_hidden_layers=3)[0]


def sample(target, drafter, seed: int, **config):
    spec = specdec.SpecConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=seed), **config)
    return specdec.SpecEngine(target, drafter).generate([PROMPT] * ROWS, spec)


@pytest.fixture(scope="module")
def plain_sample(small):
    return tokens_of(sample(small, "none", seed=1))


@pytest.mark.parametrize("drafter,config", [("lookahead", {"gamma": 3}), pytest.param("quantized", {"gamma": 3}, marks=CPU_ONLY),
                                            ("layer_skip", {"gamma": 2}),
                                            ("ngram", {"gamma": 2, "gamma_policy": "heuristic", "gamma_max": 4})])
def test_sampling_matches_plain(small, plain_sample, drafter, config):
    out = sample(small, drafter, seed=2, **config)
    assert 0 < out.stats.accepted
    pvalues = distribution_pvalues(tokens_of(out), plain_sample)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues


def test_expected_tokens_and_best_gamma():
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.9, 0.1], 2) == pytest.approx(1 + 0.9 + 0.09)
    cheap = CostModel({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2}, t1=0.05, c=0.01)
    assert best_gamma([0.9] * 4, cheap) == 4  # accepted often, verification cheap: draft the most
    costly = CostModel({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}, t1=0.05, c=1.0)
    assert best_gamma([0.3] * 4, costly) == 0  # rarely accepted and each draft costs a step: plain decoding



def test_best_gamma_prices_a_tree_by_the_nodes_it_verifies():
    """On a compute-bound target every verified token costs; a tree verifies its nodes, not its depth.
    Priced as a chain of its depth, a 10-node tree looks cheap and keeps drafting where it loses."""
    linear = {k: 0.7 + 0.3 * k for k in range(1, 12)}  # r(k): a third of a step per extra token
    chain = CostModel(linear, t1=0.05, c=0.1)
    tree = CostModel(linear, t1=0.05, c=0.1, widths={0: 0, 1: 4, 2: 7, 3: 10})
    alphas = [0.45] * 3
    assert best_gamma(alphas, chain) > 0
    assert best_gamma(alphas, tree) == 0
    assert tree.step_cost(3) == pytest.approx(3 * 0.1 + linear[11])


def test_best_gamma_follows_measured_whole_steps():
    """A step costs more than its forward (a CPU tree's masks and verification): measured steps scale the
    predictions of the drafting gammas (at once) and replace a gamma's once STEP_SAMPLES ran; in the
    engine, which times steps by phase, a plain step keeps its prediction until plain steps are measured. From timed forwards alone a drafting step
    looked nearly free (Medusa kept drafting out of domain)."""
    cheap = CostModel({1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06}, t1=0.05, c=0.02)
    alphas = [0.15] * 3
    assert best_gamma(alphas, cheap) > 0  # predicted: 15 % acceptance pays for a 2 % dearer step
    cheap.observe_step(1, 0.05 * 1.25)  # measured: a quarter of a step more
    scale = 1.25 / cheap.predicted_cost(1, 1)
    assert cheap.step_cost(2) == pytest.approx(cheap.predicted_cost(1, 2) * scale)
    assert cheap.step_cost(0) == pytest.approx(1.0)  # no plain step measured: its prediction
    assert best_gamma(alphas, cheap) == 0
    for _ in range(STEP_SAMPLES):
        cheap.observe_step(0, 0.05 * 1.1)
        cheap.observe_step(2, 0.05 * 1.15)
    assert cheap.step_cost(0) == pytest.approx(1.1) and cheap.step_cost(2) == pytest.approx(1.15)
    assert best_gamma([0.3] * 3, cheap) == 2  # plain steps dearer than predicted too: drafting pays again
    cheap.rows = 4  # another batch size starts from its predictions
    assert cheap.step_cost(1) == pytest.approx(cheap.predicted_cost(4, 1))
    server = StepSeconds()  # the server times whole steps, host work and all: a plain step pays it too
    server.observe(1, 2, 2.5, lambda B, g: 1.0 + g / 2)
    assert server.seconds(1, 0, lambda B, g: 1.0 + g / 2) == pytest.approx(1.25)


def test_the_cost_policy_starts_a_request_from_recent_acceptance():
    """A new call's rows start from the engine's pooled acceptance of recent steps, not from a fresh 0.5:
    after steps that kept every draft, a fresh row expects most drafts kept; after many plain steps
    the pooled estimate has returned to FRESH_RATE. Without a cost model, a row's own Beta(1, 1)."""
    cost = CostModel({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, t1=0.05)
    policy = GammaPolicy("cost", gamma=3, gamma_max=3, cost=cost)
    policy.start(2)
    for _ in range(20):
        policy.observe([0, 1], drafted=[3, 3], accepted=[3, 3])
    policy.start(1)  # the next call
    assert all(a > 0.8 for a in policy.acceptance(0)) and best_gamma(policy.acceptance(0), cost) == 3
    for _ in range(400):
        policy.observe([0], drafted=[0], accepted=[0])
    assert policy.acceptance(0) == pytest.approx([FRESH_RATE] * 3, abs=1e-2)


def test_a_depth_not_drafted_recently_is_priced_as_the_deepest_one_drafted_where_that_beat_fresh_rate():
    """Past the deepest position recent steps drafted, the pooled prior is that position's rate where it
    beats FRESH_RATE: after steps of 2 drafts that kept 2 in 4 of 5, depths 3 and 4 are expected at the
    rate of depth 2 (about 0.8), so where verifying deeper is free and a draft token costs a fifth of a
    forward the policy drafts 4, where 0.5 at each depth not drafted yet kept it at 2. After steps that
    kept few drafts, the depths not drafted stay at FRESH_RATE, not at the lower rate; long after any
    draft every depth is back at FRESH_RATE."""
    cost = CostModel({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, t1=0.05, c=0.2)  # verifying deeper is free
    policy = GammaPolicy("cost", gamma=4, gamma_max=4, cost=cost)
    policy.start(1)
    for i in range(40):
        policy.observe([0], drafted=[2], accepted=[2 if i % 5 else 1])
    prior = pooled_prior(cost.pooled, 4)
    assert prior[2] == pytest.approx(prior[1]) and prior[3] == pytest.approx(prior[1]) and prior[1] > 0.75
    policy.start(1)  # a new call's row: no counts of its own
    assert best_gamma(policy.acceptance(0), cost) == 4
    fresh_deeper = [*prior[:2], FRESH_RATE, FRESH_RATE]  # what a depth not drafted was priced at before
    assert best_gamma(fresh_deeper, cost) == 2
    for i in range(200):
        policy.observe([0], drafted=[2], accepted=[1 if i % 5 == 0 else 0])  # depth 2 kept 1 in 5 times
    prior = pooled_prior(cost.pooled, 4)
    assert prior[1] < 0.3 and prior[2:] == pytest.approx([FRESH_RATE] * 2)
    for _ in range(1000):
        policy.observe([0], drafted=[0], accepted=[0])
    assert pooled_prior(cost.pooled, 4) == pytest.approx([FRESH_RATE] * 4, abs=1e-2)


def test_c_is_the_median_of_recent_drafts_whose_samples_go_when_no_drafting_shape_is_measured():
    """A stretch of slow drafts (10x) moves c only while it lasts. Once plain steps have outlasted the
    drafting shapes' measurements, c's samples are dropped, so the next drafting step (a retry) sets c alone:
    kept, an inflated mean priced drafting out for good (`suffix` on an H200 drafted nothing for the last
    170 of 192 prompts). c itself stands meanwhile: forgotten, it priced drafting as free after every
    expiry (`layer_skip` on the CPU drafted in most requests, catching each row up over its history)."""
    cost = CostModel({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, t1=0.05)
    for i in range(20):
        cost.observe_draft(0.005 * (10 if i % 4 == 0 else 1), tokens=2)  # one step in four 10x slower
    assert cost.c == pytest.approx(0.05)
    for _ in range(40):
        cost.observe_draft(0.05, tokens=2)
        cost.observe_step(2, 2 * cost.t1)
    assert cost.c == pytest.approx(0.5) and best_gamma([0.5] * 4, cost) == 0
    for _ in range(EXPLORE_EVERY):
        cost.observe_step(0, cost.t1)
    assert cost.c == pytest.approx(0.5) and not cost.draft_seen and best_gamma([0.5] * 4, cost) == 0
    cost.observe_draft(0.005, tokens=2)
    assert cost.c == pytest.approx(0.05) and best_gamma([0.5] * 4, cost) == 3  # priced as drafting costs now


def test_at_gamma_0_the_engines_cost_policy_prices_the_gammas_every_reprice_every_steps():
    """Once plain steps win, a row's gammas are priced again only every REPRICE_EVERY steps (pricing is most
    of the policy's host work a step); a row that drafts is priced at every step."""
    cost = CostModel({1: 1.0, 2: 1.0, 3: 1.0}, t1=0.05, c=0.5)
    policy = GammaPolicy("cost", gamma=2, gamma_max=2, cost=cost)
    policy.start(2)
    for _ in range(40):
        policy.observe([0, 1], drafted=[2, 2], accepted=[0, 2])
    assert policy.choose(0) == 0 and policy.choose(1) == 2
    cost.c = 0.0  # drafting is now free: row 0 finds out at its next pricing
    assert [policy.choose(0) for _ in range(REPRICE_EVERY + 1)] == [0] * REPRICE_EVERY + [2]
    assert policy.choose(1) == 2


def test_a_row_kept_plain_by_its_first_drafts_retries_and_drafts_again_where_drafts_now_pay():
    """A row whose first drafts all failed (the opening of a translation) is priced at gamma 0 and, with no
    counts coming in, would stay there for the rest of its request. After a wait that bounds what retries cost
    (RETRY_SHARE of its plain steps) it drafts once at RETRY_GAMMA, priced afresh from that step: where the
    drafts now pay it drafts on; where they still fail it returns to plain steps and waits twice as long (a
    dearer draft here, so that the pooled rate's return to FRESH_RATE prices no draft in between)."""
    def costs(c: float) -> CostModel:
        return CostModel({1: 1.0, 2: 1.0, 3: 1.0}, t1=0.05, c=c)  # a step at gamma 2: 1 + 2c plain steps

    for c, later_pays in ((0.3, True), (0.5, False)):
        wait = retry_wait(costs(c), 2, 0)
        assert wait == round(max(RETRY_MIN_WAIT, 2 * c / RETRY_SHARE)) and retry_wait(costs(c), 2, 2) == 4 * wait
        policy = GammaPolicy("cost", gamma=2, gamma_max=2, cost=costs(c))
        policy.start(1)
        for _ in range(6):  # the first drafts: all rejected
            policy.observe([0], drafted=[2], accepted=[0])
        chosen = []
        for _ in range(int(3.5 * wait)):
            gamma = policy.choose(0)
            chosen.append(gamma)
            policy.observe([0], drafted=[gamma], accepted=[gamma if later_pays else 0])
        retries = [i for i, g in enumerate(chosen) if g and (i == 0 or not chosen[i - 1])]
        assert retries[0] == wait
        if later_pays:  # it drafts from its retry on
            assert all(chosen[wait:])
        else:  # plain steps between retries, the wait doubling
            assert retries[1] - retries[0] - 1 == 2 * wait and sum(map(bool, chosen)) == 2


def test_a_deep_probe_finds_depths_that_pay_after_a_first_draft_that_rarely_does(monkeypatch):
    """Rows keep their first draft 45 % of the time but nearly every draft past it (a copied span): a
    policy that prices depths it has not drafted at the pooled prior stays shallow or plain, never seeing
    that deep drafts pay. After EXPLORE_EVERY drafting steps below gamma_max every row drafts gamma_max
    for STEP_SAMPLES steps (CostModel.probe), and those counted, the policy drafts deeper on its own: more
    tokens for the same cost than without probes. Verifying deeper is free here; a new call every 100 steps.
    A row's retries (GammaPolicy.retry) are off: they explore too, and this is the deep probe's test."""
    import random

    import specdec.adaptive as adaptive

    monkeypatch.setattr(adaptive, "retry_wait", lambda *args: 1 << 30)

    def decode(probes: bool) -> tuple[list[int], float]:
        rng = random.Random(0)
        cost = CostModel({k: 1.0 for k in range(1, 6)}, t1=0.001, widths={g: g for g in range(5)})
        if not probes:
            monkeypatch.setattr(cost, "probe", lambda gamma: None)
        policy = GammaPolicy("cost", gamma=4, gamma_max=4, cost=cost)
        chosen, tokens, seconds = [], 0, 0.0
        for step in range(600):
            if step % 100 == 0:
                policy.start(1)
            gamma = policy.choose(0)
            chosen.append(gamma)
            kept = 0
            while kept < gamma and rng.random() < (0.45 if kept == 0 else 0.9):
                kept += 1
            policy.observe([0], [gamma], [kept])
            cost.observe_draft(0.0002 * gamma, gamma)
            cost.observe_step(gamma, 0.001 * (1 + 0.2 * gamma))
            tokens, seconds = tokens + kept + 1, seconds + 0.001 * (1 + 0.2 * gamma)
        return chosen, tokens / seconds

    chosen, probed = decode(probes=True)
    _, unprobed = decode(probes=False)
    first_probe = next(i for i in range(len(chosen) - STEP_SAMPLES) if chosen[i : i + STEP_SAMPLES] == [4] * STEP_SAMPLES)
    drafting = [g for g in chosen[1:first_probe] if g]
    assert len(drafting) >= EXPLORE_EVERY and max(drafting) < 4  # its first step: the fresh prior
    assert probed > 1.05 * unprobed


def test_a_deep_probe_waits_twice_as_long_each_time_and_never_runs_where_it_could_not_pay():
    """Probes at EXPLORE_EVERY, then 2x, 4x ... (up to EXPLORE_MOST) drafting steps below gamma_max; none
    after plain steps; none where a
    gamma_max step costs gamma_max + 1 plain ones, through its verify forward (a compute-bound CPU) or its
    drafting (a draft token at 1.1 plain steps), since not even perfect acceptance would pay there."""
    cost = CostModel({k: 1.0 for k in range(1, 6)}, t1=0.001, widths={g: g for g in range(5)})
    for _ in range(4 * EXPLORE_EVERY):
        cost.observe_step(0, 0.001)  # plain steps: no probe
        assert not cost.probing
    starts, step = [], 0
    while len(starts) < 4:
        if not cost.probing:
            cost.observe_step(1, 0.001)
            if cost.probing:
                starts.append(step)
        else:
            cost.observe_step(4, 0.001)
        step += 1
    gaps = [b - a - STEP_SAMPLES for a, b in zip(starts, starts[1:])]
    assert starts[0] == EXPLORE_EVERY - 1 and gaps == [2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, 8 * EXPLORE_EVERY]
    dear = CostModel({k: float(k) for k in range(1, 6)}, t1=0.001, widths={g: g for g in range(5)})  # r(k) = k
    slow = CostModel({k: 1.0 for k in range(1, 6)}, t1=0.001, widths={g: g for g in range(5)}, c=1.1)
    for _ in range(4 * EXPLORE_EVERY):
        dear.observe_step(1, dear.predicted_cost(1, 1) * dear.t1)  # steps as predicted
        slow.observe_step(1, slow.predicted_cost(1, 1) * slow.t1)
        assert not dear.probing and not slow.probing


def test_a_row_better_than_recent_rows_is_priced_better_one_position_deeper():
    """Past the deepest position a row has drafted, its prior is the pooled rate there scaled up by how far
    the row beat the pooled rate one position above: after recent rows kept about half their drafts, a row
    that kept both drafts of five steps expects a third more than the pooled rate says, and the cost
    policy drafts 3 where the pooled rate alone gives 2. The position below that stays at the pooled rate
    until the row drafts there, and a row no better than the pool is not lifted."""
    cost = CostModel({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.4, 5: 1.8}, t1=0.05)
    policy = GammaPolicy("cost", gamma=4, gamma_max=4, cost=cost)
    policy.start(1)
    for i in range(30):  # recent requests: kept 0, 1 or 2 of 2 drafts
        policy.observe([0], drafted=[2], accepted=[i % 3])
    policy.start(2)  # the next call
    for i in range(5):
        policy.observe([0, 1], drafted=[2, 2], accepted=[2, i % 3])
    kept, average = policy.acceptance(0), policy.acceptance(1)
    pooled = pooled_prior(cost.pooled, 4)
    unlifted = policy.counts.rates(pooled, PRIOR_WEIGHT)  # [2, 4]: the rows' counts at the pooled rates alone
    assert kept[0] == pytest.approx(unlifted[0, 0]) and kept[1] >= unlifted[0, 1] and kept[2] > unlifted[0, 2] + 0.1
    assert kept[3] == pytest.approx(unlifted[0, 3])
    assert best_gamma(kept, cost) == 3 and best_gamma(list(unlifted[0]), cost) == 2
    assert average[2:] == pytest.approx(list(unlifted[1, 2:]), abs=0.05)


def test_a_lazy_drafters_catch_up_is_not_priced_as_drafting():
    """On a CPU a lazy drafter feeds a row its prompt at the row's first draft (and a stretch of plain steps
    at the next draft after it): the engine leaves such steps out of c and the measured step costs, which
    the drafts of every step would otherwise seem to pay."""
    from types import SimpleNamespace

    from specdec.drafters.catch_up import SHORT_GAP
    from specdec.engine import observe

    cost = CostModel({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, t1=0.05)
    policy = GammaPolicy("cost", gamma=3, gamma_max=3, cost=cost)
    policy.start(1)
    row = SimpleNamespace(slot=0)

    def step(drafted: int, draft_s: float) -> SimpleNamespace:
        return SimpleNamespace(rows=[SimpleNamespace(row=row, drafted=drafted, accepted=drafted)], draft_s=draft_s,
                               verify_s=0.05, wall_s=draft_s + 0.05, gamma=drafted, compiled=False)

    idle = [SHORT_GAP]  # a row just prefilled
    observe(policy, step(3, 0.5), idle)  # its first draft caught it up over its prompt
    assert not cost.draft_seen and not cost.steps.seen
    observe(policy, step(3, 0.015), idle)
    assert cost.c == pytest.approx(0.1) and len(cost.draft_seen) == 1
    for _ in range(SHORT_GAP):
        observe(policy, step(0, 0.0), idle)
    observe(policy, step(3, 0.4), idle)  # after a stretch at gamma 0: caught up again
    assert cost.c == pytest.approx(0.1) and len(cost.draft_seen) == 1
    eager = GammaPolicy("cost", gamma=3, gamma_max=3, cost=CostModel({1: 1.0, 2: 1.1}, t1=0.05))
    eager.start(1)
    observe(eager, step(3, 0.015), None)  # a stepper that feeds its drafter every step: every draft priced
    assert len(eager.cost.draft_seen) == 1


def test_the_engine_measures_its_steps_for_the_cost_policy(tiny):
    engine = specdec.SpecEngine(tiny, "ngram")
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * 2, specdec.SpecConfig(max_new_tokens=24, gamma_policy="cost", gamma_max=3))
    seen = engine.cost_model.steps.seen
    assert seen and all(B == 2 for B, _ in seen) and sum(len(v) for v in seen.values()) > 5
    observed = engine.cost_model.observed
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]], specdec.SpecConfig(max_new_tokens=24, gamma=3))
    assert engine.cost_model.observed == observed  # only `cost` calls feed it (a bench interleaves fixed gammas)


def test_a_shape_not_run_for_a_while_is_priced_again_and_waits_twice_as_long_next_time():
    """Steps at gamma 2 measured 20x their prediction (a load passing by) price it out; EXPLORE_EVERY plain
    steps later its measurement is dropped, so it is predicted again; the next wait is twice as long."""
    cost = CostModel({1: 1.0, 2: 1.05, 3: 1.1}, t1=0.05)
    predicted = cost.step_cost(2)
    for _ in range(STEP_SAMPLES):
        cost.observe_step(2, 20 * predicted * cost.t1)
    assert cost.step_cost(2) == pytest.approx(20 * predicted)
    for step in range(1, 3 * EXPLORE_EVERY + 1):
        cost.observe_step(0, cost.t1)
        if step == EXPLORE_EVERY - 1:
            assert cost.steps.measured(1, 2) is not None
    assert cost.steps.measured(1, 2) is None and cost.step_cost(2) < 2 * predicted  # priced from the forwards again
    for _ in range(STEP_SAMPLES):
        cost.observe_step(2, 20 * predicted * cost.t1)  # measured dear again
    for step in range(1, 2 * EXPLORE_EVERY + 1):
        cost.observe_step(0, cost.t1)
        assert (cost.steps.measured(1, 2) is None) == (step >= 2 * EXPLORE_EVERY), step
    assert cost.expire_after[1, 2] == 4 * EXPLORE_EVERY <= EXPLORE_MOST and cost.steps.measured(1, 0) is not None


def test_the_cost_policy_drafts_again_after_a_load_priced_drafting_out():
    """Drafting steps take 20x their prediction for the first 60 steps (a load passing by; every draft is
    accepted throughout): the policy turns to plain steps, and once those measurements have expired it
    drafts again, where without expiry it would never run a drafting step again to see the load gone."""
    cost = CostModel({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, t1=0.05, c=0.1)
    policy = GammaPolicy("cost", gamma=3, gamma_max=3, cost=cost)
    policy.start(1)
    chosen = []
    for step in range(400):
        gamma = policy.choose(0)
        chosen.append(gamma)
        slow = 20 if step < 60 and gamma else 1
        policy.observe([0], [gamma], [gamma])
        cost.observe_step(gamma, slow * cost.t1 * cost.predicted_cost(1, gamma))
    assert chosen[0] > 0 and not any(chosen[40:60])  # priced out during the load
    assert all(chosen[-100:]), chosen  # drafting again, at the cost it really has


def test_heuristic_policy_steps():
    policy = GammaPolicy("heuristic", gamma=3, gamma_max=6)
    policy.start(1)
    policy.observe([0], drafted=[3], accepted=[3])
    assert policy.choose(0) == 5
    policy.observe([0], drafted=[5], accepted=[5])
    assert policy.choose(0) == 6  # capped at gamma_max
    policy.observe([0], drafted=[6], accepted=[2])
    assert policy.choose(0) == 5
    assert policy.acceptance(0)[:3] == [pytest.approx(4 / 5), pytest.approx(4 / 5), pytest.approx(3 / 5)]


def test_lookahead_pool_and_trie():
    pool = {}
    add_to_pool(pool, (1, 2, 3), cap=2)
    add_to_pool(pool, (1, 5, 6), cap=2)
    add_to_pool(pool, (1, 2, 3), cap=2)
    assert pool[1] == [(2, 3), (5, 6)]  # most recent first, no duplicates
    drafter = LookaheadDrafter(LookaheadConfig(window=3, ngram=3, guesses=2))
    from specdec.drafters.lookahead import RowState

    row = RowState(window=[2, 3, 4], pool=pool)
    tokens, parents, window_nodes = drafter.row_trie(row, root=1, depth=3)
    assert tokens == [2, 3, 4, 5, 6] and parents == [-1, 0, 1, -1, 3]  # the pool's (2, 3) merged into the window
    assert window_nodes == [1, 2, 3]


def test_tune_candidates():
    sets = structured_candidates(6)
    assert [0] in sets and [0, 1, 2, 3, 4] in sets and [0, 5] in sets and [0, 2, 4] in sets
    assert all(s == sorted(set(s)) and len(s) < 6 for s in sets)
    assert sorted(neighbours([0, 2], 4)) == sorted([[2], [0], [0, 1, 2], [0, 2, 3]])


def test_tune_cli_writes_a_config_that_layer_skip_reads(tmp_path, capsys):
    """`specdec tune layer-skip` on a tiny model with a tokenizer, then generate with its layers."""
    from conftest import tiny_folder_with_tokenizer
    from specdec.cli import main

    folder = tiny_folder_with_tokenizer(tmp_path)
    prompts = tmp_path / "calib.txt"
    prompts.write_text("the cat sat on the mat\n1 + 2 = 3\n")
    common = ["--model", str(folder), "--dtype", "float32", "--device", DEVICE, "--threads", "1"]
    out = tmp_path / "tune.json"
    assert main(["tune", "layer-skip", "--task", str(prompts), "--limit", "2", "--max-new-tokens", "8",
                 "--max-gamma", "3", "--out", str(out), *common]) == 0
    tuned = json.loads(out.read_text())
    assert tuned["layers"] == tuned["candidates"][0]["layers"] and "best: layers" in capsys.readouterr().out
    for options in (["--layer-skip-config", str(out)], ["--layers", "0"],
                    ["--drafter", "lookahead", "--window", "3", "--lookahead-ngram", "3", "--guesses", "2"]):
        argv = ["generate", "the cat", "--drafter", "layer_skip", *options, "--max-new-tokens", "8", "--raw",
                "--check-lossless", "--json", *common]
        assert main(argv) == 0, options
        assert json.loads(capsys.readouterr().out)["lossless"] is True
    for options, message in ((["--window", "0"], "--window must be >= 1"), (["--tree-nodes", "0"], "--tree-nodes must be >= 1"),
                             (["--layer-skip-config", str(prompts)], "not a `specdec tune layer-skip` file"),
                             (["--layers", "0", "--layer-skip-config", str(out)], "not both")):
        assert main(["generate", "x", "--drafter", "layer_skip", *options, *common]) == 2
        assert message in capsys.readouterr().err


def test_shipped_drafters_match_only_their_target(deep):
    """The probe recorded for a shipped drafter matches its own target (also when it was recorded in
    bfloat16), and no other."""
    from specdec.drafters.shipped import matches_probe, target_probe

    target, _ = deep
    probe = target_probe(target)
    assert matches_probe(target, probe)
    rounded = torch.tensor(probe["values"]).to(torch.bfloat16).float().tolist()
    assert matches_probe(target, dict(probe, values=rounded))
    moved = dict(probe, values=[[v + 0.1 for v in row] for row in probe["values"]])
    assert not matches_probe(target, moved) and not matches_probe(target, dict(probe, num_layers=99))


def test_pack_rows_puts_each_slot_first_and_fills_the_rest():
    """The host drafters' proposals (suffix, lookahead): one tensor for every slot, the absent ones filled."""
    packed = pack_rows({0: [5, 6], 2: [7, 8, 9]}, capacity=4, width=3, fill=-1)
    assert packed.dtype == torch.long
    assert packed.tolist() == [[5, 6, -1], [-1, -1, -1], [7, 8, 9], [-1, -1, -1]]

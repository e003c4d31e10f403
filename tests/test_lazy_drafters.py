"""Lazy drafter state (specdec/drafters/catch_up.py): EAGLE's head and a draft model are fed only when a
row drafts, then catch up over the positions they skipped, in gaps (eager steppers on the CPU) or in
fixed-width chunks (the graphed steppers' path, here run eagerly on a static batch).

- the drafts of a caught-up state are bitwise those of a state fed all along: EAGLE's in gaps against its
  state in chunks, a draft model's (in gaps and in chunks) against one fed the whole history from
  scratch; through stretches at gamma 0 short and long (one forward for every row, or one per row far behind; one chunk, or more run
  by the host), rows at different gammas, and a row leaving and a new one joining its slot;
- in chunks, the host's bound (Lag) leaves no row behind when the head or the draft model drafts;
- a step at gamma 0 runs no head or draft forward at all, nor does a prompt joining in gaps;
- layer_skip's first layers read the target's own cache in gaps: one token fed a row before its drafts.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from specdec.batch import Request, RowBatch, eos_ids
from specdec.drafters.catch_up import SHORT_GAP
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.step import Stepper, StepRecord, new_stepper
from test_eagle import random_head
from test_engine import PROMPTS, models, plain  # noqa: F401  (fixtures)

# Catching up in gaps is the CPU's: an eager stepper on a GPU (an observed run) catches up in chunks, as graphed ones do.
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="catching up in gaps runs on the CPU only (catch_up.catches_up)")

MAX_LEN, NEW = 160, 60
# Per step: the step's gamma and each slot's (batch.gamma): stretches at gamma 0 of 1, 3 (fed with the
# other rows) and more than SHORT_GAP steps (fed alone), and a row at gamma 0 beside one drafting.
SCHEDULE = [(3, [3, 3])] * 2 + [(0, [0, 0])] + [(3, [3, 3])] + [(0, [0, 0])] * 3 + [(3, [3, 0]), (3, [0, 3])] \
    + [(0, [0, 0])] * (SHORT_GAP + 4) + [(2, [2, 2])] * 2
LEAVE_AT = 9  # the step after which slot 1 leaves and a new row joins it


def eagle(target, draft, lookup: int = 0) -> EagleDrafter:
    return EagleDrafter(target, random_head(target, draft_vocab=64), EagleTreeConfig(depth=3, branch=2, frontier=2,
                                                                                      total_tokens=6, lookup=lookup))


def chunked_stepper(target, drafter) -> Stepper:
    """Steps run eagerly, but over a static batch: the drafter keeps the state graphed steppers keep."""
    batch = RowBatch(2, MAX_LEN, list(eos_ids(target)), torch.device(DEVICE), static=True)
    drafter.attach(batch)
    return Stepper(target, drafter, batch, target.new_cache(2, MAX_LEN), graphs=False)


def run_schedule(stepper: Stepper, check=None) -> list[list]:
    """Run SCHEDULE on two rows; at LEAVE_AT slot 1 leaves and a new row takes it. Per drafting step, each
    running row's drafts (tokens, and a tree's parents); check(stepper, record) sees each record."""
    drafts: list[list] = []

    def observe(record: StepRecord) -> None:
        parents = record.tree.parents if record.tree is not None else None
        drafts.append([(record.draft_tokens[b].tolist(), None if parents is None else parents[b].tolist())
                       for b in range(2) if record.active[b]])
        if check is not None:
            check(stepper, record)

    stepper.prefill([0, 1], [Request(PROMPTS[2], NEW), Request(PROMPTS[1], NEW)])
    for i, (gamma, gammas) in enumerate(SCHEDULE):
        stepper.batch.gamma.copy_(torch.tensor(gammas))
        stepper.launch(gamma, observe if gamma else None)
        stepper.read()
        if i == LEAVE_AT:
            stepper.batch.release(1)
            stepper.prefill([1], [Request(PROMPTS[0], NEW)])
    return drafts


def fed_up_to_date(drafter: EagleDrafter, monkeypatch) -> list[int]:
    """Check, as the head starts each tree, that every running row's head cache holds its pairs up to L - 2
    (nothing left behind by the catch-up); returns the list of trees checked, filled as they grow."""
    grow, grown = drafter.grow, []

    def checked(root, batch, depth):
        active = batch.active
        assert torch.equal(batch.draft.cache.lengths[active], batch.length[active] - 1)
        grown.append(depth)
        return grow(root, batch, depth)

    monkeypatch.setattr(drafter, "grow", checked)
    return grown


@pytest.mark.parametrize("lookup", [0, 3], ids=["tree", "tree+lookup"])
def test_eagle_drafts_alike_caught_up_in_gaps_and_in_chunks(models, lookup, monkeypatch):  # noqa: F811
    """Gaps (each row exactly what it skipped) and chunks (fixed-width forwards, more of them run by the host
    after a long stretch at gamma 0: Lag) feed the head the same pairs: the same drafts, also where a grafted
    lookup branch was accepted (depth + 1 kept, what a chunk covers), and no row is left behind in either."""
    target, _, draft = models
    drafter = eagle(target, draft, lookup)
    grown = fed_up_to_date(drafter, monkeypatch)
    gaps = new_stepper(target, drafter, 2, MAX_LEN, list(eos_ids(target)), graphs=False)
    chunks = chunked_stepper(target, drafter)
    assert gaps.batch.draft.lag is None and chunks.batch.draft.lag.width == SHORT_GAP
    gap_drafts = run_schedule(gaps)
    assert gap_drafts == run_schedule(chunks)
    assert len(gap_drafts) == sum(g > 0 for g, _ in SCHEDULE) and len(grown) == 2 * len(gap_drafts)


def test_eagle_in_chunks_feeds_a_long_stretch_in_the_chunks_the_host_counts(models, monkeypatch):  # noqa: F811
    """In chunks: joins feed the prompt, gamma-0 steps feed the head nothing, and a drafting step after n of
    them runs ceil((depth + 1 + n) / width) chunks (the propose's own included) and leaves no row behind."""
    target, _, draft = models
    drafter = eagle(target, draft)
    fed_up_to_date(drafter, monkeypatch)
    forwards = []
    features = drafter.head.features
    monkeypatch.setattr(drafter.head, "features", lambda *a, **k: forwards.append(1) or features(*a, **k))
    stepper = chunked_stepper(target, drafter)
    stepper.prefill([0, 1], [Request(PROMPTS[0], NEW), Request(PROMPTS[2], NEW)])
    stepper.batch.gamma.fill_(3)
    depth = drafter.shape(3).depth
    stepper.launch(3)
    stepper.read()
    for n in (0, 5, 20):
        for _ in range(n):
            stepper.launch(0)
            stepper.read()
        assert stepper.batch.draft.lag.most == depth + 1 + n
        forwards.clear()
        stepper.launch(3)
        stepper.read()
        chunks = -(-(depth + 1 + n) // SHORT_GAP)
        assert len(forwards) == chunks + depth - 1  # the chunks, then the tree's levels past the root's


def test_draft_model_in_chunks_counts_the_two_tokens_a_drafting_step_leaves(models, monkeypatch):  # noqa: F811
    """In chunks a draft model is fed its drafts, so a drafting step leaves a row at most 2 tokens behind
    (Lag.behind), whatever gamma: a drafting step after n gamma-0 steps runs ceil((2 + n) / width) chunks
    (the propose's own included), then gamma - 1 forwards over its drafts."""
    target, _, draft = models
    drafter = DraftModelDrafter(target, draft)
    forwards = []
    forward = drafter.draft.forward
    monkeypatch.setattr(drafter.draft, "forward", lambda *a, **k: forwards.append(1) or forward(*a, **k))
    stepper = chunked_stepper(target, drafter)
    batch = stepper.batch
    stepper.prefill([0, 1], [Request(PROMPTS[0], NEW), Request(PROMPTS[2], NEW)])
    batch.gamma.fill_(5)
    stepper.launch(5)
    stepper.read()
    for n in (0, 6, 7, 20):
        for _ in range(n):
            stepper.launch(0)
            stepper.read()
        assert batch.draft.lag.most == 2 + n
        assert int((batch.length - batch.draft.cache.lengths).max()) <= 2 + n
        forwards.clear()
        stepper.launch(5)
        stepper.read()
        assert len(forwards) == -(-(2 + n) // SHORT_GAP) + 5 - 1


@pytest.mark.parametrize("how", ["gaps", "chunks"])
def test_draft_model_caught_up_drafts_equal_drafts_fed_from_scratch(models, how):  # noqa: F811
    """At every drafting step, each running row's chain is what the draft gives fed the row's whole history
    in a fresh cache (exactly what "fed all along" means), caught up in gaps or in chunks (the host's count
    of chunks included: with none before the propose's own, the long stretch leaves rows behind)."""
    target, _, draft = models
    drafter = DraftModelDrafter(target, draft)
    if how == "gaps":
        lazy = new_stepper(target, drafter, 2, MAX_LEN, list(eos_ids(target)), graphs=False)
        assert lazy.batch.draft.lag is None
    else:
        lazy = chunked_stepper(target, drafter)
        assert lazy.batch.draft.lag.width == SHORT_GAP and lazy.batch.draft.lag.behind == 2
    checked = []

    def check(stepper: Stepper, record: StepRecord) -> None:
        batch = stepper.batch
        for b in range(2):
            if record.active[b]:
                L = int(batch.prompt_length[b]) + record.num_generated[b]  # the row's tokens when it drafted
                expected = greedy_chain(draft, batch.tokens[b, :L].tolist(), record.draft_tokens.shape[1])
                assert record.draft_tokens[b].tolist() == expected, (len(checked), b)
                checked.append(b)

    run_schedule(lazy, check)
    assert set(checked) == {0, 1} and len(checked) >= sum(g > 0 for g, _ in SCHEDULE)


def test_layer_skip_of_the_first_layers_drafts_from_the_targets_own_cache(models, plain, monkeypatch):  # noqa: F811
    """The target's first layers as the draft, in gaps: their keys and values are the target's cache's (no cache
    of its own), every drafting step feeds one token a row before its drafts, however long the stretch at
    gamma 0 before it (gamma forwards a drafting step: the pending token's and gamma - 1 drafts'), and its
    chains are bitwise what the same layers give fed the row's whole history from scratch. The draft writes
    the target's cache, so the target's own output is checked too: plain greedy decoding's."""
    target, _, _ = models
    drafter = LayerSkipDrafter(target, [0])
    stepper = new_stepper(target, drafter, 2, MAX_LEN, list(eos_ids(target)), graphs=False)
    state = stepper.batch.draft
    assert state.cache.k.data_ptr() == stepper.cache.k.data_ptr() and state.follows is stepper.cache.lengths
    forwards, checked = [], []
    forward = drafter.draft.forward
    monkeypatch.setattr(drafter.draft, "forward", lambda *a, **k: forwards.append(1) or forward(*a, **k))

    def check(stepper: Stepper, record: StepRecord) -> None:
        batch = stepper.batch
        for b in range(2):
            if record.active[b]:
                L = int(batch.prompt_length[b]) + record.num_generated[b]
                with monkeypatch.context() as m:  # the from-scratch reference's forwards are not the step's
                    m.setattr(drafter.draft, "forward", forward)
                    expected = greedy_chain(drafter.draft, batch.tokens[b, :L].tolist(), record.draft_tokens.shape[1])
                assert record.draft_tokens[b].tolist() == expected, (len(checked), b)
                checked.append(b)

    run_schedule(stepper, check)
    assert set(checked) == {0, 1} and len(forwards) == sum(g for g, _ in SCHEDULE)
    for slot, prompt in ((0, 2), (1, 0)):  # slot 1's second row joined at LEAVE_AT
        generated = stepper.batch.rows[slot].generated
        assert len(generated) > 5 and generated == plain[prompt][: len(generated)]


def test_layer_skip_keeps_a_cache_of_its_own_where_it_cannot_share_the_targets(models):  # noqa: F811
    """Layers other than the first ones (their inputs differ from the target's there), or a catch-up in chunks
    (whose padding runs past a row's length, where the target's cache has no spare slots): a cache of its own."""
    target, _, _ = models
    skipping = new_stepper(target, LayerSkipDrafter(target, [1]), 2, MAX_LEN, list(eos_ids(target)), graphs=False)
    chunks = chunked_stepper(target, LayerSkipDrafter(target, [0]))
    for stepper in (skipping, chunks):
        state = stepper.batch.draft
        assert state.follows is None and state.cache.k.data_ptr() != stepper.cache.k.data_ptr()


def greedy_chain(draft, history: list[int], k: int) -> list[int]:
    """k greedy draft tokens after `history`, the draft fed it from scratch."""
    dev, n = DEVICE, len(history)
    cache = draft.new_cache(1, n + k)
    logits = draft(torch.tensor([history], device=dev), torch.arange(n, device=dev)[None], cache,
                   logits_at=torch.tensor([n - 1], device=dev)).logits[:, -1]
    chain = []
    for i in range(k):
        chain.append(int(logits.argmax(-1)))
        logits = draft(torch.tensor([[chain[-1]]], device=dev), torch.tensor([[n + i]], device=dev), cache).logits[:, -1]
    return chain


@pytest.mark.parametrize("name", ["eagle", "draft_model"])
def test_gamma_zero_steps_and_joins_run_no_drafter_forward(models, plain, name, monkeypatch):  # noqa: F811
    """Counted at the drafter's model: nothing while rows join and step at gamma 0; a catch-up when they draft
    again; the output stays plain greedy decoding."""
    target, _, draft = models
    drafter = eagle(target, draft) if name == "eagle" else DraftModelDrafter(target, draft)
    model = drafter.head if name == "eagle" else drafter.draft
    forwards = []
    method = "features" if name == "eagle" else "forward"  # (the draft's forward: of this instance, not the target's)
    run = getattr(model, method)
    monkeypatch.setattr(model, method, lambda *a, **k: forwards.append(1) or run(*a, **k))
    stepper = new_stepper(target, drafter, 2, MAX_LEN, list(eos_ids(target)), graphs=False)
    rows = stepper.prefill([0, 1], [Request(PROMPTS[0], 20), Request(PROMPTS[2], 20)])
    for _ in range(5):
        stepper.launch(0)
        stepper.read()
    assert forwards == []
    stepper.batch.gamma.fill_(3)
    while stepper.batch.busy:
        stepper.launch(3)
        stepper.read()
    assert forwards
    assert [r.generated for r in rows] == [plain[0][:20], plain[2][:20]]

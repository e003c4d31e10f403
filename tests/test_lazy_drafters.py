"""Lazy drafter state (specdec/drafters/catch_up.py) on eager steppers: EAGLE's head and a draft model
are fed only when a row drafts, then catch up over the positions they skipped.

- the drafts of a caught-up state are bitwise those of a state fed all along: EAGLE's against its eager
  state (the graphed steppers' path, here run eagerly on a static batch), a draft model's against one
  fed the whole history from scratch; through stretches at gamma 0 short and long (one forward for
  every row, or one per row far behind), rows at different gammas, and a row leaving and a new one
  joining its slot;
- a step at gamma 0, and a prompt joining, run no head or draft forward at all.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from specdec.batch import Request, RowBatch, eos_ids
from specdec.drafters.catch_up import SHORT_GAP
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.step import Stepper, StepRecord, new_stepper
from test_eagle import random_head
from test_engine import PROMPTS, models, plain  # noqa: F401  (fixtures)

# Lazy state is the CPU's: an eager stepper on a GPU (an observed run) feeds every step, as graphed ones do.
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="lazy drafter state runs on the CPU only (catch_up.catches_up)")

MAX_LEN, NEW = 160, 60
# Per step: the step's gamma and each slot's (batch.gamma): stretches at gamma 0 of 1, 3 (fed with the
# other rows) and more than SHORT_GAP steps (fed alone), and a row at gamma 0 beside one drafting.
SCHEDULE = [(3, [3, 3])] * 2 + [(0, [0, 0])] + [(3, [3, 3])] + [(0, [0, 0])] * 3 + [(3, [3, 0]), (3, [0, 3])] \
    + [(0, [0, 0])] * (SHORT_GAP + 4) + [(2, [2, 2])] * 2
LEAVE_AT = 9  # the step after which slot 1 leaves and a new row joins it


def eagle(target, draft, lookup: int = 0) -> EagleDrafter:
    return EagleDrafter(target, random_head(target, draft_vocab=64), EagleTreeConfig(depth=3, branch=2, frontier=2,
                                                                                      total_tokens=6, lookup=lookup))


def eager_stepper(target, drafter) -> Stepper:
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


@pytest.mark.parametrize("lookup", [0, 3], ids=["tree", "tree+lookup"])
def test_eagle_caught_up_drafts_equal_eager_ones(models, lookup):  # noqa: F811
    """The lazy catch-up feeds the head what eager feeding (the graphed steppers' state) does: the same
    drafts, also where a grafted lookup branch was accepted (at most depth + 1 kept, as the eager commit feeds)."""
    target, _, draft = models
    drafter = eagle(target, draft, lookup)
    lazy = new_stepper(target, drafter, 2, MAX_LEN, list(eos_ids(target)), graphs=False)
    assert lazy.batch.draft.features is not None and eager_stepper(target, drafter).batch.draft.features is None
    lazy_drafts = run_schedule(lazy)
    assert lazy_drafts == run_schedule(eager_stepper(target, drafter))
    assert len(lazy_drafts) == sum(g > 0 for g, _ in SCHEDULE)


def test_draft_model_caught_up_drafts_equal_drafts_fed_from_scratch(models):  # noqa: F811
    """At every drafting step, each running row's chain is what the draft gives fed the row's whole history
    in a fresh cache (exactly what "fed all along" means)."""
    target, _, draft = models
    lazy = new_stepper(target, DraftModelDrafter(target, draft), 2, MAX_LEN, list(eos_ids(target)), graphs=False)
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

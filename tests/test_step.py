"""The shared speculative step (specdec/step.py) over a RowBatch, for every kind of drafter state:

- a step leaves rows that do not take part exactly as they were (what lets rows stop, leave and join
  between steps, and lets a CUDA graph be warmed up on a live batch);
- rows joining and leaving mid-run each give the tokens of decoding that prompt alone;
- on CUDA, replaying captured graphs gives the tokens of running the same steps eagerly.
Greedy equality per drafter and sampling's distribution are tested in test_engine*.py, test_eagle.py,
test_medusa.py, test_training_free.py and test_sampling_e2e.py, which all run through this step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import specdec
from conftest import DEVICE
from specdec import SamplingParams, SpecConfig
from specdec.batch import TOP_K_BOUND, Request, RowBatch, eos_ids
from specdec.drafters import DrafterOptions, build_drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.drafters.medusa import DEFAULT_TREE, MedusaDrafter, MedusaTree
from specdec.graphs import PrefillGraphs
from specdec.kv_cache import KVCache
from specdec.step import new_stepper
from test_eagle import random_head
from test_engine import MAX_NEW, PROMPTS, models, plain  # noqa: F401  (fixtures)
from test_medusa import random_heads

DRAFTERS = ["none", "ngram", "draft_model", "eagle", "medusa", "lookahead", "suffix"]


def make_drafter(name: str, target, draft):
    if name == "draft_model":
        return DraftModelDrafter(target, draft)
    if name == "eagle":
        return EagleDrafter(target, random_head(target, draft_vocab=64), EagleTreeConfig(depth=3, branch=2, frontier=2,
                                                                                          total_tokens=6))
    if name == "medusa":
        return MedusaDrafter(target, random_heads(target), MedusaTree.of(DEFAULT_TREE, 4))
    return build_drafter(name, target, DrafterOptions())


def snapshot(state) -> object:
    """Everything a step may not change for rows that do not take part: tensors as they are, and of a
    KV cache its lengths and each row's valid slots (slots past a row's length are scratch)."""
    if isinstance(state, KVCache):
        lengths = state.lengths.tolist()
        return lengths, [(state.k[:, b, :, :n].clone(), state.v[:, b, :, :n].clone()) for b, n in enumerate(lengths)]
    if isinstance(state, torch.Tensor):
        return state.clone()
    if dataclasses.is_dataclass(state):
        return {f.name: snapshot(getattr(state, f.name)) for f in dataclasses.fields(state)}
    if isinstance(state, dict):
        return {k: snapshot(dataclasses.asdict(v)) if dataclasses.is_dataclass(v) else v for k, v in state.items()}
    return state


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_step_leaves_rows_that_do_not_take_part_alone(models, name):  # noqa: F811
    """Rows that stopped (on the device, and on the host once read: a host drafter proposes for the rows the
    host holds as running, since a row that stopped in a step in flight is masked on the device anyway)."""
    target, _, draft = models
    stepper = new_stepper(target, make_drafter(name, target, draft), 2, 128, list(eos_ids(target)), graphs=False)
    stepper.prefill([0, 1], [Request(PROMPTS[0], 20), Request(PROMPTS[2], 20)])
    stepper.batch.gamma.fill_(3)
    for _ in range(2):
        stepper.launch(3)
        stepper.read()
    batch = stepper.batch
    for row in batch.rows.values():
        row.finish_reason = "length"
    before = [snapshot(x) for x in (batch.tokens, batch.length, batch.draws, stepper.cache, batch.draft)]
    batch.active.zero_()
    stepper.launch(3)
    report = stepper.read()
    after = [snapshot(x) for x in (batch.tokens, batch.length, batch.draws, stepper.cache, batch.draft)]
    assert report.rows == []
    assert_same(before, after, name)


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle", "medusa"])
def test_rows_joining_and_leaving_decode_as_alone(models, plain, name):  # noqa: F811
    """Slot 1 leaves early and is taken by a new row while slot 0 runs on; a third row joins slot 2."""
    target, _, draft = models
    stepper = new_stepper(target, make_drafter(name, target, draft), 3, 128, list(eos_ids(target)))
    batch = stepper.batch
    batch.gamma.fill_(3)
    first, leaving = stepper.prefill([0, 1], [Request(PROMPTS[0], MAX_NEW), Request(PROMPTS[1], MAX_NEW)])
    for _ in range(3):
        stepper.launch(3)
        stepper.read()
    batch.release(1)
    joined = stepper.prefill([1, 2], [Request(PROMPTS[2], MAX_NEW), Request(PROMPTS[1], MAX_NEW)])
    batch.gamma.fill_(3)
    while batch.busy:
        stepper.launch(3)
        stepper.read()
    assert first.generated == plain[0]
    assert leaving.generated == plain[1][: len(leaving.generated)] and 0 < len(leaving.generated) < MAX_NEW
    assert [r.generated for r in joined] == [plain[2], plain[1]]


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle", "medusa"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_replay_equals_eager_steps(models, name, temperature):  # noqa: F811
    target, _, draft = models
    drafter = make_drafter(name, target, draft)
    config = SpecConfig(gamma=3, max_new_tokens=MAX_NEW, sampling=SamplingParams(temperature=temperature, seed=4))
    graphed = specdec.SpecEngine(target, drafter, graphs=True).generate(PROMPTS, config)
    eager = specdec.SpecEngine(target, drafter, graphs=False).generate(PROMPTS, config)
    assert [r.token_ids for r in graphed.rows] == [r.token_ids for r in eager.rows]
    assert graphed.stats.accepted == eager.stats.accepted


def test_usual_top_k_values_share_one_step_shape():
    """A step's shape depends on whether a row samples and on a bound on the rows' top_k: every top_k up to
    TOP_K_BOUND shares the shape a server captures before serving, larger ones take their power of two."""
    batch = RowBatch(4, 32, [], torch.device("cpu"))
    assert batch.sampling_mode() == (False, 0)
    batch.occupy([0], [Request([1, 2], 4)])  # greedy
    assert batch.sampling_mode() == (False, 0)
    batch.occupy([1], [Request([1, 2], 4, SamplingParams(temperature=0.7))])  # no top-k
    assert batch.sampling_mode() == (True, 0)
    for top_k, bound in ((1, TOP_K_BOUND), (20, TOP_K_BOUND), (50, TOP_K_BOUND), (TOP_K_BOUND, TOP_K_BOUND), (100, 128)):
        batch.occupy([2], [Request([1, 2], 4, SamplingParams(temperature=0.7, top_k=top_k))])
        assert batch.sampling_mode() == (True, bound), top_k
        batch.release(2)


def test_occupy_writes_each_requests_prompt_and_settings_into_its_slot():
    """Rows joining slots 3 and 1 (in that order, prompts of different lengths) get their own prompt, lengths,
    limit, seed, stop flag and sampling parameters, each in its slot; slot 0, occupied before, and slot 2,
    free, keep theirs; the joining rows stay out of steps until their prompts are read (active=False)."""
    batch = RowBatch(4, 16, [], torch.device("cpu"))
    batch.occupy([0], [Request([9, 9, 9], 5)])
    before = {n: getattr(batch, n).clone() for n in ("tokens", "length", "limit", "seed", "active")}
    a = Request([5, 6, 7, 8], 6, SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.05, seed=11), stop_at_eos=False)
    b = Request([4, 3], 2, SamplingParams(temperature=1.5, top_p=0.8, seed=12))
    batch.draws[3] = 5
    rows = batch.occupy([3, 1], [a, b], active=False)
    assert [r.slot for r in rows] == [3, 1] and batch.rows[3].request is a and batch.rows[1].request is b
    assert batch.tokens[3, :4].tolist() == [5, 6, 7, 8] and batch.tokens[1, :2].tolist() == [4, 3]
    assert batch.length[[3, 1]].tolist() == [4, 2] and batch.prompt_length[[3, 1]].tolist() == [4, 2]
    assert batch.limit[[3, 1]].tolist() == [10, 4] and batch.seed[[3, 1]].tolist() == [11, 12]
    assert batch.stop_at_eos[[3, 1]].tolist() == [False, True] and batch.draws[3] == 0
    assert not batch.active[[3, 1]].any()
    for name, want in (("temperature", [0.5, 1.5]), ("top_k", [7, 0]), ("top_p", [0.9, 0.8]), ("min_p", [0.05, 0.0])):
        assert getattr(batch.sampling, name)[[3, 1]].tolist() == pytest.approx(want), name
    for name, t in before.items():
        assert torch.equal(getattr(batch, name)[[0, 2]], t[[0, 2]]), name
    batch.occupy([2], [Request([1], 1, SamplingParams(temperature=0.7, top_k=10**30))])  # past any vocabulary
    assert batch.sampling.top_k[2] >= batch.sampling.temperature.new_tensor(2**24) and batch.active[2]


def test_prefill_graph_shapes_pad_to_powers_of_two_within_the_budget():
    graphs = PrefillGraphs.__new__(PrefillGraphs)
    graphs.max_tokens, graphs.max_span = 4096, None
    assert graphs.shape(3, 35) == (4, 64) and graphs.shape(1, 5) == (1, 16) and graphs.shape(64, 64) == (64, 64)
    assert graphs.shape(64, 65) is None and graphs.shape(1, 4097) is None  # past the budget: eager
    shapes = graphs.shapes(6)
    assert (8, 512) in shapes and (16, 16) not in shapes and all(R * S <= 4096 for R, S in shapes)
    assert all(graphs.shape(rows, longest) in shapes for rows in range(1, 7) for longest in (1, 16, 17, 500))
    graphs.max_span = 300  # a row's context: no prompt is longer, so no wider shape is captured
    assert max(S for _, S in graphs.shapes(6)) == 512 and (1, 512) in graphs.shapes(6)
    assert all(graphs.shape(rows, longest) in graphs.shapes(6) for rows in range(1, 7) for longest in (1, 17, 300))


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs need a CUDA device")
def test_a_graphed_prefill_is_bitwise_the_eager_one(models, monkeypatch):  # noqa: F811
    """A whole-prompt prefill replays a graph padded to R rows x S positions (here 3 prompts of 7, 35 and 2
    tokens as 4 x 64); the exact kernels keep every real row's bits: the logits its first token comes from,
    the hidden states a drafter reads, and the keys and values left in its slots. (A graph's positions
    buffer, once not held, was reused by later allocations: the first rows' later positions then differed.)"""
    import specdec.step as step

    target, _, _ = models
    prompts = [PROMPTS[0], PROMPTS[2] + PROMPTS[0] * 3, PROMPTS[1]]
    seen, caches = [], []
    join, sample_first = step.Stepper.join_read, step.sample_first

    def spy_join(self, prefill, lo, hi, first, tokens):
        seen[-1] = (prefill.graph, prefill.hidden.clone(), seen[-1])
        return join(self, prefill, lo, hi, first, tokens)

    def spy_sample(rows, logits):
        seen.append(logits.clone())
        return sample_first(rows, logits)

    monkeypatch.setattr(step.Stepper, "join_read", spy_join)
    monkeypatch.setattr(step, "sample_first", spy_sample)
    for graphs in (True, False):
        stepper = new_stepper(target, build_drafter("none", target), 4, 128, list(eos_ids(target)), graphs=graphs)
        if graphs:  # captured ahead, then other work reuses whatever memory the capture let go
            assert stepper.capture_prefills(4) > 0
            churn = [torch.full((1 << 12,), 7, device=DEVICE) for _ in range(256)]
            del churn
        stepper.prefill([0, 1, 2], [Request(p, 8) for p in prompts])
        caches.append(stepper.cache)
    (graph, hidden, logits), (eager, eager_hidden, eager_logits) = seen
    assert graph == (4, 64) and eager is None
    assert torch.equal(hidden, eager_hidden) and torch.equal(logits, eager_logits)
    for slot, prompt in enumerate(prompts):
        for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
            assert torch.equal(a[:, slot, :, : len(prompt)], b[:, slot, :, : len(prompt)])


@pytest.mark.parametrize("name", ["none", "medusa", "eagle", "draft_model"])
def test_a_join_padded_with_its_first_row_leaves_the_state_of_the_unpadded_one(models, name, monkeypatch):  # noqa: F811
    """A captured join (step.JoinGraph) runs over its prefill shape's R rows: rows past a group's repeat its
    first row (slot, keys and values, features, first token, draw), so that slot is written more than once,
    each time with its own bits. Eagerly on the CPU, EAGLE and the draft model fed at the join as on a graphed
    stepper: the rows' state after a join padded by 3 rows equals the unpadded join's, bit for bit."""
    import specdec.drafters.draft_model as draft_model
    import specdec.drafters.eagle as eagle
    import specdec.step as step

    monkeypatch.setattr(eagle, "catches_up", lambda batch: False)
    monkeypatch.setattr(draft_model, "catches_up", lambda batch: False)
    target, _, draft = models
    drafter = make_drafter(name, target, draft)
    join_rows = step.join_rows

    def padded(batch, cache, drafter, index, first, sampled, keys, values, hidden, span, pad=3):
        def more(t, dim=0):
            return torch.cat([t, t.narrow(dim, 0, 1).repeat_interleave(pad, dim)], dim)
        join_rows(batch, cache, drafter, more(index), more(first), more(sampled), more(keys, 1), more(values, 1),
                  more(hidden), span)

    requests = [Request(PROMPTS[0], 8), Request(PROMPTS[2], 8, SamplingParams(temperature=0.8, seed=3))]
    states = []
    for join in (join_rows, padded):
        monkeypatch.setattr(step, "join_rows", join)
        stepper = new_stepper(target, drafter, 4, 128, list(eos_ids(target)), graphs=False)
        stepper.prefill([2, 0], requests)
        batch = stepper.batch
        states.append((snapshot({n: getattr(batch, n) for n in ("tokens", "length", "limit", "active", "draws")}),
                       snapshot(stepper.cache), snapshot(batch.draft), [r.generated for r in batch.rows.values()]))
    assert_same(states[0], states[1])


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs")
@pytest.mark.parametrize("name", ["none", "ngram", "medusa", "eagle", "draft_model"])
def test_a_captured_join_is_bitwise_the_eager_one(models, plain, name, monkeypatch):  # noqa: F811
    """step.JoinGraph: three prompts (one sampled) join through their prefill shape's captured join (4 rows,
    one padded) into slots 2, 0 and 3, after captures that wrote into free slot 0. The rows' state equals
    an eager join's (the same prefill graph, captured on first use: no join graph), bit for bit, and the
    greedy rows then decode as plain decoding does. An engine's call captures a shape's join at its first use
    (Stepper.capture_prefill): the eager pass turns that off."""
    import specdec.step as step

    target, _, draft = models
    drafter = make_drafter(name, target, draft)
    replays = []
    replay = step.JoinGraph.replay
    monkeypatch.setattr(step.JoinGraph, "replay", lambda self, *args: (replays.append(len(args[0])), replay(self, *args)))
    requests = [Request(PROMPTS[0], MAX_NEW), Request(PROMPTS[2], MAX_NEW, SamplingParams(temperature=0.8, seed=3)),
                Request(PROMPTS[1], MAX_NEW)]
    states, outputs = [], []
    for ahead in (True, False):
        stepper = new_stepper(target, drafter, 4, 128, list(eos_ids(target)), graphs=True)
        if ahead:
            assert stepper.capture_prefills(4) > 0 and stepper.join_graphs
        else:
            monkeypatch.setattr(stepper, "capture_join", lambda key: None)
        rows = stepper.prefill([2, 0, 3], requests)
        batch = stepper.batch
        states.append((snapshot({n: getattr(batch, n) for n in ("tokens", "length", "limit", "active", "draws")}),
                       snapshot(stepper.cache), snapshot(batch.draft), [r.generated for r in rows]))
        batch.gamma.fill_(3)
        while batch.busy:
            stepper.launch(3)
            stepper.read()
        outputs.append([r.generated for r in rows])
    assert replays == [3]
    assert_same(states[0], states[1])
    assert outputs[0] == outputs[1] and outputs[0][0] == plain[0] and outputs[0][2] == plain[1]


@pytest.mark.parametrize("max_new", [0, 1, 5])
@pytest.mark.parametrize("stop_at_eos", [True, False])
def test_the_host_knows_a_first_tokens_outcome_as_append_gives_it(max_new, stop_at_eos):
    """A join hands its first tokens out before its append has run on the device (step.prefill_stream):
    the host's outcome (first_token_outcome) must be append's, at EOS, at the length limit and neither."""
    from specdec.batch import append, first_token_outcome

    for token in (2, 7):  # EOS, and not
        batch = RowBatch(3, 32, [2, 5], torch.device("cpu"))
        request = Request([1, 3, 4], max_new, stop_at_eos=stop_at_eos)
        batch.occupy([1], [request])
        emitted = torch.tensor([[0], [token], [0]])
        kept, finish = append(batch, emitted, torch.tensor([0, 1, 0]))
        assert first_token_outcome(request, token, batch.eos_ids) == (int(kept[1]), int(finish[1])), (token, max_new)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="streams need a CUDA device")
@pytest.mark.parametrize("name", ["none", "eagle"])
def test_a_prompt_is_read_beside_the_step_in_flight(models, plain, name):  # noqa: F811
    """A row joining while a step runs has its prompt read on the prefill stream and its first token on the
    host before that step ends (here a step held on the device by a kernel that sleeps for about a second);
    the join itself runs after the step, and both rows decode as alone."""
    import time

    target, _, draft = models
    stepper = new_stepper(target, make_drafter(name, target, draft), 2, 128, list(eos_ids(target)))
    assert stepper.prefill_stream is not None and stepper.capture_prefills(2) > 0  # no capture (a sync) below
    batch = stepper.batch
    running = stepper.prefill([0], [Request(PROMPTS[0], MAX_NEW)])[0]
    batch.gamma.fill_(3)
    stepper.launch(3)
    torch.cuda._sleep(2_000_000_000)  # the step in flight ends after this (about a second)
    t = time.perf_counter()
    joined = stepper.prefill([1], [Request(PROMPTS[1], MAX_NEW)])[0]
    waited = time.perf_counter() - t
    assert joined.generated == plain[1][:1] and waited < 0.3, waited
    stepper.read()
    while batch.busy:
        stepper.launch(3)
        stepper.read()
    assert running.generated == plain[0] and joined.generated == plain[1]


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "eagle", "medusa"])
def test_slots_no_row_has_held_yet_stay_in_bounds(models, name, monkeypatch):  # noqa: F811
    """A server steps the smallest bucket holding its rows, so a step can cover slots no row has held yet
    (length 0). They flow through every phase masked; a negative position there indexes before the rotary
    table, which on CUDA is an illegal address (EAGLE at 64 rows in the server, before the clamp)."""
    import specdec.models.eagle as eagle_model
    import specdec.models.llama as llama

    target, _, draft = models
    stepper = new_stepper(target, make_drafter(name, target, draft), 4, 128, list(eos_ids(target)), graphs=False)
    stepper.prefill([0], [Request(PROMPTS[0], 20)])
    lowest: list[int] = []

    def spy(run):
        def run_layers(layers, x, positions, *args, **kwargs):
            lowest.append(int(positions.min()))
            return run(layers, x, positions, *args, **kwargs)
        return run_layers

    monkeypatch.setattr(llama, "run_layers", spy(llama.run_layers))
    monkeypatch.setattr(eagle_model, "run_layers", spy(eagle_model.run_layers))
    stepper.batch.gamma.fill_(3)
    stepper.launch(3)
    assert stepper.read().rows[0].row.slot == 0
    assert lowest and min(lowest) >= 0, f"{name}: position {min(lowest)}"


@pytest.mark.parametrize("name", ["draft_model", "eagle", "medusa"])
def test_steps_keep_no_autograd_history_with_grad_mode_on(models, name):  # noqa: F811
    """A server's decode thread has grad mode on (it is per thread). Run there without inference mode, EAGLE's
    root feature carried each step's autograd graph into the next: 2 MB more per 8 requests on a tiny model,
    3.4 MiB per request on the default model (H100 load test)."""
    target, _, draft = models
    stepper = new_stepper(target, make_drafter(name, target, draft), 2, 128, list(eos_ids(target)), graphs=False)
    with torch.enable_grad():
        stepper.prefill([0, 1], [Request(PROMPTS[0], 20), Request(PROMPTS[2], 20)])
        stepper.batch.gamma.fill_(3)
        for _ in range(3):
            stepper.launch(3)
            stepper.read()
    state = stepper.batch.draft
    tensors = [getattr(state, f.name) for f in dataclasses.fields(state)] if dataclasses.is_dataclass(state) else [state]
    tensors = [t for x in tensors for t in ([x.k, x.v] if isinstance(x, KVCache) else [x]) if isinstance(t, torch.Tensor)]
    assert tensors and not any(t.requires_grad or t.grad_fn is not None for t in tensors), name

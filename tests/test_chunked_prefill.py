"""Chunked prefill (Stepper.start_prefill / prefill_chunk; the server's --prefill-chunk): prompts read a
chunk at a time, between the steps of rows already decoding, give exactly the tokens of reading them
whole, for every drafter, greedy (near-ties included) and seeded sampling; and the server runs a decode
step between every two chunks of a long prompt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from specdec import SamplingParams
from specdec.batch import Request, Row, eos_ids
from specdec.drafters import build_drafter
from specdec.server.policy import SpecPolicy
from specdec.graphs import PrefillGraphs
from specdec.server.scheduler import BatchOps, Codec, Event, GenerationRequest, Scheduler, SchedulerConfig
from specdec.step import Stepper, new_stepper
from test_engine import MAX_NEW, PROMPTS, models, plain  # noqa: F401  (fixtures)
from test_exact_decoding import flat, make  # noqa: F401  (fixture)
from test_server import model, reference_text  # noqa: F401  (fixture)
from test_step import DRAFTERS, make_drafter

CHUNKS = [1, 3, 7, None]  # None: every prompt in one forward
GAMMA = 3
SHORT, LONG = "the cat sat on", "the cat sat on the mat , " * 6  # the server test's prompts (4 and 42 tokens)


@dataclass
class Arrival:
    """A request that reaches the batch at a turn of the loop, for a slot."""

    turn: int
    slot: int
    request: Request


def decode_as_served(stepper: Stepper, arrivals: list[Arrival], chunk: int | None) -> dict[int, Row]:
    """Decode as the server does: each turn starts a prefill group of the requests that have arrived (at
    most `chunk` of them) when none is being read, reads at most one chunk, then steps the rows that
    are ready. The rows by slot."""
    batch = stepper.batch
    batch.gamma.fill_(GAMMA)
    pending, arrived, rows = deque(arrivals), [], {}
    prefill, turn = None, 0
    while pending or arrived or prefill is not None or batch.busy:
        while pending and pending[0].turn <= turn:
            arrived.append(pending.popleft())
        if prefill is None and arrived:
            group, arrived = arrived[: chunk or len(arrived)], arrived[chunk or len(arrived) :]
            prefill = stepper.start_prefill([a.slot for a in group], [a.request for a in group], chunk)
            rows.update((a.slot, batch.rows[a.slot]) for a in group)
        if prefill is not None:
            stepper.prefill_chunk(prefill)
            prefill = None if prefill.finished else prefill
        if batch.active.any():
            stepper.launch(GAMMA)
            stepper.read()
        turn += 1
    return rows


def arrivals_of(prompts: list[list[int]], max_new: int, sampling: list[SamplingParams] | None = None) -> list[Arrival]:
    """Prompts 0 and 1 (7 and 2 tokens) join together; prompt 2 (14 tokens) two turns later, while they decode."""
    sampling = sampling or [SamplingParams()] * 3
    return [Arrival(0, 0, Request(prompts[0], max_new, sampling[0])), Arrival(0, 1, Request(prompts[1], max_new, sampling[1])),
            Arrival(2, 2, Request(prompts[2], max_new, sampling[2]))]


@pytest.mark.parametrize("chunk", CHUNKS[:-1])
@pytest.mark.parametrize("name", [*DRAFTERS, "layer_skip"])
def test_chunked_prefill_decodes_as_plain_greedy(models, plain, name, chunk):  # noqa: F811
    """Tokens equal to plain decoding; and, since greedy output cannot show a drafter told wrong features
    (it only drafts worse), each row drafts and accepts what it does with whole prompts read at once
    (lookahead aside: its windows start from random draws shared by the rows, so depend on the order of joins)."""
    target, _, draft = models
    outcome = {}
    for c in (chunk, None):
        stepper = new_stepper(target, make_drafter(name, target, draft), 3, 128, list(eos_ids(target)))
        rows = decode_as_served(stepper, arrivals_of(PROMPTS, MAX_NEW), c)
        assert [rows[slot].generated for slot in range(3)] == plain, (name, c)
        outcome[c] = [(rows[slot].stats.drafted, rows[slot].stats.accepted) for slot in range(3)]
    if name != "none":
        assert sum(drafted for drafted, _ in outcome[None]) > 0
    if name != "lookahead":
        assert outcome[chunk] == outcome[None]


@pytest.mark.parametrize("name", ["draft_model", "eagle"])
def test_a_prompt_shapes_join_is_captured_at_its_first_use_in_an_idle_batch(models, plain, name):  # noqa: F811
    """CUDA, native target: an engine's call (every row joining an idle batch) captures its prompt shape's
    join beside the prefill (Stepper.capture_prefill), which a server captures at start; the join's replay
    decodes as plain greedy."""
    target, _, draft = models
    stepper = new_stepper(target, make_drafter(name, target, draft), 3, 128, list(eos_ids(target)))
    if stepper.prefill_graphs is None:
        pytest.skip("whole prompts are read by captured graphs only on CUDA, for a native target on the exact kernels")
    arrivals = [Arrival(0, slot, Request(PROMPTS[slot], MAX_NEW, SamplingParams())) for slot in range(3)]
    rows = decode_as_served(stepper, arrivals, None)
    assert stepper.join_graphs
    assert [rows[slot].generated for slot in range(3)] == plain


@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle", "medusa"])
def test_chunked_prefill_keeps_near_ties(flat, name, chunk):  # noqa: F811
    """Unsharpened logits: a chunk's keys, values or hidden states a hair off reading the whole prompt
    would change tokens here."""
    target, draft, expected = flat
    drafter = make(name, target, draft)
    drafter = build_drafter(drafter, target) if isinstance(drafter, str) else drafter
    stepper = new_stepper(target, drafter, 3, 128, list(eos_ids(target)))
    rows = decode_as_served(stepper, arrivals_of(PROMPTS, len(expected[0])), chunk)
    assert [rows[slot].generated for slot in range(3)] == expected, (name, chunk)


@pytest.mark.parametrize("name", ["ngram", "eagle"])
def test_seeded_sampling_is_the_same_whatever_the_chunk(models, plain, name):  # noqa: F811
    target, _, draft = models
    sampling = [SamplingParams(temperature=1.0, seed=7), SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=3)]
    outputs = {}
    for chunk in CHUNKS:
        stepper = new_stepper(target, make_drafter(name, target, draft), 3, 128, list(eos_ids(target)))
        rows = decode_as_served(stepper, arrivals_of(PROMPTS, MAX_NEW, sampling), chunk)
        outputs[chunk] = [rows[slot].generated for slot in range(3)]
    assert all(out == outputs[None] for out in outputs.values()), outputs
    assert outputs[None][1] == plain[1]  # the greedy row beside them
    assert outputs[None][0] != plain[0] and outputs[None][2] != plain[2]  # the others really sampled


def test_a_group_of_more_rows_than_a_chunk_reads_is_refused(models):  # noqa: F811
    target, _, _ = models
    stepper = new_stepper(target, build_drafter("none", target), 3, 128, list(eos_ids(target)))
    with pytest.raises(ValueError, match="cannot read a token of each of 3 rows"):
        stepper.start_prefill([0, 1, 2], [Request(p, 4) for p in PROMPTS], chunk=2)


def test_the_server_steps_between_the_chunks_of_a_long_prompt(model, monkeypatch):  # noqa: F811
    """A short request decodes; a long one arrives: every chunk of its prompt is followed by a step in
    which the short one emits a token, and its row takes part in no step before its prompt is read."""
    chunk = 4
    scheduler = Scheduler(model, build_drafter("ngram", model), Codec(model.tokenizer), SpecPolicy("off", gamma=3),
                          SchedulerConfig(max_batch=4, context=256, prefill_chunk=chunk))
    log: list[tuple[str, int]] = []  # ("chunk", group rows still reading) / ("token", slot) in order
    read = scheduler.full.prefill_chunk

    def logged_chunk(prefill):
        log.append(("chunk", prefill.left))
        return read(prefill)

    monkeypatch.setattr(scheduler.full, "prefill_chunk", logged_chunk)
    step = scheduler.step

    def checked_step():
        assert not scheduler.batch.active[list(scheduler.joining)].any()  # rows being read take no part
        step()

    monkeypatch.setattr(scheduler, "step", checked_step)
    short, long = (model.tokenizer(text)["input_ids"] for text in (SHORT, LONG))
    events: dict[int, list[Event]] = {0: [], 1: []}

    def request(i: int, ids: list[int], max_tokens: int) -> GenerationRequest:
        def emit(event: Event) -> None:
            events[i].append(event)
            log.extend(("token", i) for _ in event.token_ids)
        return GenerationRequest(ids, max_tokens, SamplingParams(), (), emit)

    scheduler.submit(request(0, short, 60))
    while not scheduler.running:
        scheduler.turn()
    log.clear()
    scheduler.submit(request(1, long, 8))
    while scheduler.num_running:
        scheduler.turn()

    chunks = [i for i, entry in enumerate(log) if entry[0] == "chunk"]
    assert len(chunks) == -(-len(long) // chunk)  # one row: chunk tokens per forward
    for a, b in zip(chunks, chunks[1:]):
        assert ("token", 0) in log[a:b]  # the short request decoded between the two chunks
    assert ("token", 1) not in log[: chunks[-1]]
    texts = ["".join(e.text for e in events[i]) for i in (0, 1)]
    assert texts == [reference_text(model, SHORT, 60), reference_text(model, LONG, 8)]
    assert scheduler.metrics.prompt_tokens == len(short) + len(long)  # counted once each, not per chunk



def test_a_burst_is_read_in_groups_that_one_prefill_graph_holds(models):  # noqa: F811
    """Where prefills are graphed, a group is the most waiting prompts (in queue order) that one captured
    forward reads whole: a burst is read in a few replays, not in eager chunks; else one group of all."""
    target, _, _ = models
    ops = BatchOps(target, build_drafter("none", target), 8, 128, None)
    assert ops.group_size([20] * 6, chunk=512) == 6  # no prefill graphs (a CPU): one group
    graphs = PrefillGraphs.__new__(PrefillGraphs)  # only its shape rule: rows and positions padded to powers of two
    graphs.max_tokens, graphs.max_span = 64, None
    ops.full.prefill_graphs = graphs
    assert ops.group_size([20, 20, 20, 20], chunk=512) == 2  # 2 rows x 32 positions fill the 64 tokens
    assert ops.group_size([10, 30, 12], chunk=512) == 2  # the second prompt widens the shape to 2 x 32
    assert ops.group_size([100, 5], chunk=512) == 1  # too long for any graph: read alone, in chunks
    assert ops.group_size([16, 16, 16], chunk=40) == 2  # and within the chunk: 3 x 16 > 40
    assert ops.group_size([8], chunk=512) == 1


def test_serve_refuses_a_prefill_chunk_below_one(capsys):
    from specdec.cli import main

    assert main(["serve", "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk must be >= 1, got 0" in capsys.readouterr().err


def two_rows_running(model, later: list[tuple[str, int]], max_batch: int = 4):  # noqa: F811
    """CUDA only (skips elsewhere): a server's scheduler decoding SHORT and LONG greedily; the maker of the
    requests for those and for the `later` (text, max_tokens), by index; and the texts each request got."""
    scheduler = Scheduler(model, build_drafter("ngram", model), Codec(model.tokenizer), SpecPolicy("on", gamma=3),
                          SchedulerConfig(max_batch=max_batch, context=256))
    if scheduler.full.prefill_stream is None:
        pytest.skip("prompts have a stream of their own only on CUDA")
    prompts = [(SHORT, 40), (LONG, 40), *later]
    texts = {i: [] for i in range(len(prompts))}

    def request(i: int) -> GenerationRequest:
        text, max_tokens = prompts[i]
        return GenerationRequest(model.tokenizer(text)["input_ids"], max_tokens, SamplingParams(), (),
                                 lambda event: texts[i].append(event.text))

    for i in (0, 1):
        scheduler.submit(request(i))
    while len(scheduler.running) < 2:
        scheduler.turn()
    return scheduler, request, prompts, texts


def read_once(scheduler: Scheduler, model, text: str) -> None:  # noqa: F811
    """Serve `text` for one token beside the running rows, so that its prompt's shape has been read once."""
    events: list[Event] = []
    scheduler.submit(GenerationRequest(model.tokenizer(text)["input_ids"], 1, SamplingParams(), (), events.append))
    while not any(event.final for event in events):
        scheduler.turn()


def test_a_request_arriving_during_a_step_is_read_beside_it(model, monkeypatch):  # noqa: F811
    """CUDA: with two rows running, a request arriving while the decode thread waits for a step has its
    prompt read then (Scheduler.admit_during), not after the step; every text is still plain greedy's."""
    scheduler, request, prompts, texts = two_rows_running(model, [("the mat , the cat", 12)])
    import torch

    launch, third = scheduler.ops.launch, []

    def late_launch(n, gamma, quiet):  # the step queues behind ~50 ms of device time; a request arrives meanwhile
        torch.cuda._sleep(100_000_000)
        launch(n, gamma, quiet)
        if not third:
            third.append(request(2))
            scheduler.submit(third[0])

    monkeypatch.setattr(scheduler.ops, "launch", late_launch)
    while scheduler.num_running or scheduler.waiting:
        scheduler.turn()
    scheduler.stop()
    assert scheduler.metrics.prefills_during_step >= 1
    assert ["".join(texts[i]) for i in texts] == [reference_text(model, text, n) for text, n in prompts]


def test_a_second_arrival_during_the_same_step_is_read_beside_it_too(model, monkeypatch):  # noqa: F811
    """CUDA: a request arriving while another arrival's prompt is read during a step is read beside that same
    step (Scheduler.admit_during reads one group after another until the step has run), not a turn later;
    every text is still plain greedy's."""
    scheduler, request, prompts, texts = two_rows_running(
        model, [("the mat , the cat", 12), ("the cat , the mat", 12)], max_batch=8)
    import torch

    for text, _ in prompts[2:]:  # each later prompt's shape read once first: a cold read outlasts a step
        read_once(scheduler, model, text)
    launch, read_prompts, turns, launches, reads = scheduler.ops.launch, scheduler.read_prompts, [0], [0], []

    def late_launch(n, gamma, quiet):  # each step queues behind ~50 ms of device time, the 2nd to 4th ~2 s
        torch.cuda._sleep(4_000_000_000 if 2 <= launches[0] + 1 <= 4 else 100_000_000)
        launch(n, gamma, quiet)
        launches[0] += 1
        if launches[0] == 3:  # the step read next (this one, or the one before) is behind a long sleep too
            scheduler.submit(request(2))

    def counted_read(during_step: bool = False) -> bool:
        read = read_prompts(during_step)
        if read:
            reads.append((turns[0], during_step))
            if len(reads) == 1:  # the fourth request arrives as the third's prompt has been read
                scheduler.submit(request(3))
        return read

    monkeypatch.setattr(scheduler.ops, "launch", late_launch)
    monkeypatch.setattr(scheduler, "read_prompts", counted_read)
    while scheduler.num_running or scheduler.waiting:
        scheduler.turn()
        turns[0] += 1
    scheduler.stop()
    # both beside one step, in one turn (a cold first read, prefill shapes captured or compiled on first use,
    # outlasted the step on an H200, 50 ms or 2 s, and left the second arrival for a later turn: hence read_once)
    assert reads[:2] == [(reads[0][0], True)] * 2, reads
    assert ["".join(texts[i]) for i in texts] == [reference_text(model, text, n) for text, n in prompts]

"""Continuous batching: one decode thread owns the running batch and steps it; requests join and
leave between steps.

The batch is a RowBatch of max_batch slots (specdec/batch.py) and each step is the shared speculative
step (specdec/step.py), the same one `SpecEngine` runs: every drafter works here, stateful ones too
(they keep per-slot state and are told when a row joins). A finished, cancelled or failed row frees its
slot. A step runs over the first n slots, n the smallest bucket (1, 2, 4, ...) holding every running
row, so a nearly idle server does not pay for max_batch rows; on CUDA each bucket and step shape is a
captured graph. The speculation policy (policy.py) picks one gamma for the batch; the step caps it
per row by what the row may still emit, verifies every row in one forward with ragged acceptance and
each request's own sampling parameters and seed, and stops rows at EOS, max_tokens or a stop string
(one implementation, batch.py).

Chunked prefill: new requests do not stall running ones. Waiting requests take the lowest free slots
and form a prefill group (at most `prefill_chunk` of them, so that every chunk reads a token of each;
where prefills are graphed, at most what one replay reads whole, BatchOps.group_size);
the target reads their prompts `prefill_chunk` tokens at a time (rows x positions, the rows batched in
one forward per chunk, longest prompts first). Each turn of the decode loop reads at most one chunk,
then runs one step over the rows that are ready: a step never waits for more than one chunk (plus,
when a row's prompt ends, the drafter reading that prompt: an EAGLE head or a draft model over it).
On CUDA, with two or more rows running, a turn's chunk may be read while the decode thread waits for
the step in flight, as soon as a request arrives, instead of after that step (Scheduler.admit_during).
A group's rows hold their slots but stay inactive, so steps leave them alone, until their own prompt
is read; then each samples its first token and joins the running rows at the next step, while the
group's longer prompts are still being read. Requests arriving meanwhile wait for the next group. A
request cancelled while its prompt is read leaves once the read ends.

Seeds: a sampled request draws its random numbers from a counter-based generator keyed by its own
seed, so the same seed and the same speculation schedule (gamma per step) give the same text whatever
else is in the batch; a different schedule consumes other numbers: the text then differs while its
distribution stays the target's (lossless either way).

Failure isolation: when a batched step raises, the step is redone row by row (each alone active: a
step leaves inactive rows untouched) and only the rows that still fail are failed.

Hand-over: the events of a prefill chunk and of a step are handed over together once it is done, each
request's through its `emit`, then each distinct `wake` once (the app's wakes its event loop once for
all its requests' events of the step, not once per request and token).
"""

from __future__ import annotations

import copy
import gc
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from tqdm import tqdm

from specdec.adaptive import Acceptance
from specdec.batch import Request, Row, eos_ids
from specdec.config import SamplingParams
from specdec.drafters import Drafter
from specdec.drafters.base import forget_requests, learns_across_requests
from specdec.errors import first_line
from specdec.server.metrics import ServerMetrics
from specdec.server.policy import SpecPolicy
from specdec.step import Prefill, Stepper, StepReport, new_stepper
from specdec.transfer import to_device

log = logging.getLogger("specdec.server")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class QueueFull(Exception):
    """The waiting queue is at --max-queue."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class DeviceLost(ShuttingDown):
    """The device hit an error that poisons every later call on it (on CUDA a sticky error: an illegal
    address, a device-side assert): the server takes no more requests, and says why."""


def device_problem(device: torch.device) -> str | None:
    """Why `device` can run nothing more, or None. Only CUDA has sticky errors: once one happened, every
    later call raises it again (a synchronisation shows it); a step that raised on the CPU is retried."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as e:  # the context is poisoned
        return first_line(e)
    return None


@dataclass
class Event:
    """What the decode thread hands a request: new text and tokens; the last event has a finish
    reason ("stop" | "length") and usage, or an error."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None  # OpenAI usage plus `speculation` (see usage_of)
    error: str | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    emit: Callable[[Event], None]  # called from the decode thread; must not block
    wake: Callable[[], None] | None = None  # called once after a hand-over of events to requests sharing it
    speculate: bool = True  # False: this row never drafts, whatever the policy picks for the batch
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    done: bool = False


@dataclass
class Detokenized:
    """A row's output text, decoded a few tokens at a time (vLLM's incremental scheme) instead of whole at
    every step, which costs O(length) per step (with the default tokenizer 45 us at 128 tokens, 260 us at
    512, per row). Tokens prefix..read were decoded last, as `prefix_text`; decoding prefix..end and
    cutting `prefix_text` off gives the new text, so what a tokenizer does at the start of a decode
    (SentencePiece drops the first token's leading space) falls on both alike. A window that does not
    extend `prefix_text` (a tokenizer that rewrites across tokens: `clean_up_tokenization_spaces` turns
    "a ." into "a.") is decoded whole once; a window that ends in an unfinished UTF-8 character waits for
    the next tokens. A finished row's text is one whole decode (Scheduler.emit)."""

    text: str = ""
    prefix: int = 0
    read: int = 0
    prefix_text: str = ""


class Codec:
    """The tokenizer, one copy per thread that uses it: the event loop encodes prompts with `encoder`, the
    decode thread decodes outputs with `decoder`. A Hugging Face tokenizer may not be used by two threads
    at once (encoding sets its truncation state: "Already borrowed"), and with one lock between the two
    threads the event loop, and every stream it serves, waited for the decode thread's detokenizing.
    Each copy keeps a lock of its own, uncontended unless a caller uses it from another thread. The decode
    thread decodes with the Rust tokenizer itself where that gives the same text (`direct_decoder`)."""

    def __init__(self, tokenizer) -> None:
        self.encoder, self.decoder = tokenizer, copy.deepcopy(tokenizer)
        self.encoding, self.decoding = threading.Lock(), threading.Lock()
        direct = direct_decoder(self.decoder)
        self.decode_ids = direct or (lambda ids: self.decoder.decode(ids, skip_special_tokens=True))

    def encode_text(self, text: str) -> list[int]:
        with self.encoding:
            return self.encoder(text)["input_ids"]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template with a generation prompt; without a template, the contents one per line."""
        with self.encoding:
            if getattr(self.encoder, "chat_template", None):
                text = self.encoder.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                return self.encoder(text, add_special_tokens=False)["input_ids"]
            return self.encoder("\n".join(m["content"] for m in messages))["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self.decoding:
            return self.decode_ids(ids)

    def decode_more(self, state: Detokenized, ids: list[int]) -> str:
        """The text of `ids`, a row's output so far (grown since the last call with `state`), decoding only
        its last few tokens (see Detokenized); it lags behind while the last character is unfinished."""
        with self.decoding:
            window = self.decode_ids(ids[state.prefix :])
            if window.endswith("\ufffd"):
                return state.text
            if window.startswith(state.prefix_text):
                state.text += window[len(state.prefix_text) :]
            else:  # the tokenizer rewrote text across the tokens' border: decode it all once
                state.text = self.decode_ids(ids)
            state.prefix, state.read = state.read, len(ids)
            state.prefix_text = self.decode_ids(ids[state.prefix : state.read])
            return state.text

    @property
    def eos_token_id(self) -> int | None:
        return self.encoder.eos_token_id


CLEAN_UP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're j ' k"  # what a clean-up of spaces would change


def direct_decoder(tokenizer) -> Callable[[list[int]], str] | None:
    """The decode of a Hugging Face fast tokenizer's Rust tokenizer (skipping special tokens), where the
    Python decode adds nothing to it: where it would clean up spaces (WordPiece's " ." -> "."; a probe's
    decodes differ) or there is no Rust tokenizer, None. The Python layer costs about 20 us a call
    (argument conversion), and a server decodes twice per row and step (Detokenized)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    ids = tokenizer(CLEAN_UP_PROBE, add_special_tokens=False)["input_ids"]
    if backend.decode(ids, skip_special_tokens=True) != tokenizer.decode(ids, skip_special_tokens=True):
        return None
    return partial(backend.decode, skip_special_tokens=True)


@dataclass
class Serving:
    """A running request: its row in the batch and what has been streamed of it."""

    request: GenerationRequest
    row: Row
    sent: int = 0  # characters of text already emitted
    last_emit: float = 0.0
    detokenized: Detokenized = field(default_factory=Detokenized)


def usage_of(serving: Serving) -> dict:
    """The request's OpenAI usage, with its speculation counters: `steps` counts the prefill, the mean
    accepted length does not (specdec/metrics.py)."""
    row = serving.row
    s, prompt, completion = row.stats, len(row.request.prompt), len(row.generated)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "speculation": {"steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
                        "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length},
    }


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 32
    max_queue: int = 256
    context: int = 2048  # prompt + max_tokens per request
    prefill_chunk: int = 512  # the most prompt tokens (rows x positions) one prefill forward reads between steps
    freeze_heap: bool = False  # the process only serves (`specdec serve`): freeze_heap once the first graphs are in

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


def freeze_heap() -> None:
    """Move every object alive now (the model, the drafter, the captured graphs, the libraries' modules)
    out of the collector's reach (gc.freeze, as vLLM does after its start-up): a full collection then
    walks only what serving allocated since, and it stops every thread, the decode loop included, while
    it walks. specdec_gc_seconds_total shows what collections still cost. Only in a process that only
    serves: a frozen object that becomes garbage in a cycle is never freed (tests start many servers)."""
    gc.collect()
    gc.freeze()


def bucket_for(slots: int, max_batch: int) -> int:
    """The step size covering `slots` slots: the next power of two, at most max_batch."""
    return min(next(b for b in BUCKETS if b >= slots) if slots <= BUCKETS[-1] else slots, max_batch)


class BatchOps:
    """Every change the scheduler makes to the batch and its device state, in one place: what a
    tensor-parallel follower replays of rank 0's decisions (mirror.py). The steppers are views of one
    batch: one per bucket of slots."""

    def __init__(self, target, drafter: Drafter, max_batch: int, max_len: int, decode: Callable[[list[int]], str]) -> None:
        self.full = new_stepper(target, drafter, max_batch, max_len, list(eos_ids(target)), decode)
        self.batch = self.full.batch
        self.steppers: dict[int, Stepper] = {max_batch: self.full}
        self.prefill: Prefill | None = None  # the group whose prompts are being read

    def stepper(self, n: int) -> Stepper:
        """The stepper over the first n slots (n a bucket)."""
        if n not in self.steppers:
            full = self.full
            self.steppers[n] = Stepper(full.target, full.drafter, full.batch.head(n), full.cache.head(n), full.graphs,
                                       full.decode)
        return self.steppers[n]

    def capture_shapes(self, gammas: list[int]) -> int:
        """Capture every bucket's steps at these gammas now (Stepper.capture_shapes), and the whole-prompt
        prefills of up to a full batch of rows (Stepper.capture_prefills), under a progress bar (minutes
        for a server's first start on a GPU, most of it compiling); how many were new."""
        steppers = [self.stepper(n) for n in self.buckets()]
        total = sum(len(s.missing_shapes(gammas)) for s in steppers) + len(self.full.missing_prefills(self.batch.capacity))
        shard = getattr(self.full.target, "shard", None)
        with tqdm(total=total, desc="capturing CUDA graphs", unit="graph",
                  disable=True if not total or (shard is not None and shard.rank) else None) as bar:
            steps = sum(s.capture_shapes(gammas, bar.update) for s in steppers)
            return steps + self.full.capture_prefills(self.batch.capacity, bar.update)

    def buckets(self) -> list[int]:
        return sorted({b for b in BUCKETS if b < self.batch.capacity} | {self.batch.capacity})

    def group_size(self, lengths: list[int], chunk: int) -> int:
        """How many of the waiting prompts of these lengths (in queue order) to read as one group: where
        prefills are graphed, the most that one replay reads whole (Stepper.prefill_graph), at least one;
        else all of them."""
        if self.full.prefill_graphs is None:
            return len(lengths)
        longest = 0
        for k, n in enumerate(lengths):
            longest = max(longest, n)
            if self.full.prefill_graph(k + 1, longest, chunk) is None:
                return max(k, 1)
        return len(lengths)

    def start_prefill(self, slots: list[int], requests: list[Request], chunk: int) -> Prefill:
        self.prefill = self.full.start_prefill(slots, requests, chunk)
        return self.prefill

    def prefill_chunk(self) -> list[Row]:
        rows = self.full.prefill_chunk(self.prefill)
        if self.prefill.finished:
            self.prefill = None
        return rows

    def end_prefill(self) -> None:
        self.prefill = None

    def release(self, slot: int) -> None:
        if slot in self.batch.rows:
            self.batch.release(slot)

    def launch(self, n: int, gamma: int, quiet: list[int]) -> None:
        """Launch a step of the first n slots at `gamma`; the `quiet` slots draft nothing."""
        self.batch.gamma.fill_(gamma)
        if quiet:
            self.batch.gamma.index_fill_(0, to_device(quiet, self.batch.device), 0)
        self.stepper(n).launch(gamma)

    def read(self, n: int) -> StepReport:
        return self.stepper(n).read()

    def outcome_event(self, n: int) -> torch.cuda.Event | None:
        """The event behind the oldest launched step's outcome on the first n slots (None on the CPU, where
        a launch runs the whole step)."""
        return self.stepper(n).in_flight[0].outcome.done

    def forget(self, n: int) -> None:
        """Drop the steps launched on the first n slots unread."""
        self.stepper(n).in_flight.clear()

    def forget_requests(self) -> None:
        """The drafter forgets what it learned from earlier requests (Scheduler.forget_requests)."""
        forget_requests(self.full.drafter)

    def step_alone(self, n: int, slot: int, gamma: int) -> StepReport:
        """The step with only `slot` active (eagerly), the other rows' activity restored after."""
        active = self.batch.active.clone()
        alone = torch.zeros_like(active)
        alone[slot] = active[slot]
        self.batch.active.copy_(alone)
        stepper = self.stepper(n)
        try:
            stepper.launch(gamma, eager=True)
            return stepper.read()
        except Exception:
            stepper.in_flight.clear()
            raise
        finally:
            active[slot] = self.batch.active[slot]
            self.batch.active.copy_(active)

    def reset(self) -> None:
        self.prefill = None
        self.full.reset()

    def close(self) -> None:
        """The scheduler has stopped (mirror.MirroredOps releases its followers here)."""


class Scheduler:
    def __init__(self, target, drafter: Drafter, codec: Codec, policy: SpecPolicy, config: SchedulerConfig,
                 metrics: ServerMetrics | None = None, ops: Callable[..., BatchOps] = BatchOps) -> None:
        """ops: what builds the BatchOps (mirror.MirroredOps under tensor parallelism)."""
        self.target, self.drafter, self.codec, self.policy, self.config = target, drafter, codec, policy, config
        self.policies = {(policy.name, policy.threshold): policy}  # every policy switched to (switch_policy)
        self.metrics = metrics or ServerMetrics()
        # the widest draft block beyond the context fits every row
        width = drafter.shape(policy.gamma).width
        self.ops = ops(target, drafter, config.max_batch, config.context + width + 2, codec.decode)
        self.full, self.batch = self.ops.full, self.ops.batch
        self.running: dict[int, Serving] = {}  # slot -> request
        self.acceptance = Acceptance.empty(config.max_batch, policy.gamma)  # each slot's request's, for the policy
        self.joining: dict[int, GenerationRequest] = {}  # slot -> request of the group, until its prompt is read
        self.waiting: deque[GenerationRequest] = deque()
        self.outgoing: list[Outgoing] = []  # events of the current chunk or step, until hand_over
        self.launched: deque[Launch] = deque()  # steps launched and not read yet, oldest first
        self.waited = 0.0  # seconds the decode thread has waited for steps' outcomes
        self.captured_for: tuple[str, int] | None = None  # the policy whose step shapes are captured
        self.ready = threading.Event()  # the decode thread has captured its first step shapes
        self.cond = threading.Condition()
        self.paused = self.idle = self.draining = self.stopping = False
        self.lost: str | None = None  # why the device can run nothing more (device_lost)
        self.thread: threading.Thread | None = None
        self.watch: StepWatch | None = None  # waits for steps' outcomes beside the decode thread (admit_during)
        self.read_during_step = False  # this turn's prefill chunk was read while the last step ran
        self.forgetting = False  # forget_requests was asked: the decode thread does it before its next join

    # ---- called from other threads ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests holding a slot: decoding, or their prompt being read."""
        return len(self.running) + len(self.joining)
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def health(self) -> dict:
        """The server's state for /health: status "ok", "draining" or "error" (with the reason), the drafter,
        the policy and its gamma, and how many requests run and wait."""
        status = "error" if self.lost else "draining" if self.draining else "ok"
        return {"status": status, "drafter": self.drafter.name, "gamma": self.policy.gamma, "policy": self.policy.name,
                "running": self.num_running, "waiting": self.num_waiting, **({"error": self.lost} if self.lost else {})}

    def metrics_text(self, model_name: str) -> str:
        """/metrics: Prometheus text."""
        return self.metrics.render(self.num_running, self.num_waiting, self.policy.name, model_name)

    def switch_policy(self, name: str, threshold: int | None = None) -> dict:
        """Switch the speculation policy (raises UserError for a bad one); its description. A policy switched
        back to resumes what it learned (`cost`: step times, acceptance, exploration waits), as a server
        running it all along would have; a fresh one would start cold at every switch."""
        old = self.policy
        key = (name, old.threshold if threshold is None else threshold)
        if key not in self.policies:
            self.policies[key] = SpecPolicy(name, old.gamma, key[1], old.costs, widths=old.widths)
        self.policy = self.policies[key]
        return self.policy.describe()

    def forget_requests(self) -> dict:
        """Have the drafter forget what it learned from earlier requests (suffix's global index), before
        the next request joins: what `bench-serve` asks before each timed level, so a level does not draft
        from the answers of the levels before it. Done by the decode thread, which alone touches the
        drafter."""
        with self.cond:
            self.forgetting = learns_across_requests(self.drafter)
        return {"drafter": self.drafter.name, "forgets": self.forgetting}

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.loop, name="specdec-decode", daemon=True)
            self.thread.start()
            self.ready.wait()  # the step graphs are captured (capture_steps) before the first request

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (validated by the caller: a prompt, and prompt + max_tokens within the context)."""
        if not request.prompt_ids or len(request.prompt_ids) + request.max_tokens > self.config.context:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.max_tokens} "
                             f"must fit the context of {self.config.context}")
        with self.cond:
            if self.lost is not None:
                self.metrics.count_request("rejected")
                raise DeviceLost(self.lost)
            if self.draining or self.stopping:
                self.metrics.count_request("rejected")
                raise ShuttingDown("the server is shutting down")
            if len(self.waiting) >= self.config.max_queue:
                self.metrics.count_request("rejected")
                raise QueueFull(f"the queue is full ({self.config.max_queue} waiting requests); retry later")
            self.waiting.append(request)
            self.cond.notify_all()

    def cancel(self, request: GenerationRequest) -> None:
        """Drop a request (its client went away); its rows leave the batch before the next step."""
        with self.cond:
            if request.done or request.cancelled:
                return
            request.cancelled = True
            self.metrics.count_request("cancelled")
            self.cond.notify_all()

    def pause(self) -> None:
        """Hold the decode loop between steps (returns once it is held)."""
        with self.cond:
            self.paused = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.idle or self.thread is None)

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def stop(self, drain_s: float = 0.0) -> None:
        """Take no new requests; let running and waiting ones finish for up to drain_s seconds, then
        fail the rest ("the server is shutting down") and end the decode thread."""
        with self.cond:
            self.draining = True
            self.cond.wait_for(lambda: not self.running and not self.joining and not self.waiting, timeout=drain_s)
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
        if self.watch is not None:
            self.watch.stop()
        for serving in self.running.values():
            self.finish_with_error(serving.request, "the server is shutting down")
        for request in [*self.joining.values(), *self.waiting]:
            self.finish_with_error(request, "the server is shutting down")
        self.hand_over()
        self.running.clear()
        self.joining.clear()
        self.waiting.clear()
        if self.lost is None:  # a lost device raises at every call
            self.ops.reset()
        self.ops.close()  # host-side only (tensor parallelism: releases the followers)

    # ---- the decode thread --------------------------------------------------------------------

    def loop(self) -> None:
        try:
            self.capture_steps()
            if self.config.freeze_heap:
                freeze_heap()
        finally:
            self.ready.set()
        while True:
            self.metrics.start_idle()
            working = self.wait_for_work()
            self.metrics.end_idle()
            if not working:
                break
            self.capture_steps()
            self.turn()

    def capture_steps(self) -> None:
        """With CUDA graphs: capture each bucket's steps at every gamma the policy may choose, and the
        whole-prompt prefills, at start and after a policy switch, before they are needed: a capture in the
        middle of serving stalls every running row (eager warm-up passes, then the captures), and `cost`
        moves between gammas."""
        wanted = (self.policy.name, self.policy.gamma)
        if not self.full.graphs or wanted == self.captured_for:
            return
        self.drain()
        self.captured_for = wanted
        t = time.perf_counter()
        try:
            new = self.ops.capture_shapes(self.policy.gammas())
        except Exception:
            if not self.device_lost():
                log.exception("capturing the step graphs failed; each is captured when first needed instead")
            return
        if new:
            log.info(f"captured {new} step and prefill graphs for policy {self.policy.name} in {time.perf_counter() - t:.1f} s")

    def turn(self) -> None:
        """One turn of the decode loop: at most one prefill chunk, then one step over the rows that are ready.
        With CUDA graphs, a step is launched before the last one is read (`step`). A prefill does not wait
        for the step in flight: on CUDA its prompts are read beside that step on a stream of their own
        (step.prefill_stream) and its first tokens go out before the step ends; the join (the rows' state)
        is queued behind the step, whose outcome goes only to the rows it ran (`Launched.rows`), though a
        slot freed meanwhile may hold a new row by then."""
        start = stepping = time.perf_counter()
        waited = self.waited
        try:
            if self.forgetting:
                self.forgetting = False
                self.ops.forget_requests()
            self.drop_cancelled()
            read_during_step, self.read_during_step = self.read_during_step, False
            if not read_during_step:  # else this turn's chunk was read while the last step ran
                self.read_prompts()
            stepping = time.perf_counter()
            self.metrics.add_decode_time("prefill", stepping - start)
            if self.running:
                self.step()
            if not self.running or self.paused:
                self.hand_over()  # rows that just finished: out now, not after the step in flight (drain)
                self.drain()
        except Exception as e:  # a bug outside any one request: fail the batch, keep serving
            if self.device_lost():
                return
            log.exception("decode loop error")
            self.forget_launched()
            self.fail_joining(f"internal error: {e}")
            for slot in list(self.running):
                self.fail(slot, f"internal error: {e}")
        finally:
            self.hand_over()
            self.metrics.add_decode_time("host", time.perf_counter() - stepping - (self.waited - waited))

    def wait_for_work(self) -> bool:
        with self.cond:
            while not self.stopping and (self.paused or not (self.running or self.joining or self.waiting)):
                self.idle = True
                self.cond.notify_all()
                self.cond.wait()
            self.idle = False
            return not self.stopping

    def drop_cancelled(self) -> None:
        for slot, serving in list(self.running.items()):
            if serving.request.cancelled:
                self.leave(slot)
        with self.cond:
            self.waiting = deque(r for r in self.waiting if not r.cancelled)

    def read_prompts(self, during_step: bool = False) -> bool:
        """Admit waiting requests (admit), then read one chunk of the group's prompts (read_chunk); its first
        tokens go out at once, before the step. Whether a chunk was read."""
        self.admit()
        if self.ops.prefill is None:
            return False
        for launch in self.launched:
            launch.timed = False  # its read waits for the prefill too
        self.read_chunk(during_step)
        self.hand_over()
        return True

    def admit(self) -> None:
        """Start a prefill group of waiting requests in free slots, unless one is being read. With prefill
        graphs a group is what one replay reads (BatchOps.group_size), and a burst of requests is read in a
        few replays, one per turn, instead of eager chunks of the whole burst (10-20 ms each for the default
        model on an H200, where a replay of 2048 tokens costs its GPU time alone)."""
        if self.ops.prefill is not None:
            return
        free = self.batch.free_slots()
        chunk = self.config.prefill_chunk
        with self.cond:
            n = min(len(free), len(self.waiting), chunk)
            n = self.ops.group_size([len(r.prompt_ids) for r in itertools.islice(self.waiting, n)], chunk)
            self.joining = {slot: self.waiting.popleft() for slot in free[:n]}
        if not self.joining:
            return
        now = time.monotonic()
        for r in self.joining.values():
            self.metrics.observe_queue_time(now - r.arrival)
        slots, requests = list(self.joining), [Request(r.prompt_ids, r.max_tokens, r.sampling, r.stop)
                                               for r in self.joining.values()]
        try:
            self.ops.start_prefill(slots, requests, self.config.prefill_chunk)
        except Exception as e:
            if self.device_lost():
                return
            log.exception("prefill failed")
            self.fail_joining(f"prefill failed: {type(e).__name__}: {e}")

    def read_chunk(self, during_step: bool) -> None:
        """Read one chunk of the group's prompts; the rows whose prompt it ends start running."""
        try:
            self.metrics.count_prefill(self.ops.prefill.graph is not None, during_step)
            rows = self.ops.prefill_chunk()
        except Exception as e:
            if self.device_lost():
                return
            log.exception("prefill failed")
            self.fail_joining(f"prefill failed: {type(e).__name__}: {e}")
            return
        now = time.monotonic()
        for row in rows:
            request = self.joining.pop(row.slot)
            serving = self.running[row.slot] = Serving(request, row, last_emit=now)
            self.acceptance.clear(row.slot)
            self.metrics.count_prompt(len(request.prompt_ids))
            self.emit(serving, list(row.generated))  # a copy: the row's own list grows with every step
        self.remove_finished()

    def fail_joining(self, message: str) -> None:
        """Fail the requests of the prefill group whose prompt is not read yet, and free their slots."""
        for slot, request in self.joining.items():
            self.ops.release(slot)
            self.finish_with_error(request, message)
        self.joining.clear()
        self.ops.end_prefill()
        with self.cond:
            self.cond.notify_all()

    def step(self) -> None:
        """Launch one step over the running rows, then read steps until at most one is in flight: one
        while the engine-style pipeline is safe (CUDA graphs; a graphable drafter, or a host drafter in a
        step where it drafts nothing (Stepper.pipelines; before a step where it drafts, the steps in flight
        are read); and either prompts read on a stream of their own (step.prefill_stream) or no request
        waiting or joining, whose prefill would queue behind the step in flight), so the host reads step n
        and hands its tokens out while the device runs step n+1; else none. A row that finishes or leaves
        meanwhile is masked on the device or skipped when its step is read; a different bucket reads the
        other's steps first."""
        n = self.bucket()
        if self.launched and self.launched[0].n != n:
            self.drain()  # reading the launched steps may finish rows: decide on the rows left
            if not self.running:
                return
            n = self.bucket()
        slots = sorted(self.running)
        drafting = [s for s in slots if self.running[s].request.speculate]
        gamma = self.policy.choose(self.acceptance.take(drafting), n) if drafting else 0
        if drafting and self.policy.moved:
            self.metrics.count_cost_move(self.policy.moved)
        if self.launched and not self.ops.stepper(n).pipelines(gamma):
            self.drain()  # a host drafter proposes from the last step's tokens
            if not self.running:
                return
            n, slots = self.bucket(), sorted(self.running)
        try:
            self.ops.launch(n, gamma, [s for s in slots if not self.running[s].request.speculate])
            self.launched.append(Launch(n, gamma))
            beside = self.full.prefill_stream is not None or not self.waiting and self.ops.prefill is None
            keep = 1 if self.ops.stepper(n).pipelines(gamma) and beside else 0
            while len(self.launched) > keep:
                self.read_oldest(admitting=True)
        except Exception:
            if self.device_lost():
                return
            log.exception("batched step failed; retrying row by row")
            self.forget_launched()
            slots = sorted(self.running)
            self.absorb_reports(self.step_rows_alone(n, slots, gamma), gamma)
            self.remove_finished()

    def bucket(self) -> int:
        """The smallest bucket holding every running row's slot."""
        return bucket_for(max(self.running) + 1, self.config.max_batch)

    def read_oldest(self, admitting: bool = False) -> None:
        """Read the oldest launched step and hand its tokens out (admitting: while waiting for it, admit
        the requests that arrive, admit_during)."""
        launch = self.launched.popleft()
        if admitting:
            self.admit_during(launch)
        report = self.ops.read(launch.n)
        self.waited += report.wait_s
        self.metrics.add_decode_time("wait", report.wait_s)
        if report.rows:  # not a step whose rows all finished or left before it was read: it counts nowhere
            if launch.timed and not report.compiled:  # a compile's seconds are not the step's (StepReport.compiled)
                self.policy.observe_step_time(launch.n, report.gamma, report.wall_s)
            self.absorb_reports([report], launch.gamma)
        self.remove_finished()

    def admit_during(self, launch: Launch) -> None:
        """Until the step `launch` has run on the device, admit the requests that arrive and read their
        prompts beside it (on the prefill stream), one group after another while the step runs, so that a
        request arriving during a step waits for neither that step nor the one queued behind it, nor for
        another arrival's read in the same step. The joins queue behind the last launched step, as in a
        turn, and the step's outcome skips a slot's new row (Stepper.absorb). A group whose prompts need
        more than one chunk reads its next chunk in a later turn, as before.

        Only where prompts have a stream of their own (elsewhere a prompt read would queue behind the
        steps anyway) and with two or more rows running: a step of one row is short (1-2 ms for the default
        model on an H200), and the hand-over from the waiting thread (StepWatch) would cost each of its
        steps more than an arrival could gain. Why: with 32 clients on an H200 (EAGLE), a request waited
        6.6 ms (p50) from arrival to admission, most of a step, when it could only join between steps; with
        one read a step, 2.2-2.7 ms (mean) under 22-token verifies of 7.5 ms, about 1.4 arrivals a step."""
        if self.full.prefill_stream is None or len(self.running) < 2:
            return
        done = self.ops.outcome_event(launch.n)
        if done is None:
            return
        if self.watch is None:
            self.watch = StepWatch(self.cond)
        self.watch.start(done)
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.watch.fired is done or self.can_admit())
                if self.watch.fired is done:
                    return
            start = time.perf_counter()
            read = self.read_prompts(during_step=True)
            spent = time.perf_counter() - start
            self.metrics.add_decode_time("prefill", spent)
            self.waited += spent  # not the host's step work
            if not read:  # nothing could start (a failed prefill): the step's read comes first
                return
            self.read_during_step = True  # the turn's chunk is read: the next turn reads none before its step
            launch.timed = False  # its read waits for the prefill too (read_prompts marked the later ones)

    def can_admit(self) -> bool:
        """A waiting request could start a prefill group now (called holding self.cond)."""
        return bool(self.waiting) and self.ops.prefill is None and bool(self.batch.free_slots())

    def drain(self) -> None:
        while self.launched:
            self.read_oldest()

    def forget_launched(self) -> None:
        """Drop every launched step unread (after a failure; the rows are retried or failed)."""
        for n in {launch.n for launch in self.launched}:
            self.ops.forget(n)
        self.launched.clear()

    def absorb_reports(self, reports: list[StepReport], gamma: int) -> None:
        """Count each step and hand its tokens out. A row's draft budget is the width its step verified,
        within the room it had before the step (its tokens then: the ones before this step's `new`): the gamma
        asked, or less where the step was cut to what was drafted (step.narrow: a chain of a host drafter, or
        n-grams on the CPU; a step where nothing was drafted runs plain and offers nothing). Slots the step
        verified count as rejected where the drafter left them empty (a captured step verifies them anyway);
        slots it never verified do not, so a drafter that often finds nothing is priced by what it
        drafts, and `cost` prices such steps by what they cost as run."""
        for report in reports:
            budgets = [max(0, min(report.gamma if self.running[rs.row.slot].request.speculate else 0,
                                  self.running[rs.row.slot].request.max_tokens - (len(rs.row.generated) - len(rs.new)) - 1))
                       for rs in report.rows]
            accepted = [rs.accepted for rs in report.rows]
            self.policy.observe_step(budgets, accepted, None if report.compiled else report.draft_s)
            self.acceptance.observe([rs.row.slot for rs in report.rows], budgets, accepted)
            self.metrics.observe_step(len(report.rows), gamma, [rs.drafted for rs in report.rows], accepted)
            for rs in report.rows:
                self.emit(self.running[rs.row.slot], rs.new)

    def step_rows_alone(self, n: int, slots: list[int], gamma: int) -> list[StepReport]:
        """The step once per row with only that row active (eagerly); rows whose step raises fail."""
        reports = []
        for slot in slots:
            try:
                reports.append(self.ops.step_alone(n, slot, gamma))
            except Exception as e:
                self.fail(slot, f"decode step failed: {type(e).__name__}: {e}")
        return reports

    def emit(self, serving: Serving, new: list[int]) -> None:
        """Hand the request its new text (what a stop string or an unfinished UTF-8 character cannot still
        change) and, when the row has finished, its finish reason and usage."""
        now = time.monotonic()
        request, row = serving.request, serving.row
        if row.text is not None:  # cut before a stop string
            text = row.text
        elif row.finish_reason is not None:
            text = self.codec.decode(row.generated)
        else:
            text = self.codec.decode_more(serving.detokenized, row.generated)
        if row.finish_reason is None:
            safe = len(text) - max((len(s) - 1 for s in request.stop), default=0)
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            delta = text[serving.sent : max(safe, serving.sent)]
        else:
            delta = text[serving.sent :]
        serving.sent += len(delta)
        first = row.stats.steps == 1
        self.metrics.observe_tokens(len(new), None if first else now - serving.last_emit, first, now - request.arrival)
        serving.last_emit = now
        event = Event(delta, new)
        if row.finish_reason is not None:
            event.finish_reason = "length" if row.finish_reason == "length" else "stop"  # OpenAI's: EOS is a stop
            event.usage = usage_of(serving)
            with self.cond:
                request.done = True
            if not request.cancelled:
                self.metrics.observe_latency(now - request.arrival)
                self.metrics.count_request("finished")
        self.outgoing.append(Outgoing(request, event))

    def finish_with_error(self, request: GenerationRequest, message: str) -> None:
        with self.cond:
            if request.done:
                return
            request.done = True
        if not request.cancelled:
            self.metrics.count_request("failed")
        self.outgoing.append(Outgoing(request, Event(error=message)))

    def hand_over(self) -> None:
        """Emit the events gathered since the last hand-over, in order, then call each distinct wake once."""
        outgoing, self.outgoing = self.outgoing, []
        wakes: dict[Callable[[], None], None] = {}  # distinct (equal bound methods are one), in order
        for item in outgoing:
            deliver(item.request.emit, item.event)
            if item.request.wake is not None:
                wakes[item.request.wake] = None
        for wake in wakes:
            deliver(wake)

    def device_lost(self) -> bool:
        """Called where an error was caught: when the device can run nothing more (device_problem), stop
        taking requests, fail every request held with the reason, end the decode loop and return True; an
        error of one step or request returns False (the caller retries or fails what it concerns)."""
        problem = device_problem(self.batch.device)
        if problem is None:
            return False
        self.lost = f"the device can run nothing more ({problem}); the server must be restarted"
        log.critical(self.lost, exc_info=True)
        with self.cond:
            self.stopping = True
            held = [serving.request for serving in self.running.values()] + [*self.joining.values(), *self.waiting]
            self.waiting.clear()
            self.cond.notify_all()
        for request in held:
            self.finish_with_error(request, self.lost)
        self.running.clear()
        self.joining.clear()
        self.launched.clear()
        self.hand_over()
        return True

    def fail(self, slot: int, message: str) -> None:
        self.finish_with_error(self.running[slot].request, message)
        self.leave(slot)

    def remove_finished(self) -> None:
        for slot, serving in list(self.running.items()):
            if serving.row.finished:
                self.leave(slot)

    def leave(self, slot: int) -> None:
        """Free a row's slot: it drafts and emits nothing from the next step on."""
        self.ops.release(slot)
        del self.running[slot]
        with self.cond:
            self.cond.notify_all()


class StepWatch:
    """A thread that waits for a step's outcome on the device and then notifies the decode thread's
    condition, so that the decode thread can wait for either the step or a new request (admit_during)."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.asked: queue.SimpleQueue[torch.cuda.Event | None] = queue.SimpleQueue()  # None: stop
        self.fired: torch.cuda.Event | None = None  # the last event that has happened
        threading.Thread(target=self.run, name="specdec-step-watch", daemon=True).start()

    def start(self, done: torch.cuda.Event) -> None:
        """Watch for `done` (one event at a time: the decode thread waits for each before the next)."""
        self.asked.put(done)

    def stop(self) -> None:
        self.asked.put(None)

    def run(self) -> None:
        while (done := self.asked.get()) is not None:
            try:
                done.synchronize()
            except Exception:  # a lost device: the decode thread's own read raises it and handles it
                log.debug("waiting for a step failed", exc_info=True)
            with self.cond:
                self.fired = done
                self.cond.notify_all()


@dataclass
class Launch:
    """A step launched and not read yet."""
    n: int  # its stepper's slots (a bucket)
    gamma: int  # as asked: the rows' draft budgets (the step reports the gamma it ran, for its time)
    timed: bool = True  # False: a prefill ran while it was in flight, so its read times both


@dataclass
class Outgoing:
    request: GenerationRequest
    event: Event


def deliver(call: Callable, *args) -> None:
    try:
        call(*args)
    except Exception:  # the client side is gone (closed event loop): nothing to tell
        log.debug("could not deliver an event", exc_info=True)

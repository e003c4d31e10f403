"""Continuous batching: one decode thread owns the running batch and steps it; requests join and
leave between steps.

Rows live at the front of one preallocated KV cache [L, max_batch, H, S, Dh]: rows 0..n-1 are the
running requests, and every forward runs on a view of exactly those rows. Between steps, cancelled
and finished rows leave (the last row's valid cache slots are copied into the hole) and waiting
requests join (each prefilled alone into row n, its first token sampled there). A step drafts for
every row with the stateless drafter (`none` or `ngram`), with one gamma for the batch from the
speculation policy (policy.py) capped per row by what the row may still emit; runs one target
forward over [pending token, d1..dk] per row; verifies each row (greedy rows together with
`greedy_verify`; sampled rows one by one with `rejection_sample` and the request's own generator,
so each request has its own seed); and trims each row's cache to what it kept: ragged acceptance.

Seeds: a sampled request draws only from its own generator, so the same seed and the same
speculation schedule (gamma per step, drafts) give the same text; under a different load the policy
may choose other gammas, which consume other random draws: the text then differs while its
distribution stays the target's (lossless either way).

Failure isolation: when a batched step raises, the step is redone row by row and only the rows that
still fail are failed; errors while committing a row's tokens fail only that row. Prompts are
prefilled one at a time (no chunked prefill): a long prompt delays the running rows' next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from specdec.config import SamplingParams
from specdec.drafters import DecodeState, Drafter
from specdec.drafters.base import empty_proposal
from specdec.kv_cache import KVCache
from specdec.metrics import SpecStats
from specdec.sampling import logits_to_probs, make_generator, sample
from specdec.server.metrics import ServerMetrics
from specdec.server.policy import Acceptance, SpecPolicy
from specdec.verify import VerifyResult, greedy_verify, rejection_sample

log = logging.getLogger("specdec.server")

GREEDY = SamplingParams()
SERVER_DRAFTERS = ("none", "ngram")  # stateless drafters: rows can join and leave freely


class QueueFull(Exception):
    """The waiting queue is at --max-queue."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


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
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    done: bool = False


class Codec:
    """The tokenizer behind one lock: the event loop encodes while the decode thread decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def encode_text(self, text: str) -> list[int]:
        with self.lock:
            return self.tokenizer(text)["input_ids"]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template with a generation prompt; without a template, the contents one per line."""
        with self.lock:
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                return self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id


@dataclass
class Row:
    """A running request: its tokens (the last one pending: emitted, not yet in the cache)."""

    request: GenerationRequest
    tokens: list[int]
    generator: torch.Generator | None  # None for greedy requests
    acceptance: Acceptance
    stats: SpecStats = field(default_factory=SpecStats)
    sent: int = 0  # characters of text already emitted
    last_emit: float = 0.0
    finish_reason: str | None = None
    text: str | None = None  # final text, cut before a stop string

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class StepOutput:
    tokens: list[list[int]]  # per row: the emitted tokens (accepted drafts + one)
    drafted: list[int]
    accepted: list[int]
    budgets: list[int]


def usage_of(row: Row) -> dict:
    """The request's OpenAI usage, with its speculation counters (the prefill counts as a step)."""
    s, completion = row.stats, len(row.generated)
    return {
        "prompt_tokens": row.prompt_len,
        "completion_tokens": completion,
        "total_tokens": row.prompt_len + completion,
        "speculation": {"steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
                        "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length},
    }


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 32
    max_queue: int = 256
    context: int = 2048  # prompt + max_tokens per request


def row_view(cache: KVCache, lo: int, hi: int) -> KVCache:
    """Rows lo..hi-1 of `cache` as a cache of their own (views: writes land in `cache`)."""
    view = KVCache.__new__(KVCache)
    view.k, view.v, view.lengths = cache.k[:, lo:hi], cache.v[:, lo:hi], cache.lengths[lo:hi]
    view.max_len, view.static = cache.max_len, False
    return view


def verify_rows(rows: list[Row], draft: Tensor, logits: Tensor, num_drafted: Tensor) -> VerifyResult:
    """draft [n, k], logits [n, k+1, V], num_drafted [n]: greedy rows by argmax, sampled rows by
    rejection sampling with their own parameters and generator (drafts are deterministic: q one-hot)."""
    result = greedy_verify(draft, logits, num_drafted)
    for b, row in enumerate(rows):
        params = row.request.sampling
        if not params.greedy:
            p = logits_to_probs(logits[b : b + 1], params)  # [1, k+1, V]
            one = rejection_sample(draft[b : b + 1], None, p, row.generator, num_drafted[b : b + 1])
            result.tokens[b], result.num_accepted[b] = one.tokens[0], one.num_accepted[0]
    return result


class Scheduler:
    def __init__(self, target, drafter: Drafter, codec: Codec, policy: SpecPolicy, config: SchedulerConfig,
                 metrics: ServerMetrics | None = None) -> None:
        self.target, self.drafter, self.codec, self.policy, self.config = target, drafter, codec, policy, config
        self.metrics = metrics or ServerMetrics()
        self.device = next(target.parameters()).device
        self.eos = set(target.config.eos_token_ids) | ({codec.eos_token_id} - {None})
        # gamma draft slots beyond the context, and the pending token, fit every row
        self.cache = target.new_cache(config.max_batch, config.context + policy.gamma + 1)
        self.rows: list[Row] = []
        self.waiting: deque[GenerationRequest] = deque()
        self.cond = threading.Condition()
        self.paused = self.idle = self.draining = self.stopping = False
        self.thread: threading.Thread | None = None

    # ---- called from other threads ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.loop, name="specdec-decode", daemon=True)
            self.thread.start()

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (validated by the caller: a prompt, and prompt + max_tokens within the context)."""
        if not request.prompt_ids or len(request.prompt_ids) + request.max_tokens > self.config.context:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.max_tokens} "
                             f"must fit the context of {self.config.context}")
        with self.cond:
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
            self.cond.wait_for(lambda: not self.rows and not self.waiting, timeout=drain_s)
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
        for row in self.rows:
            self.finish_with_error(row.request, "the server is shutting down")
        for request in self.waiting:
            self.finish_with_error(request, "the server is shutting down")
        self.rows.clear()
        self.waiting.clear()

    # ---- the decode thread --------------------------------------------------------------------

    def loop(self) -> None:
        while self.wait_for_work():
            try:
                self.drop_cancelled()
                self.admit()
                self.remove_finished()  # rows done at their first token (EOS, max_tokens 1)
                if self.rows:
                    self.step()
                    self.remove_finished()
            except Exception as e:  # a bug outside any one request: fail the batch, keep serving
                log.exception("decode loop error")
                for row in self.rows:
                    self.finish_with_error(row.request, f"internal error: {e}")
                self.rows.clear()
                self.cache.lengths.zero_()

    def wait_for_work(self) -> bool:
        with self.cond:
            while not self.stopping and (self.paused or not (self.rows or self.waiting)):
                self.idle = True
                self.cond.notify_all()
                self.cond.wait()
            self.idle = False
            return not self.stopping

    def drop_cancelled(self) -> None:
        for i in reversed(range(len(self.rows))):
            if self.rows[i].request.cancelled:
                self.remove_row(i)
        with self.cond:
            self.waiting = deque(r for r in self.waiting if not r.cancelled)

    def admit(self) -> None:
        while len(self.rows) < self.config.max_batch:
            with self.cond:
                if not self.waiting:
                    return
                request = self.waiting.popleft()
            try:
                row, first = self.prefill(request)
            except Exception as e:
                log.exception("prefill failed")
                self.cache.lengths[len(self.rows)] = 0
                self.finish_with_error(request, f"prefill failed: {type(e).__name__}: {e}")
                continue
            self.rows.append(row)
            self.metrics.count_prompt(len(request.prompt_ids))
            self.commit_or_fail(row, [first], 0, 0)

    def prefill(self, request: GenerationRequest) -> tuple[Row, int]:
        """Run the prompt alone into row n (the next free one); the new row and its first token."""
        i, T = len(self.rows), len(request.prompt_ids)
        view = row_view(self.cache, i, i + 1)
        view.lengths.zero_()
        ids = torch.tensor([request.prompt_ids], device=self.device)  # [1, T]
        out = self.target(ids, torch.arange(T, device=self.device)[None], view,
                          logits_at=torch.tensor([T - 1], device=self.device))
        params = request.sampling
        generator = None if params.greedy else make_generator(params.seed, self.device)
        logits = out.logits[:, 0]  # [1, V]
        first = logits.argmax(-1) if params.greedy else sample(logits_to_probs(logits, params), generator)
        return Row(request, list(request.prompt_ids), generator, Acceptance.empty(self.policy.gamma)), int(first)

    def step(self) -> None:
        n = len(self.rows)
        gamma = self.policy.choose([row.acceptance for row in self.rows])
        try:
            outputs = [(0, self.forward_step(0, n, gamma))]
        except Exception:
            log.exception("batched step failed; retrying row by row")
            outputs = []
            for i in range(n):
                try:
                    outputs.append((i, self.forward_step(i, i + 1, gamma)))
                except Exception as e:
                    self.finish_with_error(self.rows[i].request, f"decode step failed: {type(e).__name__}: {e}")
                    self.rows[i].finish_reason = "error"
        for lo, out in outputs:
            self.metrics.observe_step(len(out.tokens), gamma, out.drafted, out.accepted)
            for b, tokens in enumerate(out.tokens):
                row = self.rows[lo + b]
                row.acceptance.observe(out.budgets[b], out.accepted[b])
                self.commit_or_fail(row, tokens, out.drafted[b], out.accepted[b])

    def commit_or_fail(self, row: Row, tokens: list[int], drafted: int, accepted: int) -> None:
        try:
            self.commit(row, tokens, drafted, accepted)
        except Exception as e:
            log.exception("commit failed")
            self.finish_with_error(row.request, f"{type(e).__name__}: {e}")
            row.finish_reason = "error"

    def forward_step(self, lo: int, hi: int, gamma: int) -> StepOutput:
        """Draft, verify and trim rows lo..hi-1; the cache is left as before if anything raises."""
        rows = self.rows[lo:hi]
        budgets = [max(0, min(gamma, r.request.max_tokens - len(r.generated) - 1)) for r in rows]
        state = DecodeState(tokens=[r.tokens for r in rows], prompt_lengths=[r.prompt_len for r in rows],
                            active=[True] * len(rows), sampling=GREEDY, generator=None, device=self.device,
                            max_len=self.cache.max_len)
        t = time.perf_counter()
        proposal = self.drafter.propose(state, max(budgets)) if max(budgets) > 0 else empty_proposal(state)
        draft_s = time.perf_counter() - t
        num_drafted = torch.tensor(budgets, device=self.device).clamp(max=proposal.tokens.shape[1])  # [n]
        if proposal.num_drafted is not None:
            num_drafted = torch.minimum(num_drafted, proposal.num_drafted)
        k = int(num_drafted.max())  # rows with no draft do not widen the forward
        draft = proposal.tokens[:, :k]  # [n, k]
        view = row_view(self.cache, lo, hi)
        start = view.lengths.clone()  # [n]
        pending = torch.tensor([r.tokens[-1] for r in rows], device=self.device)  # [n]
        block = torch.cat([pending[:, None], draft], dim=1)  # [n, k+1]
        try:
            out = self.target(block, start[:, None] + torch.arange(k + 1, device=self.device), view)
            result = verify_rows(rows, draft, out.logits, num_drafted)
        except Exception:
            view.lengths.copy_(start)
            raise
        view.trim(start + result.num_accepted + 1)
        accepted = result.num_accepted.tolist()
        self.policy.observe_step(budgets, accepted, draft_s)
        emitted = [row[: a + 1] for row, a in zip(result.tokens.tolist(), accepted)]
        return StepOutput(emitted, num_drafted.tolist(), accepted, budgets)

    def commit(self, row: Row, new: list[int], drafted: int, accepted: int) -> None:
        """Append a row's emitted tokens up to a stop condition (EOS kept; a stop string cuts the text
        and the tokens after the one that completed it) and hand the request its new text."""
        kept = new[: row.request.max_tokens - len(row.generated)]
        for i, token in enumerate(kept):
            if token in self.eos:
                kept, row.finish_reason = kept[: i + 1], "stop"
                break
        before = row.generated
        text = self.codec.decode(before + kept)
        if find_stop(text, row.request.stop) is not None:
            for m in range(1, len(kept) + 1):  # the first token that completes a stop string
                text = self.codec.decode(before + kept[:m])
                hit = find_stop(text, row.request.stop)
                if hit is not None:
                    kept, text, row.finish_reason = kept[:m], text[:hit], "stop"
                    break
        row.tokens.extend(kept)
        row.stats.record_step(drafted, accepted, len(kept))
        if row.finish_reason is None and len(row.generated) >= row.request.max_tokens:
            row.finish_reason = "length"
        self.emit(row, text, kept)

    def emit(self, row: Row, text: str, kept: list[int]) -> None:
        now = time.monotonic()
        request = row.request
        if row.finish_reason is None:
            # hold back what a stop string or an unfinished UTF-8 character might still change
            safe = len(text) - max((len(s) - 1 for s in request.stop), default=0)
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            delta = text[row.sent : max(safe, row.sent)]
        else:
            delta = text[row.sent :]
        row.sent += len(delta)
        first = row.stats.steps == 1
        self.metrics.observe_tokens(len(kept), None if first else now - row.last_emit, first, now - request.arrival)
        row.last_emit = now
        event = Event(delta, kept)
        if row.finish_reason is not None:
            event.finish_reason = row.finish_reason
            event.usage = usage_of(row)
            with self.cond:
                request.done = True
            if not request.cancelled:
                self.metrics.observe_latency(now - request.arrival)
                self.metrics.count_request("finished")
        deliver(request, event)

    def finish_with_error(self, request: GenerationRequest, message: str) -> None:
        with self.cond:
            if request.done:
                return
            request.done = True
        if not request.cancelled:
            self.metrics.count_request("failed")
        deliver(request, Event(error=message))

    def remove_finished(self) -> None:
        for i in reversed(range(len(self.rows))):
            if self.rows[i].finish_reason is not None:
                self.remove_row(i)

    def remove_row(self, i: int) -> None:
        """Free row i: the last row moves into its place (only its valid cache slots are copied)."""
        last = len(self.rows) - 1
        if i != last:
            n = int(self.cache.lengths[last])
            self.cache.k[:, i, :, :n] = self.cache.k[:, last, :, :n]
            self.cache.v[:, i, :, :n] = self.cache.v[:, last, :, :n]
            self.cache.lengths[i] = n
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.lengths[last] = 0
        with self.cond:
            self.cond.notify_all()


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def deliver(request: GenerationRequest, event: Event) -> None:
    try:
        request.emit(event)
    except Exception:  # the client side is gone (closed event loop): nothing to tell
        log.debug("could not deliver an event", exc_info=True)

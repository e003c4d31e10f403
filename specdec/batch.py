"""The rows one decode step runs over: per-row state on the device, the requests on the host.

A `RowBatch` has a fixed number of slots. Each slot's state is a row of device tensors, so a step
reads and updates it without the host (and a CUDA graph can capture the step): the token history,
its length, the length at which the row must stop, whether it is still generating, its draft budget,
its sampling parameters and its random-number seed and counter. The host keeps a `Row` per occupied
slot: the request, the tokens it has been told about, its finish reason and its counters.

Stopping has one implementation, split where the information lives:
- on the device (`append`): an EOS token ends a row (the EOS is kept), and so does reaching
  max_new_tokens; rows that stopped draft nothing and emit nothing from then on;
- on the host (`cut_at_stop_string`): stop strings, which need the tokenizer. The host cuts the row's
  text before the stop string, keeps the tokens up to the one that completed it, and marks the slot
  inactive on the device (the step already launched for it is discarded).
Finish reasons are "eos", "length" and "stop" (a stop string); the server reports "eos" as
OpenAI's "stop".
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.config import SamplingParams
from specdec.kv_cache import KVCache
from specdec.metrics import SpecStats
from specdec.sampling import TOP_K_CAP, RowSampling, seed_of
from specdec.transfer import fill_slot, to_device

FINISH_CODES = {0: None, 1: "eos", 2: "length"}  # what the device decides; "stop" is the host's
# The smallest top-k bound a step runs with (RowSampling.max_top_k): every top_k of 1-64 (the usual 20, 40, 50)
# shares one step shape, which a server captures before serving (docs/design.md, "Captured before serving").
TOP_K_BOUND = 64


@dataclass(frozen=True)
class Request:
    """What one row is asked to generate."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings (empty strings are ignored)
    stop_at_eos: bool = True


@dataclass
class Row:
    """The host's view of an occupied slot."""

    slot: int
    request: Request
    seed: int  # the row's random-number seed (the request's, or a fresh one)
    generated: list[int] = field(default_factory=list)  # emitted tokens the host has been told about
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    text: str | None = None  # the output text, cut before a stop string (set when one ended the row)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RowBatch:
    """Device state of `capacity` slots of at most `max_len` tokens each (prompt + output + the widest
    draft block), and the host's rows. Every per-slot tensor is updated in place, never reallocated."""

    def __init__(self, capacity: int, max_len: int, eos_ids: list[int], device: torch.device, static: bool = False) -> None:
        B, dev = capacity, device
        self.device = dev
        self.static = static  # caches for this batch must be static (its steps are captured in CUDA graphs)
        self.confidence: float | None = None  # the `confidence` policy: drafters stop a row below this top-1 q
        self.tokens = torch.zeros(B, max_len, dtype=torch.long, device=dev)  # [B, S] prompt + output; last = pending
        self.length = torch.zeros(B, dtype=torch.long, device=dev)  # [B] tokens held
        self.prompt_length = torch.zeros(B, dtype=torch.long, device=dev)  # [B]
        self.limit = torch.zeros(B, dtype=torch.long, device=dev)  # [B] prompt + max_new_tokens
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)  # [B] still generating
        self.gamma = torch.zeros(B, dtype=torch.long, device=dev)  # [B] drafts the policy allows next step
        self.seed = torch.zeros(B, dtype=torch.long, device=dev)  # [B]
        self.draws = torch.zeros(B, dtype=torch.long, device=dev)  # [B] uniforms consumed so far
        self.stop_at_eos = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        self.sampling = RowSampling.of([SamplingParams()] * B, dev)
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], dtype=torch.long, device=dev)  # [E]
        self.eos_ids = frozenset(eos_ids)  # the same, on the host (first_token_outcome)
        self.rows: dict[int, Row] = {}
        self.draft = None  # the drafter's per-slot state (drafter.attach)
        # the target's KV cache (new_stepper sets it before drafter.attach): a draft made of the target's
        # first layers reads their keys and values there instead of keeping its own (layer_skip)
        self.target_cache: KVCache | None = None
        # set by Stepper.launch before a drafter that drafts ahead proposes: the launch's serial, and
        # {slot: serial} of the steps launched over this batch's rows and not yet read
        self.serial = 0
        self.in_flight: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]

    def sampling_mode(self) -> tuple[bool, int]:
        """(whether a running row samples, a bound on their top_k: TOP_K_BOUND or the power of two above,
        0 when none uses top-k): what a step's shape depends on. An all-greedy step verifies without
        probabilities; the bound lets top-k filtering run as one torch.topk (RowSampling.max_top_k)."""
        return sampling_mode([r.request.sampling for r in self.rows.values() if not r.finished])

    @property
    def busy(self) -> bool:
        return any(not r.finished for r in self.rows.values())

    def head(self, n: int) -> "RowBatch":
        """The first n slots as a batch of their own: views of this batch's tensors (and of the drafter's
        per-slot state), sharing its rows. Steps over a head cost n rows instead of capacity."""
        view = copy.copy(self)
        for name in PER_SLOT:
            setattr(view, name, getattr(self, name)[:n])
        view.sampling = self.sampling.index(slice(0, n))
        view.draft = head_of(self.draft, n)
        view.target_cache = None if self.target_cache is None else self.target_cache.head(n)
        return view

    def free_slots(self) -> list[int]:
        return [b for b in range(self.capacity) if b not in self.rows]

    def occupy(self, slots: list[int], requests: list[Request], active: bool = True) -> list[Row]:
        """Hold free slots for the requests (take) and write their prompts and settings there (write); the
        prefill runs next. `active`: whether steps take part in them already."""
        rows = self.take(slots, requests)
        self.write(rows, active)
        return rows

    def take(self, slots: list[int], requests: list[Request]) -> list[Row]:
        """Hold free slots for the requests, on the host: their rows (with their seeds). Their device state
        is what the slots held before until `write`, which a prefill defers past its first forward
        (Stepper.prefill_chunk)."""
        rows = []
        for slot, request in zip(slots, requests):
            if slot in self.rows:
                raise ValueError(f"slot {slot} is taken")
            rows.append(Row(slot, request, seed_of(request.sampling.seed)))
            self.rows[slot] = rows[-1]
        return rows

    def write(self, rows: list[Row], active: bool) -> None:
        """Write the rows' prompts and settings into their slots. Every value travels in two host-to-device
        copies (a server pays this per prefill group, on the decode thread): the prompts right-padded with 0
        to the longest, whose pad positions are scratch until output lands there."""
        requests = [row.request for row in rows]
        W = max(len(r.prompt) for r in requests)
        packed = to_device([[row.slot, len(r.prompt), len(r.prompt) + r.max_new_tokens, row.seed, int(r.stop_at_eos),
                             *r.prompt, *[0] * (W - len(r.prompt))] for row, r in zip(rows, requests)], self.device)  # [n, 5 + W]
        index, lengths = packed[:, 0], packed[:, 1]
        self.tokens[index, :W] = packed[:, 5:]
        self.length[index] = lengths
        self.prompt_length[index] = lengths
        self.limit[index] = packed[:, 2]
        self.seed[index] = packed[:, 3]
        self.stop_at_eos[index] = packed[:, 4].bool()
        self.draws.index_fill_(0, index, 0)
        self.sampling.put(index, [r.sampling for r in requests])
        self.active.index_fill_(0, index, active)

    def release(self, slot: int) -> Row:
        """Free a slot (finished, cancelled or failed): it drafts and emits nothing from the next step on.
        Host-side drafter state (a dict keyed by slot, see head_of) goes with it; device state stays
        until a new row joins the slot, unread meanwhile."""
        fill_slot(self.active, slot, False)
        if isinstance(self.draft, dict):
            self.draft.pop(slot, None)
        return self.rows.pop(slot)

    def finish(self, row: Row, reason: str) -> None:
        """The host ended a row (a stop string, a cancelled request): stop it on the device too."""
        row.finish_reason = reason
        fill_slot(self.active, row.slot, False)


PER_SLOT = ("tokens", "length", "prompt_length", "limit", "active", "gamma", "seed", "draws", "stop_at_eos")


def head_of(state, n: int):
    """The first n slots of a drafter's per-slot state: tensors (slot first), caches and dataclasses of
    them are viewed; host-side state (a dict keyed by slot) is shared as it is."""
    if state is None or isinstance(state, dict):
        return state
    if isinstance(state, Tensor):
        return state[:n]
    if hasattr(state, "head"):
        return state.head(n)
    if dataclasses.is_dataclass(state):
        return dataclasses.replace(state, **{f.name: head_of(getattr(state, f.name), n) for f in dataclasses.fields(state)})
    raise TypeError(f"cannot take the first slots of {type(state).__name__}")


def eos_ids(model) -> tuple[int, ...]:
    """The model's end-of-sequence ids: its config's and its tokenizer's."""
    ids = set(model.config.eos_token_ids)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def budgets(batch: RowBatch) -> Tensor:
    """[B] drafts each row may verify next step: the policy's gamma, never past max_new_tokens (a step
    emits its accepted drafts and one more token), 0 for rows that stopped."""
    room = batch.limit - batch.length - 1
    return torch.where(batch.active, torch.minimum(batch.gamma, room).clamp(min=0), 0)


def append(batch: RowBatch, emitted: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """Append each active row's first count[b] emitted tokens [B, D] after its history, cut at the first
    EOS (kept) and at max_new_tokens; stop the rows that ended. Returns (kept [B], finish code [B]:
    0 running, 1 eos, 2 length). Graph-safe."""
    B, D = emitted.shape
    j = torch.arange(D, device=emitted.device)  # [D]
    count = torch.where(batch.active, count, 0)
    room = (batch.limit - batch.length).clamp(min=0)  # [B]
    within = j < torch.minimum(count, room)[:, None]  # [B, D]
    is_eos = torch.isin(emitted, batch.eos) & batch.stop_at_eos[:, None] & within
    first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), D)  # [B]
    kept = torch.minimum(torch.minimum(count, room), first_eos + 1)  # [B]
    slots = (batch.length[:, None] + j).clamp(max=batch.max_len - 1)  # [B, D]
    old = batch.tokens.gather(1, slots)
    batch.tokens.scatter_(1, slots, torch.where(j < kept[:, None], emitted, old))
    batch.length += kept
    finish = torch.where(first_eos < kept, 1, torch.where(batch.length >= batch.limit, 2, 0))
    finish = torch.where(batch.active, finish, 0)
    batch.active &= finish == 0
    return kept, finish


def sampling_mode(params: list[SamplingParams]) -> tuple[bool, int]:
    """(whether any of these rows samples, top_k_bound of those that do): RowBatch.sampling_mode of rows."""
    sampled = [p for p in params if not p.greedy]
    return bool(sampled), top_k_bound(sampled)


def top_k_bound(params: list[SamplingParams]) -> int:
    """A bound on these rows' top_k (RowSampling.max_top_k): TOP_K_BOUND or the power of two above, 0 when
    none uses top-k."""
    top_k = min(max((p.top_k for p in params), default=0), TOP_K_CAP)
    return max(TOP_K_BOUND, 1 << (top_k - 1).bit_length()) if top_k else 0


def first_token_outcome(request: Request, token: int, eos_ids: frozenset[int]) -> tuple[int, int]:
    """(kept, finish code) that `append` gives a joining row's first token, from what the host knows: a join
    hands its first tokens out as soon as they are sampled (Stepper.join_read), before its append has run."""
    if request.max_new_tokens < 1:
        return 0, 2
    if request.stop_at_eos and token in eos_ids:
        return 1, 1
    return 1, 2 if request.max_new_tokens == 1 else 0


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest (non-empty) stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


STOP_REACH_PER_CHAR = 4  # tokens a character may span (a byte-level tokenizer splits a 4-byte UTF-8 character)
STOP_REACH_MARGIN = 8  # more tokens before them, so no stop string starts at the window's first token


def cut_at_stop_string(decode, before: list[int], new: list[int], stops: tuple[str, ...]) -> tuple[list[int], str | None]:
    """The prefix of `new` up to the token that completes a stop string in decode(before + new), and the
    text cut before that stop string; (new, None) when no stop string appears.

    A stop string found now ends in `new` (an earlier one would have ended the row), so each step first
    decodes only a window: `new` and the last tokens of `before` that could hold such a stop string's
    start, with a margin, since a window's first token may decode differently (a leading space dropped, a
    partial character). Decoding the whole output at every step cost O(length) per row and step (260 us at
    512 tokens with the default tokenizer); the whole text is decoded only when the window holds a stop."""
    if not new:
        return new, None
    reach = STOP_REACH_PER_CHAR * max(len(s) for s in stops) + STOP_REACH_MARGIN
    if len(before) > reach and find_stop(decode(before[-reach:] + new), stops) is None:
        return new, None
    if find_stop(decode(before + new), stops) is None:
        return new, None
    for m in range(1, len(new) + 1):
        text = decode(before + new[:m])
        hit = find_stop(text, stops)
        if hit is not None:
            return new[:m], text[:hit]
    raise AssertionError("unreachable: the whole text holds a stop string")

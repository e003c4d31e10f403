"""CUDA graphs for the decode and verify forwards of a native model (the GPU fast path).

Plain decoding of a small model on a GPU is bound by Python and kernel launches, not by the GPU:
one forward of a 30-layer model is hundreds of kernel launches. A static KV cache (no host
synchronisation inside the forward, attention over a fixed span) lets each forward shape be
captured once and replayed as one graph launch. One graph per (block length T, tree-mask width W);
odd shapes run eagerly. Whole-prompt prefills have their own graphs (PrefillGraphs). Outputs are
static buffers, valid until the next replay. GraphedCalls does the same for any small function a host
caller launches between a step's graphs.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.kv_cache import KVCache
from specdec.models.fused import fusing
from specdec.models.kernels import counter_lane
from specdec.models.llama import ModelOutput, aux_args


@contextmanager
def warming_up() -> Iterator[None]:
    """Run the block (a warm-up before a capture: compile kernels, pick algorithms) on a side stream, as
    torch's CUDA-graph notes ask: it starts after the current stream's queued work, and the current
    stream waits for it before the capture begins."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """Capture into `graph` (sharing `pool`) on this thread alone, with the garbage collector off.
    - The default mode ("global") lets any thread's synchronising call invalidate the capture, and in the
      server another thread does make them: StepWatch waits for a step's outcome event while the decode
      thread may capture a shape it needs for the first time.
    - A collection during the capture can free an unreachable engine's graphs, and destroying a graph
      is not permitted while a stream captures: the capture fails (both seen on an H200 as
      cudaErrorStreamCaptureInvalidated; torch.cuda.graph collects only before it begins)."""
    with collection_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        yield


_paused = {"depth": 0, "was_enabled": False}  # collection_paused's state, shared by every thread
_paused_lock = threading.Lock()


@contextmanager
def collection_paused() -> Iterator[None]:
    """The garbage collector off until the last of the overlapping pauses (any threads) ends; then as it was
    before the first. A per-call save and restore would turn it back on under another thread's capture."""
    with _paused_lock:
        if _paused["depth"] == 0:
            _paused["was_enabled"] = gc.isenabled()
            gc.disable()
        _paused["depth"] += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused["depth"] -= 1
            if _paused["depth"] == 0 and _paused["was_enabled"]:
                gc.enable()


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    tokens: Tensor  # [B, T] input buffers
    positions: Tensor
    mask: Tensor | None  # [B, T, W]
    out: ModelOutput  # output buffers


class GraphedModel:
    """Calls like the model; forwards on `cache` with no logits_at replay a captured graph."""

    def __init__(self, model, cache: KVCache, max_block: int = 128) -> None:
        assert cache.static, "CUDA graphs need a static cache"
        self.model, self.cache, self.max_block = model, cache, max_block
        self.graphs: dict[tuple[int, int | None], Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __getattr__(self, name: str):  # config, tokenizer, new_cache, lm_head ... of the model
        return getattr(self.model, name)

    def __call__(self, tokens: Tensor, positions: Tensor, cache, mask: Tensor | None = None,
                 logits_at: Tensor | None = None) -> ModelOutput:
        T = tokens.shape[1]
        if cache is not self.cache or logits_at is not None or T > self.max_block:
            return self.model(tokens, positions, cache, mask, logits_at)
        key = (T, None if mask is None else mask.shape[-1])
        entry = self.graphs.get(key) or self.capture(key, tokens, positions, mask)
        entry.tokens.copy_(tokens)
        entry.positions.copy_(positions)
        if mask is not None:
            entry.mask.copy_(mask)
        entry.graph.replay()
        return entry.out

    def capture(self, key, tokens: Tensor, positions: Tensor, mask: Tensor | None) -> Captured:
        tokens, positions = tokens.clone(), positions.clone()
        mask = None if mask is None else mask.clone()
        lengths = self.cache.lengths.clone()
        with fusing(), warming_up():  # then undo its cache writes
            for _ in range(2):
                self.model(tokens, positions, self.cache, mask)
                self.cache.lengths.copy_(lengths)
        graph = torch.cuda.CUDAGraph()
        with fusing(), capturing(graph, self.pool):
            out = self.model(tokens, positions, self.cache, mask)
        self.cache.lengths.copy_(lengths)  # capturing ran nothing, but be explicit: the cache is as before
        self.graphs[key] = Captured(graph, tokens, positions, mask, out)
        return self.graphs[key]


@dataclass
class CallGraph:
    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]  # the graph's own buffers for the arguments copied in at each call
    out: object  # fn's outputs: buffers the next replay (of any graph in the pool) may overwrite


class GraphedCalls:
    """fn(*args) on CUDA as one graph replay: a host-side caller of a few tiny kernels between a step's
    graphs (a host drafter's device tail, drafters.suffix) pays their launches and torch.compile's guards
    on every call, which can cost more than the step in flight hides. One graph per signature: the shapes of
    the tensor arguments, the address of each one read where it lies (a batch's tensors: it must outlive the
    graph, or at least its storage must), and the values of the other arguments. The tensor arguments at
    `copied` are new at each call: they are copied into the graph's own buffers before it replays. fn must
    not write its arguments (it runs three times on the first call of a signature: twice to warm up, once
    captured). Outputs are valid until the next call: the graphs share one memory pool (a server meets a
    signature per batch bucket, width and gamma, and a pool of its own would hold a 2 MB segment each)."""

    def __init__(self, fn, copied: tuple[int, ...] = ()) -> None:
        self.fn, self.copied = fn, copied
        self.graphs: dict[tuple, CallGraph] = {}
        self.pool = None  # made at the first capture (a CPU process never needs one)

    def __call__(self, *args):
        key = tuple(signature(a, i in self.copied) for i, a in enumerate(args))
        entry = self.graphs.get(key) or self.capture(key, args)
        for buffer, i in zip(entry.inputs, self.copied):
            buffer.copy_(args[i], non_blocking=True)
        entry.graph.replay()
        return entry.out

    def capture(self, key: tuple, args: tuple) -> CallGraph:
        args = list(args)
        inputs = [args[i].clone() for i in self.copied]
        for buffer, i in zip(inputs, self.copied):
            args[i] = buffer
        with warming_up():
            for _ in range(2):
                self.fn(*args)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with capturing(graph, self.pool):
            out = self.fn(*args)
        self.graphs[key] = CallGraph(graph, inputs, out)
        return self.graphs[key]


def signature(arg, copied: bool) -> tuple:
    """What a captured call depends on in one argument (GraphedCalls)."""
    if isinstance(arg, Tensor):
        return (None if copied else arg.data_ptr(), tuple(arg.shape), arg.stride(), arg.dtype, arg.device)
    return (type(arg), arg)


PREFILL_GRAPH_TOKENS = 16384  # rows x positions of the largest prefill captured (its scratch cache's slots): a GPU
# server's chunk (8192 tokens) padded to powers of two in rows and positions, so that a burst of requests is read in
# one replay instead of one per decode turn ...
PREFILL_GRAPH_BYTES = 512 << 20  # ... and at most this much scratch cache: a larger model's prefill is GPU-bound anyway
MIN_SPAN = 16
PREFILL_LANE = "prefill"  # the arrival counters of prompt reads (kernels.counter_lane): they may overlap a step


@dataclass
class PrefillGraph:
    graph: torch.cuda.CUDAGraph
    scratch: KVCache  # [R rows, S slots] views of PrefillGraphs.slots
    tokens: Tensor  # [R, S] input buffer
    positions: Tensor  # [R, S] 0 .. S-1 (held: the graph reads it, and a freed buffer is soon another tensor's)
    last: Tensor  # [R] input buffer: the position whose logits each row needs
    out: ModelOutput  # logits [R, 1, V], hidden [R, S, D] (aux [R, S, n*D] with aux_layers) output buffers


class PrefillGraphs:
    """Whole-prompt prefills as CUDA graphs. An eager forward of a small model is bound by the host (five
    Triton launches per layer: 11-14 ms for the default model on an H200, over 0.7-3 ms of GPU work), and
    a server pays one for every group of joining requests. A group of m rows whose longest prompt has w
    tokens runs padded to R x S: R rows (the next power of two) and S positions (the next power of two, at
    least MIN_SPAN), the padding token 0 after the real tokens; spare rows read the first row's prompt
    again, so their outputs are that row's bits (step.JoinGraph writes them to its slot). Only for the exact
    kernels: every per-token output is then bitwise invariant to the batch and the block it is computed
    in, so the padding changes no real row's logits, hidden states or keys and values. Every shape's
    scratch cache is a view of one buffer of `max_tokens` slots, and one prefill is read at a time.
    `aux_layers`: the drafter's target_features (step.py), which every captured forward returns too."""

    def __init__(self, model, max_tokens: int | None = None, aux_layers: tuple[int, ...] | None = None,
                 max_rows: int | None = None, max_span: int | None = None) -> None:
        """max_rows, max_span: the most prompts a prefill reads together and the longest prompt (the batch's
        slots and a row's context), which bound the shapes captured and the scratch cache."""
        self.max_tokens = max_tokens or prefill_graph_tokens(model)
        if max_rows and max_span:
            self.max_tokens = min(self.max_tokens, next_power_of_2(max_rows) * max(MIN_SPAN, next_power_of_2(max_span)))
        self.model, self.max_span = model, max_span
        self.aux_args = aux_args(aux_layers)
        self.slots: KVCache | None = None  # [L, 1, H, max_tokens, Dh], viewed per shape (allocated by the first capture)
        self.graphs: dict[tuple[int, int], PrefillGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def shape(self, rows: int, longest: int) -> tuple[int, int] | None:
        """(R, S) a prefill of `rows` prompts of at most `longest` tokens runs as; None past max_tokens."""
        R, S = next_power_of_2(rows), max(MIN_SPAN, next_power_of_2(longest))
        return (R, S) if R * S <= self.max_tokens else None

    def shapes(self, max_rows: int) -> list[tuple[int, int]]:
        """Every (R, S) up to max_rows rows, for capturing ahead."""
        rows = [1 << i for i in range(next_power_of_2(max_rows).bit_length())]
        longest = max(MIN_SPAN, next_power_of_2(self.max_span)) if self.max_span else self.max_tokens
        spans = [MIN_SPAN << i for i in range(self.max_tokens.bit_length()) if MIN_SPAN << i <= longest]
        return [(R, S) for R in rows for S in spans if R * S <= self.max_tokens]

    def scratch(self, key: tuple[int, int]) -> KVCache:
        return (self.graphs.get(key) or self.capture(key)).scratch

    def forward(self, key: tuple[int, int], block: Tensor, last: Tensor) -> ModelOutput:
        """The model's forward over block [m, w] (positions 0 .. w-1) into the shape's scratch cache, logits
        at `last` [m]: views [:m] of the output buffers, valid until the next replay."""
        g = self.graphs[key]
        m, w = block.shape
        R = len(g.last)
        g.tokens.zero_()
        g.tokens[:m, :w] = block
        g.tokens[m:, :w] = block[:1].expand(R - m, w)  # spare rows read the first prompt: a padded join (step.JoinGraph)
        g.last[:m] = last
        g.last[m:] = last[:1].expand(R - m)
        g.scratch.lengths.zero_()
        g.graph.replay()
        aux = None if g.out.aux is None else g.out.aux[:m, :w]
        return ModelOutput(logits=g.out.logits[:m], hidden=g.out.hidden[:m, :w], aux=aux)

    def capture(self, key: tuple[int, int]) -> PrefillGraph:
        R, S = key
        if self.slots is None:
            self.slots = self.model.new_cache(1, self.max_tokens, static=True)
        slots = self.slots
        L, _, H, _, Dh = slots.k.shape
        k, v = (t.view(-1)[: L * R * H * S * Dh].view(L, R, H, S, Dh) for t in (slots.k, slots.v))
        scratch = KVCache.over(k, v, torch.zeros(R, dtype=torch.long, device=slots.k.device), S, static=True)
        tokens = torch.zeros(R, S, dtype=torch.long, device=slots.k.device)
        positions = torch.arange(S, device=slots.k.device).expand(R, S).contiguous()
        last = torch.zeros(R, dtype=torch.long, device=slots.k.device)
        with warming_up(), counter_lane(PREFILL_LANE):
            for _ in range(2):
                scratch.lengths.zero_()
                self.model(tokens, positions, scratch, logits_at=last, **self.aux_args)
        graph = torch.cuda.CUDAGraph()
        scratch.lengths.zero_()
        with capturing(graph, self.pool), counter_lane(PREFILL_LANE):
            out = self.model(tokens, positions, scratch, logits_at=last, **self.aux_args)
        self.graphs[key] = PrefillGraph(graph, scratch, tokens, positions, last, out)
        return self.graphs[key]


def prefill_graph_tokens(model) -> int:
    """The most rows x positions PrefillGraphs captures for `model`: PREFILL_GRAPH_TOKENS, or the largest
    power of two whose keys and values fit PREFILL_GRAPH_BYTES (0: none fits MIN_SPAN, no prefill graphs)."""
    c, p = model.config, model.norm.weight
    kv_heads = model.shard.local(c.num_kv_heads, "the key/value heads")
    per_token = 2 * c.num_layers * kv_heads * c.head_dim * p.element_size()  # keys and values, every layer
    fits = PREFILL_GRAPH_BYTES // per_token
    tokens = min(PREFILL_GRAPH_TOKENS, 1 << (fits.bit_length() - 1) if fits else 0)
    return tokens if tokens >= MIN_SPAN else 0


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def bucket(n: int, step: int = 512) -> int:
    """Round a cache length up, so runs of similar lengths share a static cache and its graphs."""
    return -(-n // step) * step

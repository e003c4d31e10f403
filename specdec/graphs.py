"""CUDA graphs for the decode and verify forwards of a native model (the GPU fast path).

Plain decoding of a small model on a GPU is bound by Python and kernel launches, not by the GPU:
one forward of a 30-layer model is hundreds of kernel launches. A static KV cache (no host
synchronisation inside the forward, attention over a fixed span) lets each forward shape be
captured once and replayed as one graph launch. One graph per (block length T, tree-mask width W);
prefill and odd shapes run eagerly. Outputs are static buffers, valid until the next replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.kv_cache import KVCache
from specdec.models.fused import fusing
from specdec.models.llama import ModelOutput


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
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with fusing(), torch.cuda.stream(side):  # warm up (compile, pick algorithms), then undo its cache writes
            for _ in range(2):
                self.model(tokens, positions, self.cache, mask)
                self.cache.lengths.copy_(lengths)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with fusing(), torch.cuda.graph(graph, pool=self.pool):
            out = self.model(tokens, positions, self.cache, mask)
        self.cache.lengths.copy_(lengths)  # capturing ran nothing, but be explicit: the cache is as before
        self.graphs[key] = Captured(graph, tokens, positions, mask, out)
        return self.graphs[key]


def bucket(n: int, step: int = 512) -> int:
    """Round a cache length up, so runs of similar lengths share a static cache and its graphs."""
    return -(-n // step) * step

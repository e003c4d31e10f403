"""Preallocated key/value cache with per-row lengths.

Contract: row b holds `lengths[b]` valid slots. A forward over T new tokens writes them at slots
lengths[b] .. lengths[b]+T-1 (whatever their RoPE positions are) and advances lengths by T. The
caller then `trim`s rows back to what it keeps (rejected draft tokens are simply forgotten: their
slots get overwritten by the next write) or `compact`s a tree's accepted path into place.
Nothing is reallocated per step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.errors import UserError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        static: bool = False,
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, Dh]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, Dh]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.max_len = max_len
        # static: no host synchronisation in forwards (no overflow check here, attention over all max_len
        # slots), so a forward can be captured in a CUDA graph; the caller keeps lengths within max_len.
        self.static = static

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @classmethod
    def over(cls, k: Tensor, v: Tensor, lengths: Tensor, max_len: int, static: bool) -> "KVCache":
        """A cache over existing keys, values [L, B, H, S, Dh] and lengths [B] (views or storage of another
        cache's: writes land there)."""
        view = cls.__new__(cls)
        view.k, view.v, view.lengths, view.max_len, view.static = k, v, lengths, max_len, static
        return view

    def head(self, n: int) -> "KVCache":
        """Rows 0..n-1 as a cache of their own (views: writes land in this cache)."""
        return KVCache.over(self.k[:, :n], self.v[:, :n], self.lengths[:n], self.max_len, self.static)

    def first_layers(self, n: int) -> "KVCache":
        """Layers 0..n-1 as a cache of their own, with lengths of its own (views of the keys and values:
        writes land in this cache). A draft made of a model's first n layers reads and writes its
        entries there (layer_skip)."""
        return KVCache.over(self.k[:n], self.v[:n], self.lengths.clone(), self.max_len, self.static)

    def reserve(self, num_new: int) -> Tensor:
        """Slots [B, T] the next `num_new` tokens of each row go to. Fails loudly instead of overflowing."""
        slots = self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)  # [B, T]
        if not self.static and int(slots[:, -1].max()) >= self.max_len:
            raise UserError(f"sequence would exceed the KV cache of {self.max_len} slots (context too long)")
        return slots

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's keys and values [B, H, S, Dh] (views: writes land in the cache)."""
        return self.k[i], self.v[i]

    def trim(self, lengths: Tensor) -> None:
        """Roll rows back to `lengths` [B] valid slots (never forward)."""
        self.lengths.copy_(torch.minimum(self.lengths, lengths.to(self.lengths)))

    def compact(self, start: Tensor, keep: Tensor, num_keep: Tensor) -> None:
        """Move slots start[b] + keep[b, :num_keep[b]] to start[b] .. start[b]+num_keep[b]-1 and trim.

        start: [B] first slot of the block just written; keep: [B, N] offsets into that block, in order;
        num_keep: [B]. Used after tree verification to lay the accepted path out as a chain.
        """
        src = start[:, None] + keep  # [B, N]
        dst = start[:, None] + torch.arange(keep.shape[1], device=keep.device)  # [B, N]
        for cache in (as_bits(self.k), as_bits(self.v)):
            L, B, H, _, Dh = cache.shape
            gathered = cache.gather(3, src[None, :, None, :, None].expand(L, B, H, -1, Dh))
            cache.scatter_(3, dst[None, :, None, :, None].expand(L, B, H, -1, Dh), gathered)
        self.lengths.copy_(start + num_keep)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """Store k, v [B, H, T, Dh] at slots [B, T] of one layer's k_cache, v_cache [B, H, S, Dh]."""
    index = slots[:, None, :, None].expand_as(k)  # [B, H, T, Dh]
    as_bits(k_cache).scatter_(2, index, as_bits(k))
    as_bits(v_cache).scatter_(2, index, as_bits(v))


def as_bits(x: Tensor) -> Tensor:
    """x viewed as integers of its width: moving values (gather, scatter) is then a plain copy of bits.
    PyTorch's CPU scatter on bfloat16 is ~15x slower than on 16-bit integers (measured, 2-core x86_64)."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])

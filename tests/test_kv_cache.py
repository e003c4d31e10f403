"""kv_cache.py: trim and compact semantics, overflow, and the round trip "write rejected tokens, trim,
write the true ones" leaving the cache (and the logits) as if the rejected tokens never came."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from specdec.errors import UserError
from specdec.kv_cache import KVCache


def small_cache(batch_size: int = 2, max_len: int = 8) -> KVCache:
    return KVCache(num_layers=2, batch_size=batch_size, num_kv_heads=1, max_len=max_len, head_dim=3, dtype=torch.float32, device=DEVICE)


def label_slots(cache: KVCache) -> None:
    """Fill every slot with a value naming it: k = 100 * row + slot, v = -k."""
    L, B, H, S, Dh = cache.k.shape
    labels = 100 * torch.arange(B, device=DEVICE)[:, None] + torch.arange(S, device=DEVICE)[None, :]  # [B, S]
    cache.k.copy_(labels[None, :, None, :, None].expand(L, B, H, S, Dh).float())
    cache.v.copy_(-cache.k)


def slot_labels(cache: KVCache, row: int) -> list[int]:
    """The labels now stored in row's slots (checked identical across layers, heads, dims, and k/v)."""
    k = cache.k[:, row]  # [L, H, S, Dh]
    assert torch.equal(k, k[:1, :1, :, :1].expand_as(k))
    assert torch.equal(cache.v[:, row], -k)
    return k[0, 0, :, 0].long().tolist()


# ---------------------------------------------------------------- trim, reserve


def test_trim_rolls_back_per_row_and_never_forward():
    cache = small_cache()
    cache.lengths.copy_(torch.tensor([5, 3], device=DEVICE))
    label_slots(cache)
    cache.trim(torch.tensor([4, 6], device=DEVICE))
    assert cache.lengths.tolist() == [4, 3]
    assert slot_labels(cache, 0) == list(range(8))  # trim forgets slots, it does not touch data
    assert slot_labels(cache, 1) == [100 + s for s in range(8)]


def test_reserve_returns_the_next_slots_per_row():
    cache = small_cache()
    cache.lengths.copy_(torch.tensor([2, 5], device=DEVICE))
    assert cache.reserve(3).tolist() == [[2, 3, 4], [5, 6, 7]]


def test_reserve_past_max_len_raises_user_error():
    cache = small_cache(max_len=8)
    cache.lengths.copy_(torch.tensor([2, 6], device=DEVICE))
    cache.reserve(2)  # row 1 ends exactly at the last slot
    with pytest.raises(UserError):
        cache.reserve(3)


def test_model_forward_past_the_cache_raises_user_error(tiny):
    cache = tiny.new_cache(1, 4)
    tiny(torch.tensor([[1, 2, 3]], device=DEVICE), torch.arange(3, device=DEVICE)[None], cache)
    with pytest.raises(UserError):
        tiny(torch.tensor([[4, 5]], device=DEVICE), torch.tensor([[3, 4]], device=DEVICE), cache)


# ---------------------------------------------------------------- compact


def test_compact_moves_the_kept_slots_into_a_contiguous_run():
    cache = small_cache()
    label_slots(cache)
    cache.lengths.copy_(torch.tensor([6, 5], device=DEVICE))  # row 0 wrote a block at slots 2..5, row 1 at 1..4
    start = torch.tensor([2, 1], device=DEVICE)  # [B]
    keep = torch.tensor([[0, 2, 3], [1, 3, 0]], device=DEVICE)  # [B, N] offsets into the block; row 1's last is padding
    cache.compact(start, keep, num_keep=torch.tensor([3, 2], device=DEVICE))
    assert cache.lengths.tolist() == [5, 3]
    assert slot_labels(cache, 0)[:5] == [0, 1, 2, 4, 5]  # prefix untouched, then offsets 0, 2, 3
    assert slot_labels(cache, 1)[:3] == [100, 102, 104]  # prefix untouched, then offsets 1, 3


def test_compact_of_the_identity_path_changes_nothing():
    cache = small_cache()
    label_slots(cache)
    start, keep = torch.tensor([1, 3], device=DEVICE), torch.tensor([[0, 1], [0, 1]], device=DEVICE)  # [B], [B, N]
    cache.compact(start, keep, num_keep=torch.tensor([2, 1], device=DEVICE))
    assert cache.lengths.tolist() == [3, 4]
    assert slot_labels(cache, 0) == list(range(8))
    assert slot_labels(cache, 1) == [100 + s for s in range(8)]


# ---------------------------------------------------------------- round trip through a model

PROMPTS = [[5, 17, 3, 42, 8], [9, 1, 77]]  # different per-row lengths
REJECTED = [[30, 31, 32], [60, 61, 62]]  # a speculative block per row
KEPT = [1, 0]  # row 0 keeps its first block token, row 1 none
CONTINUATION = [[11, 12], [13, 14]]  # what truly comes next


def forward_chain(model, cache: KVCache, tokens: list[list[int]]):
    """Feed one block [B, T] at each row's next positions (a chain: position == slot)."""
    block = torch.tensor(tokens, device=DEVICE)  # [B, T]
    positions = cache.lengths[:, None] + torch.arange(block.shape[1], device=DEVICE)  # [B, T]
    return model(block, positions, cache)


def speculative_cache(model):
    """Prefill (right-padded), write a speculative block, trim each row to what it keeps, then write
    the continuation. Returns the cache and the continuation's logits [B, T, V]."""
    cache = model.new_cache(2, 16)
    lengths = torch.tensor([len(p) for p in PROMPTS], device=DEVICE)  # [B]
    width = int(lengths.max())
    forward_chain(model, cache, [p + [p[-1]] * (width - len(p)) for p in PROMPTS])
    cache.trim(lengths)
    forward_chain(model, cache, REJECTED)
    cache.trim(lengths + torch.tensor(KEPT, device=DEVICE))
    return cache, forward_chain(model, cache, CONTINUATION).logits


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    assert actual.shape == expected.shape
    diff = float((actual - expected).abs().max())
    assert diff <= atol, f"max abs difference {diff:.3g} > {atol}"


def true_sequence(b: int) -> list[int]:
    return PROMPTS[b] + REJECTED[b][: KEPT[b]] + CONTINUATION[b]


def test_trim_leaves_the_cache_as_if_rejected_tokens_never_came(tiny):
    cache, logits = speculative_cache(tiny)  # logits [B, T, V]
    for b in range(2):
        sequence = true_sequence(b)
        reference = tiny.new_cache(1, 16)
        ref_logits = forward_chain(tiny, reference, [sequence]).logits  # [1, len, V]
        n = len(sequence)
        assert int(cache.lengths[b]) == n
        assert_close(cache.k[:, b, :, :n], reference.k[:, 0, :, :n])
        assert_close(cache.v[:, b, :, :n], reference.v[:, 0, :, :n])
        assert_close(logits[b], ref_logits[0, -len(CONTINUATION[b]) :])


def test_stale_slots_would_change_the_logits(tiny):
    """Control: without the trim the rejected tokens stay visible and the logits differ, so the
    round-trip test above can fail."""
    cache = tiny.new_cache(1, 16)
    forward_chain(tiny, cache, [PROMPTS[0] + REJECTED[0]])
    untrimmed = forward_chain(tiny, cache, [CONTINUATION[0]]).logits  # [1, T, V]
    reference = forward_chain(tiny, tiny.new_cache(1, 16), [PROMPTS[0] + CONTINUATION[0]]).logits
    assert not torch.allclose(untrimmed[0], reference[0, -2:], atol=1e-3)

"""Whole decoder layers in one C call (specdec/models/cpu_layer.py): each token's outputs (hidden state,
keys and values) are bitwise the same alone, in a verify block of any length, in a tree and in a batch
of 32, in float32 and bfloat16; they equal the PyTorch path's within rounding (for every covered model
feature); and what the C code does not cover is refused, so the caller can fall back.

The models keep their random logits unsharpened. CPU-only: they run on the CPU whatever
SPECDEC_TEST_DEVICE says."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, build_hf, save_hf, two_branch_tree
from specdec.errors import UserError
from specdec.models import cpu_gemm, cpu_layer, load_model
from specdec.models.kernels import use_kernels
from specdec.models.llama import DecoderLayer, build_attention_mask, run_layers
from specdec.models.rope import rope_cos_sin
from specdec.models.views import quantized_copy

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler: the CPU kernels could not be built")

DTYPES = ["float32", "bfloat16"]
ULPS = {torch.float32: 2.0**-23 * 100, torch.bfloat16: 2.0**-8 * 4}  # allowed error, relative to the largest value


def assert_near(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal within a few roundings of `dtype` (the two paths round RoPE differently, and reduce in
    other orders) at the scale of the tensor's largest value."""
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), atol=ULPS[dtype] * scale, rtol=ULPS[dtype])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny random models (GQA, logits not sharpened): Llama; Qwen2 (q/k/v biases); Qwen3 (q/k norms,
    head_dim 32 != hidden / heads)."""
    root = tmp_path_factory.mktemp("cpu_layer")
    kinds = {"llama": {}, "qwen2": {}, "qwen3": dict(head_dim=32)}
    return {kind: save_hf(build_hf(kind, seed=0, **extra), root / kind) for kind, extra in kinds.items()}


@pytest.fixture(scope="module", params=DTYPES)
def model(request, folders):
    return load_model(str(folders["llama"]), dtype=request.param, device="cpu")


def embeddings(model, B: int, T: int, seed: int) -> torch.Tensor:
    """x [B, T, D]: embeddings of random tokens, in the model's dtype."""
    tokens = torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))
    return model.embed_tokens(tokens)


def chain(start, length: int, rows: int = 1) -> torch.Tensor:  # positions [rows, length]; start an int or [rows]
    return torch.as_tensor(start).reshape(-1, 1) + torch.arange(length).expand(rows, -1)


def run_layers_torch(model, x, positions, cache, mask=None, window=None):
    """The PyTorch path of llama.run_layers (modules one by one), whatever run_layers dispatches to."""
    cos, sin = rope_cos_sin(positions, model.inv_freq, model.rope_attention_factor, x.dtype)
    slots = cache.reserve(x.shape[1])
    attn_mask = build_attention_mask(cache.lengths, slots, positions, mask, window)
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, cache.layer(i), slots, attn_mask)
    cache.lengths += x.shape[1]
    return x


def run_layers_c(model, x, positions, cache, mask=None, window=None):
    out = cpu_layer.run_layers_cpu(model.layers, x, positions, cache, mask, model.inv_freq, model.rope_attention_factor, window)
    assert out is not None, cpu_layer.unsupported(model.layers, x, cache)
    return out


def written(cache, row: int, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [L, Hkv, n, Dh] of one row at the given slots."""
    return cache.k[:, row, :, slots], cache.v[:, row, :, slots]


def decode_plainly(model, prefix: torch.Tensor, new: torch.Tensor):
    """Hidden states [1, N, D] of new [1, N, D] fed one token at a time after prefix [1, P, D], and the cache."""
    P, N = prefix.shape[1], new.shape[1]
    cache = model.new_cache(1, P + N)
    run_layers_c(model, prefix, chain(0, P), cache)
    outs = [run_layers_c(model, new[:, i : i + 1], chain(P + i, 1), cache) for i in range(N)]
    return torch.cat(outs, 1), cache


@torch.inference_mode()
def test_a_verify_block_gives_each_token_the_bits_of_plain_decoding(model):
    prefix, new = embeddings(model, 1, 6, seed=1), embeddings(model, 1, 17, seed=2)
    plain, plain_cache = decode_plainly(model, prefix, new)
    for T in range(1, 18):
        cache = model.new_cache(1, 6 + T)
        run_layers_c(model, prefix, chain(0, 6), cache)
        block = run_layers_c(model, new[:, :T], chain(6, T), cache)
        assert torch.equal(block, plain[:, :T]), T
        assert all(map(torch.equal, written(cache, 0, slice(0, 6 + T)), written(plain_cache, 0, slice(0, 6 + T)))), T
        assert int(cache.lengths[0]) == 6 + T


@torch.inference_mode()
@pytest.mark.parametrize("levels", [1, 2], ids=["one-forward", "grown-in-two-forwards"])
def test_a_tree_gives_each_branch_the_bits_of_plain_decoding(model, levels):
    """The tree in one forward (W = T), or its first 4 nodes then the other 5 seeing them (W = 9 > T = 5)."""
    branches, depths, mask = two_branch_tree()
    prefix, nodes = embeddings(model, 1, 7, seed=3), embeddings(model, 1, 9, seed=4)
    cache = model.new_cache(1, 16)
    run_layers_c(model, prefix, chain(0, 7), cache)
    if levels == 1:
        out = run_layers_c(model, nodes, 7 + depths[None], cache, mask[None])
    else:
        first = run_layers_c(model, nodes[:, :4], 7 + depths[None, :4], cache, mask[None, :4, :4])
        out = torch.cat([first, run_layers_c(model, nodes[:, 4:], 7 + depths[None, 4:], cache, mask[None, 4:])], 1)
    for branch in branches:
        plain, plain_cache = decode_plainly(model, prefix, nodes[:, branch])
        assert torch.equal(out[:, branch], plain), branch
        slots = [7 + node for node in branch]
        assert all(map(torch.equal, written(cache, 0, slots), written(plain_cache, 0, slice(7, 7 + len(branch))))), branch


@torch.inference_mode()
def test_a_batch_of_32_gives_each_row_the_bits_it_gets_alone(model):
    """32 rows with ragged committed prefixes, then a verify block of 5 (batch 32 x gamma 4), on 2
    threads; each row alone on 1 thread."""
    B, P, T = 32, 8, 5
    prompts, blocks = embeddings(model, B, P, seed=5), embeddings(model, B, T, seed=6)
    lengths = torch.randint(3, P + 1, (B,), generator=torch.Generator().manual_seed(7))  # [B]
    torch.set_num_threads(2)
    cache = model.new_cache(B, P + T)
    prefill = run_layers_c(model, prompts, chain(0, P, B), cache)
    cache.trim(lengths)
    batch = run_layers_c(model, blocks, chain(lengths, T), cache)
    torch.set_num_threads(1)
    for b in range(B):
        n = int(lengths[b])
        alone_cache = model.new_cache(1, n + T)
        alone_prefill = run_layers_c(model, prompts[b : b + 1, :n], chain(0, n), alone_cache)
        alone = run_layers_c(model, blocks[b : b + 1], chain(n, T), alone_cache)
        assert torch.equal(prefill[b, :n], alone_prefill[0]), b
        assert torch.equal(batch[b], alone[0]), b
        assert all(map(torch.equal, written(cache, b, slice(0, n + T)), written(alone_cache, 0, slice(0, n + T)))), b


def variant(folders, name: str, dtype: str):
    """(model, window) for a covered feature."""
    if name == "int8":
        return quantized_copy(load_model(str(folders["llama"]), dtype=dtype, device="cpu")), None
    model = load_model(str(folders[name.removesuffix("-window")]), dtype=dtype, device="cpu")
    return model, 3 if name.endswith("-window") else None


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama-window", "int8"])
def test_it_equals_the_pytorch_path_within_rounding(folders, name, dtype):
    """A prefill, a verify block over ragged rows, then a tree with W > T: hidden states, the keys and
    values written, and the lengths, against the modules run one by one."""
    model, window = variant(folders, name, dtype)
    B, P, T = 3, 6, 4
    branches, depths, mask = two_branch_tree()
    caches, outs = [], []
    for run in (run_layers_torch, run_layers_c):
        cache = model.new_cache(B, P + T + 9)
        prefill = run(model, embeddings(model, B, P, seed=8), chain(0, P, B), cache, window=window)
        cache.trim(torch.tensor([P, P - 2, P - 1]))
        block = run(model, embeddings(model, B, T, seed=9), chain(cache.lengths, T), cache, window=window)
        first = run(model, embeddings(model, B, 4, seed=10), cache.lengths[:, None] + depths[:4], cache,
                    mask[None, :4, :4].expand(B, -1, -1), window=window)
        second = run(model, embeddings(model, B, 5, seed=11), cache.lengths[:, None] - 4 + depths[4:], cache,
                     mask[None, 4:].expand(B, -1, -1), window=window)
        caches.append(cache)
        outs.append(torch.cat([prefill, block, first, second], 1).float())
    dtype = model.embed_tokens.weight.dtype
    assert_near(outs[1], outs[0], dtype)
    assert_near(caches[1].k, caches[0].k, dtype)
    assert_near(caches[1].v, caches[0].v, dtype)
    assert torch.equal(caches[1].lengths, caches[0].lengths)


@torch.inference_mode()
def test_the_final_norm_and_the_logits_are_per_row_and_equal_the_modules(model):
    x = embeddings(model, 3, 7, seed=12)  # [B, T, D]
    hidden, logits = cpu_layer.norm_and_logits(model.norm, model.lm_head, x, None)  # [B, T, D], [B, T, V]
    assert logits.dtype == torch.float32
    for b in range(3):
        for t in range(7):
            row_hidden, row_logits = cpu_layer.norm_and_logits(model.norm, model.lm_head, x[b : b + 1], torch.tensor([t]))
            assert torch.equal(row_hidden[0], hidden[b]) and torch.equal(row_logits[0, 0], logits[b, t])
    assert_near(hidden, model.norm(x), x.dtype)
    assert_near(logits, model.lm_head(hidden).float(), x.dtype)


class OwnForward(DecoderLayer):
    def forward(self, x, cos, sin, kv, slots, attn_mask):
        return x


@pytest.mark.parametrize("change, reason", [
    ("grad", "autograd"),
    ("no cache", "no KV cache"),
    ("float16", "dtype torch.float16"),
    ("library", "not packed"),
    ("own forward", "its own forward"),
])
def test_what_it_does_not_cover_is_refused(folders, change, reason):
    """None (nothing written, lengths unchanged) and the reason from `unsupported`: the caller then runs
    the PyTorch path. A change made after a first forward through the C path is noticed."""
    model = load_model(str(folders["llama"]), dtype="float16" if change == "float16" else "float32", device="cpu")
    cache = model.new_cache(1, 8)
    with torch.inference_mode():
        x = embeddings(model, 1, 3, seed=13)
        if change != "float16":
            run_layers_c(model, x, chain(0, 3), cache)
    if change == "library":
        use_kernels(model, "library")
    if change == "own forward":
        model.layers[1] = OwnForward(model.config)
    if change == "no cache":
        cache = None
    lengths = None if cache is None else cache.lengths.clone()
    with torch.enable_grad() if change == "grad" else torch.inference_mode():
        assert cpu_layer.run_layers_cpu(model.layers, x, chain(3, 3), cache, None, model.inv_freq, 1.0, None) is None
        assert reason in cpu_layer.unsupported(model.layers, x, cache)
        if change in ("grad", "float16", "library"):  # the final norm and logits too
            assert cpu_layer.norm_and_logits(model.norm, model.lm_head, x, None) is None
    assert cache is None or torch.equal(cache.lengths, lengths)


@pytest.mark.parametrize("change", ["norm replaced", "weights repacked"])
def test_a_change_after_a_first_forward_is_read_by_the_next(folders, change):
    """The C code's prepared arguments (cpu_layer.prepare) follow a norm module replaced and a Linear
    repacked after a forward has prepared them: the next forward equals the PyTorch path, not the old
    weights' output (the old packs are still alive: reading them would not crash)."""
    import copy

    from specdec.models.linear import use_cpu_kernels

    model = load_model(str(folders["llama"]), dtype="float32", device="cpu")
    with torch.inference_mode():
        x = embeddings(model, 1, 3, seed=16)
        before = run_layers_c(model, x, chain(0, 3), model.new_cache(1, 8))
        if change == "norm replaced":
            norm = copy.deepcopy(model.layers[0].input_layernorm)
            norm.weight.mul_(3)
            model.layers[0].input_layernorm = norm
        else:
            model.layers[0].mlp.down_proj.weight.mul_(3)
            use_cpu_kernels(model)
        after = run_layers_c(model, x, chain(0, 3), model.new_cache(1, 8))
        reference = run_layers_torch(model, x, chain(0, 3), model.new_cache(1, 8))
    assert_near(after, reference, torch.float32)
    assert not torch.allclose(after, before, atol=1e-3)


@torch.inference_mode()
def test_a_forward_past_the_cache_fails_loudly_and_writes_nothing(model):
    cache = model.new_cache(2, 8)
    cache.lengths.copy_(torch.tensor([2, 6]))
    k = cache.k.clone()
    with pytest.raises(UserError, match="exceed the KV cache of 8 slots"):
        run_layers_c(model, embeddings(model, 2, 3, seed=14), chain(cache.lengths, 3), cache)
    assert torch.equal(cache.k, k) and cache.lengths.tolist() == [2, 6]


def test_run_layers_is_still_the_reference(model):
    """run_layers_torch mirrors llama.run_layers's PyTorch path (if run_layers dispatches to the C path,
    this compares the two within rounding instead)."""
    with torch.inference_mode():
        x = embeddings(model, 2, 5, seed=15)
        caches = [model.new_cache(2, 5) for _ in range(2)]
        ours = run_layers_torch(model, x, chain(0, 5, 2), caches[0])
        theirs = run_layers(model.layers, x, chain(0, 5, 2), caches[1], None, model.inv_freq, model.rope_attention_factor, None)
    assert_near(ours, theirs, x.dtype)

"""Exact greedy decoding on the CPU: every per-token output of the native model (logits, hidden state)
is bitwise the same whether the token is computed alone (a plain decoding step), inside a verify
block, inside a tree, or in a batch, in float32 and in bfloat16; the attention kernel on its own; and
the hygiene of the kernels' build (cache key, unwritable or noexec cache, missing compiler, portable C).

The models here keep their random logits unsharpened (logit_scale 1): near-ties are everywhere, so
one differing bit shows. The model tests do fail without the kernels (checked on a 2-core AMD EPYC,
torch 2.13): with every Linear unpacked (F.linear and scaled_dot_product_attention run), the verify
block differs from plain decoding from T = 2 in float32 and from T = 10 in bfloat16, and the tree and
batch tests fail in both; SDPA alone (linear kernels on) fails them the same way.

CPU-only: they run on the CPU whatever SPECDEC_TEST_DEVICE says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, build_hf, save_hf, two_branch_tree
from specdec.models import cpu_attention, cpu_gemm, cpu_layer, cpu_quant, load_model
from specdec.models.linear import Linear, use_cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler: the CPU kernels could not be built")

DTYPES = [torch.float32, torch.bfloat16]


def tokens(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- attention ----------------------------------------------------------------------------------

def causal_mask(B: int, L: int, T: int) -> torch.Tensor:
    """[B, 1, T, L + T]: a verify block after a committed prefix of L slots."""
    return torch.ones(L + T, L + T, dtype=torch.bool).tril()[L:].expand(B, 1, T, L + T)


def tree_mask(B: int, L: int, T: int, seed: int) -> torch.Tensor:
    """[B, 1, T, L + T]: a random tree per row (node i's parent is one of nodes 0 .. i-1); a node sees
    the prefix, its ancestors and itself."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, 1, T, L + T, dtype=torch.bool)
    mask[..., :L] = True
    for b in range(B):
        for i in range(T):
            mask[b, 0, i, L + i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                mask[b, 0, i, L : L + i] = mask[b, 0, parent, L : L + i]
                mask[b, 0, i, L + parent] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["causal", "tree"])
@pytest.mark.parametrize("heads", [(6, 2, 64), (3, 3, 20)], ids=["gqa-dh64", "mha-dh20"])  # (H, Hkv, Dh)
def test_each_query_gets_the_bits_it_gets_alone(dtype, layout, heads):
    """Each query of a block (any T, B) equals, bitwise, that query computed alone over just the keys
    it sees, packed together (as plain decoding lays out a tree's accepted path); and SDPA within
    rounding."""
    H, Hkv, Dh = heads
    L = 13
    for B in (1, 3):
        for T in (1, 2, 5, 11, 16, 33):
            seed = 1000 * B + T
            q = randn(B, T, H, Dh, dtype=dtype, seed=seed).transpose(1, 2)  # [B, H, T, Dh] (strided, as after RoPE)
            k = randn(B, Hkv, L + T + 7, Dh, dtype=dtype, seed=seed + 1)  # [B, Hkv, S_max, Dh]: slack slots past S
            v = randn(B, Hkv, L + T + 7, Dh, dtype=dtype, seed=seed + 2)
            mask = causal_mask(B, L, T) if layout == "causal" else tree_mask(B, L, T, seed)  # [B, 1, T, S]
            S = L + T
            out = cpu_attention.attend(q, k[:, :, :S], v[:, :, :S], mask)  # [B, H, T, Dh]
            ref = F.scaled_dot_product_attention(q.float(), k[:, :, :S].float(), v[:, :, :S].float(), attn_mask=mask, enable_gqa=True)
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(out.float(), ref, **tol)
            for b in range(B):
                for t in range(T):
                    seen = mask[b, 0, t].nonzero()[:, 0]  # [n] slots in order
                    alone = cpu_attention.attend(q[b : b + 1, :, t : t + 1], k[b : b + 1, :, seen], v[b : b + 1, :, seen],
                                                 torch.ones(1, 1, 1, len(seen), dtype=torch.bool))  # [1, H, 1, Dh]
                    assert torch.equal(alone[0, :, 0], out[b, :, t]), (B, T, b, t)


def test_a_query_that_sees_nothing_gets_zeros():
    q, k = randn(1, 2, 3, 16, dtype=torch.float32, seed=1), randn(1, 2, 5, 16, dtype=torch.float32, seed=2)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = cpu_attention.attend(q, k, k, mask)  # [1, 2, 3, 16]
    assert torch.count_nonzero(out[:, :, 1]) == 0 and torch.count_nonzero(out[:, :, 0]) > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_bits_do_not_depend_on_threads(dtype):
    q = randn(3, 6, 33, 64, dtype=dtype, seed=1)  # [B, H, T, Dh], enough work to run on several threads
    k, v = randn(3, 2, 90, 64, dtype=dtype, seed=2), randn(3, 2, 90, 64, dtype=dtype, seed=3)
    mask = causal_mask(3, 57, 33)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(cpu_attention.attend(q, k, v, mask))
    assert torch.equal(*outs)


def test_gemm_bits_do_not_depend_on_threads_or_blocking():
    """A product large enough to be split into L2-sized blocks over 2 threads gives each row the bits
    of that row alone on 1 thread."""
    for dtype in DTYPES:
        w, x = randn(2000, 576, dtype=dtype, seed=4), randn(40, 576, dtype=dtype, seed=5)
        packed = cpu_gemm.pack(w)
        torch.set_num_threads(1)
        alone = torch.cat([cpu_gemm.gemm(x[i : i + 1], packed, None, 2000) for i in range(len(x))])
        torch.set_num_threads(2)
        assert torch.equal(cpu_gemm.gemm(x, packed, None, 2000), alone), dtype


def test_every_number_of_rows_gives_each_row_its_bits_alone():
    """1 to 17 rows (a plain step, verify blocks, trees, small batches): each row gets the bits it gets alone,
    whichever kernel its chunk of rows runs (the one-row kernel over 4 panels, the 6-row kernels, and with
    AVX-512 the float32 16-row ones, which a verify block of 7-16 tokens takes; block weights' 16-row
    kernels: test_gguf_native)."""
    for dtype in DTYPES:
        w, x = randn(96, 576, dtype=dtype, seed=17), randn(17, 576, dtype=dtype, seed=18)
        packed = cpu_gemm.pack(w)
        bias = cpu_gemm.pad_bias(randn(96, dtype=torch.float32, seed=19), packed)
        alone = torch.cat([cpu_gemm.gemm(x[i : i + 1], packed, bias, 96) for i in range(len(x))])
        for M in range(1, len(x) + 1):
            assert torch.equal(cpu_gemm.gemm(x[:M], packed, bias, 96), alone[:M]), (dtype, M)


# --- the model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama (GQA: 4 query heads, 2 key/value heads), logits not sharpened."""
    return save_hf(build_hf("llama", seed=0), tmp_path_factory.mktemp("exact") / "llama")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, folder):
    native = load_model(str(folder), dtype=request.param, device="cpu")
    assert native.layers[0].self_attn.o_proj.packed is not None  # the exact path is on
    return native


def chain(start: int, length: int, rows: int = 1) -> torch.Tensor:  # positions [rows, length]
    return torch.arange(start, start + length)[None].expand(rows, -1)


def decode_plainly(model, prefix: torch.Tensor, new: torch.Tensor):
    """Logits [1, N, V] and hidden states [1, N, D] of new [1, N] fed one token at a time after prefix [1, P]."""
    P = prefix.shape[1]
    cache = model.new_cache(1, P + new.shape[1])
    model(prefix, chain(0, P), cache)
    outs = [model(new[:, i : i + 1], chain(P + i, 1), cache) for i in range(new.shape[1])]
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.hidden for o in outs], 1)


@pytest.mark.parametrize("path", ["c-layers", "pytorch-glue"])
def test_a_verify_block_gives_each_token_the_bits_of_plain_decoding(model, monkeypatch, path):
    """Both CPU paths: whole layers in one C call (cpu_layer.c), and the C kernels glued by PyTorch ops."""
    calls = []
    if path == "c-layers":
        run = cpu_layer.run_layers_cpu
        monkeypatch.setattr(cpu_layer, "run_layers_cpu", lambda *a: calls.append(1) or run(*a))
    else:
        monkeypatch.setattr(cpu_layer, "run_layers_cpu", lambda *a: None)
        monkeypatch.setattr(cpu_attention, "attend", lambda *a, _attend=cpu_attention.attend: calls.append(1) or _attend(*a))
    prefix, new = tokens(1, 6, seed=1), tokens(1, 17, seed=2)
    logits, hidden = decode_plainly(model, prefix, new)
    for T in range(1, 18):
        cache = model.new_cache(1, 6 + T)
        model(prefix, chain(0, 6), cache)
        block = model(new[:, :T], chain(6, T), cache)
        assert torch.equal(block.logits, logits[:, :T]), T
        assert torch.equal(block.hidden, hidden[:, :T]), T
    assert calls  # the exact kernels ran, not MKL and SDPA


def test_a_tree_gives_its_accepted_path_the_bits_of_plain_decoding(model):
    branches, depths, mask = two_branch_tree()
    prefix, nodes = tokens(1, 7, seed=3), tokens(1, 9, seed=4)
    cache = model.new_cache(1, 16)
    model(prefix, chain(0, 7), cache)
    tree = model(nodes, 7 + depths[None], cache, mask=mask[None])
    for branch in branches:
        logits, hidden = decode_plainly(model, prefix, nodes[:, branch])
        assert torch.equal(tree.logits[:, branch], logits), branch
        assert torch.equal(tree.hidden[:, branch], hidden), branch


def test_a_batch_of_32_gives_each_row_the_bits_it_gets_alone(model):
    """32 rows with ragged committed prefixes, then a verify block of 5 (batch 32 x gamma 4)."""
    B, P, T = 32, 8, 5
    prompts, blocks = tokens(B, P, seed=5), tokens(B, T, seed=6)
    lengths = torch.randint(3, P + 1, (B,), generator=torch.Generator().manual_seed(7))  # [B]
    cache = model.new_cache(B, P + T)
    prefill = model(prompts, chain(0, P, B), cache).logits  # [B, P, V]
    cache.trim(lengths)
    batch = model(blocks, lengths[:, None] + torch.arange(T), cache)
    for b in range(B):
        n = int(lengths[b])
        alone_cache = model.new_cache(1, n + T)
        alone_prefill = model(prompts[b : b + 1, :n], chain(0, n), alone_cache).logits  # [1, n, V]
        alone = model(blocks[b : b + 1], chain(n, T), alone_cache)
        assert torch.equal(prefill[b, :n], alone_prefill[0]), b
        assert torch.equal(batch.logits[b], alone.logits[0]), b
        assert torch.equal(batch.hidden[b], alone.hidden[0]), b


# --- the build ----------------------------------------------------------------------------------

@pytest.fixture
def fresh_build(monkeypatch):
    """library() builds afresh and its notes print again; the usual library is back afterwards."""
    cpu_gemm.library.cache_clear()
    cpu_gemm.say_once.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_gemm.library.cache_clear()
    cpu_gemm.say_once.cache_clear()
    assert cpu_gemm.available()


def test_the_cache_key_is_the_cpu_model_and_flags(fresh_build, capsys):
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("flags")), None)
    if flags:
        assert flags in cpu_gemm.cpu_identity()
    names = []

    def record(folder, name, compiler, flags):
        names.append(name)
        raise OSError("read-only")

    fresh_build.setattr(cpu_gemm, "compile_into", record)
    for identity in ("AMD EPYC | fpu avx2 fma", "AMD EPYC | fpu avx2 fma avx512f", "Intel Xeon | fpu avx2 fma"):
        fresh_build.setattr(cpu_gemm, "cpu_identity", lambda identity=identity: identity)
        cpu_gemm.library.cache_clear()
        assert cpu_gemm.library() is None
    assert len(names) == 6 and len(set(names)) == 3  # the cache, then the temporary folder: one name per CPU
    capsys.readouterr()


def test_an_unwritable_cache_builds_in_a_temporary_folder(fresh_build, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    fresh_build.setenv("SPECDEC_CACHE", str(tmp_path / "file" / "cache"))
    status = cpu_gemm.build_status()
    assert status["available"] and status["error"] is None and not status["library"].startswith(str(tmp_path))
    err = capsys.readouterr().err
    assert err.count("specdec: CPU kernel cache") == 1 and "unusable" in err
    layer = Linear(8, 8)
    assert use_cpu_kernels(layer) and layer.packed is not None


def test_a_noexec_cache_builds_in_a_temporary_folder(fresh_build, capsys):
    load, cache = cpu_gemm.load, str(cpu_gemm.cache_root())

    def noexec(path):
        if str(path).startswith(cache):
            raise OSError(f"{path}: failed to map segment from shared object")
        return load(path)

    fresh_build.setattr(cpu_gemm, "load", noexec)
    status = cpu_gemm.build_status()
    assert status["available"] and not status["library"].startswith(cache)
    assert capsys.readouterr().err.count("specdec: CPU kernel cache") == 1


@pytest.mark.parametrize("why", ["no compiler", "nowhere to build"])
def test_no_kernel_is_said_once_and_reported(fresh_build, capsys, why):
    if why == "no compiler":
        fresh_build.setattr(cpu_gemm.shutil, "which", lambda name: None)
    else:
        fresh_build.setattr(cpu_gemm, "compile_into", lambda *args: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
    for _ in range(3):
        assert not cpu_gemm.available()
    status = cpu_gemm.build_status()
    assert status == {"available": False, "isa": None, "int_dot": None, "library": None, "error": status["error"]} and status["error"]
    err = capsys.readouterr().err
    assert err.count("specdec: CPU kernel unavailable") == 1 and "greedy speculative output may differ" in err
    layer = Linear(8, 8)
    assert not use_cpu_kernels(layer) and layer.packed is None


def test_the_portable_build_is_exact_too(fresh_build):
    """Without -march=native (x86-64 baseline: no AVX2), the portable C kernels keep the same guarantees."""
    fresh_build.setattr(cpu_gemm, "FLAGS", [f for f in cpu_gemm.FLAGS if f != "-march=native"])
    assert cpu_gemm.build_status()["isa"] == "portable"
    for dtype in DTYPES:
        w, x = randn(40, 72, dtype=dtype, seed=8), randn(33, 72, dtype=dtype, seed=9)
        for packed, scales in [(cpu_gemm.pack(w), None), cpu_gemm.pack_int8(w)]:
            bias = cpu_gemm.pad_bias(randn(40, dtype=torch.float32, seed=10), packed)
            block = cpu_gemm.gemm(x, packed, bias, 40, scales)  # [33, 40]
            assert torch.equal(block, torch.cat([cpu_gemm.gemm(x[i : i + 1], packed, bias, 40, scales) for i in range(33)]))
            ref_w = w if scales is None else cpu_gemm.dequantize(packed, scales, 40)
            ref = F.linear(x.float(), ref_w.float(), bias[:40]).to(dtype)
            torch.testing.assert_close(block.float(), ref.float(), atol=2e-2, rtol=1e-2)
        for qtype in ("Q4_0", "Q4_1", "Q8_0"):  # GGUF blocks: the float32 kernel's bits on gguf's dequantised weight
            from gguf import GGMLQuantizationType, quants

            raw = quants.quantize(randn(40, 96, dtype=torch.float32, seed=15).numpy(), GGMLQuantizationType[qtype])
            blocks = cpu_quant.pack_blocks(torch.from_numpy(raw), qtype)
            w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]))
            assert torch.equal(cpu_quant.dequantize(blocks, qtype, 40, 96), w)
            xq = randn(9, 96, dtype=dtype, seed=16)
            for M in (1, 3, 9):
                assert torch.equal(cpu_gemm.gemm(xq[:M], blocks, None, 40, qtype=qtype), cpu_gemm.gemm(xq[:M], cpu_gemm.pack(w), None, 40))
        q = randn(2, 4, 11, 20, dtype=dtype, seed=11)  # [B, H, T, Dh]
        k, v = randn(2, 2, 24, 20, dtype=dtype, seed=12), randn(2, 2, 24, 20, dtype=dtype, seed=13)  # [B, Hkv, S, Dh]
        mask = tree_mask(2, 13, 11, seed=14)
        out = cpu_attention.attend(q, k, v, mask)
        for t in range(11):
            assert torch.equal(cpu_attention.attend(q[:, :, t : t + 1], k, v, mask[:, :, t : t + 1])[:, :, 0], out[:, :, t])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_forward_check_on_a_random_model_of_given_shape(dtype):
    """kernels.block_equals_steps (what benchmarks/kernels.py reports) on models.llama.random_llama: true
    on the exact C path, in float32 and bfloat16, at a context past the kernels' first blocks."""
    from specdec.models.kernels import block_equals_steps, use_kernels
    from specdec.models.llama import ModelConfig, random_llama

    c = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                    max_position_embeddings=512)
    model = random_llama(c, "cpu", dtype)
    assert use_kernels(model, "exact").name == "cpu-exact"
    assert block_equals_steps(model, k=5, contexts=(8, 300))

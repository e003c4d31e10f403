"""GGUF targets in their own quantised formats on the CPU (specdec/models/cpu_quant.py, gguf_native.py).

- Kernel parity with gguf's reference: dequantised weights bitwise equal to gguf.quants.dequantize,
  products bitwise equal to the float32 kernel on those weights for any number of rows and threads
  (so within float32 rounding of the exact product), the repacking a bijection.
- Greedy equality for every drafter on a quantised tiny model whose logits are not sharpened (near-ties
  everywhere): the quantised target is the model whose output is preserved.
- The embedded default model loads natively, bit for bit the model transformers dequantises.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import specdec
from conftest import DEVICE, build_hf, save_hf
from specdec.drafters import DrafterOptions
from specdec.errors import UserError
from specdec.models import cpu_gemm, cpu_quant, load_model
from specdec.models.kernels import kernel_path
from specdec.models.linear import Linear, float_weight, quantize_blocks, take_rows
from test_exact_decoding import MAX_NEW, PROMPTS, make

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE != "cpu" or not cpu_gemm.available(), reason="the quantised kernels run on the CPU")
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_rows(N: int, K: int, qtype: str, seed: int) -> np.ndarray:
    """A random [N, K] weight quantised by gguf's reference quantiser: uint8 rows as a GGUF file holds them."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    return quants.quantize(w, GGMLQuantizationType[qtype])


@pytest.mark.parametrize("qtype", FORMATS)
def test_dequantised_weights_are_gguf_reference_bits(qtype):
    raw = gguf_rows(40, 96, qtype, seed=1)  # 40 outputs: not a multiple of the 16-column panel
    packed = cpu_quant.pack_blocks(torch.from_numpy(raw), qtype)
    ref = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]))
    assert torch.equal(cpu_quant.dequantize(packed, qtype, 40, 96), ref)
    assert torch.equal(cpu_quant.unpack_blocks(packed, qtype, 40), torch.from_numpy(raw))
    rows = torch.tensor([39, 0, 17, 16])
    assert torch.equal(cpu_quant.dequantize(cpu_quant.take_rows(packed, qtype, 40, rows), qtype, 4, 96), ref[rows])


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_products_equal_the_float32_kernel_for_any_number_of_rows(qtype, threads):
    """Rows 1-6 run the block kernels, 1 row runs WIDE panels, 7+ run chunks of 16 rows (AVX-512) or
    dequantise panels first: every path gives a row the float32 kernel's bits on the dequantised weight,
    alone or beside others (33 rows: two full chunks of 16 and one row)."""
    torch.set_num_threads(threads)
    N, K = 72, 128
    raw = gguf_rows(N, K, qtype, seed=2)
    packed = cpu_quant.pack_blocks(torch.from_numpy(raw), qtype)
    w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]))
    bias = cpu_gemm.pad_bias(torch.randn(N), packed)
    x = torch.randn(33, K, generator=torch.Generator().manual_seed(3))
    for M in [*range(1, 18), 23, 32, 33]:
        y = cpu_gemm.gemm(x[:M], packed, bias, N, qtype=qtype)
        assert torch.equal(y, cpu_gemm.gemm(x[:M], cpu_gemm.pack(w), bias, N))
        assert torch.equal(y[-1], cpu_gemm.gemm(x[M - 1 : M], packed, bias, N, qtype=qtype)[0])
    exact = F.linear(x.double(), w.double(), bias[:N].double())
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-4)
    for bf16 in (torch.bfloat16,):  # bfloat16 activations through the same panels
        yb = cpu_gemm.gemm(x.to(bf16), packed, bias, N, qtype=qtype)
        assert torch.equal(yb, cpu_gemm.gemm(x.to(bf16), cpu_gemm.pack(w), bias, N))


def quantise_native(model, qtype: str):
    """A native model quantised as a GGUF file of `qtype` would be: every linear layer and the (tied)
    embedding as block panels; norms stay float."""
    for module in list(model.modules()):
        if isinstance(module, Linear) and module is not model.lm_head:
            quantize_blocks(module, module, qtype)
    embed = model.embed_tokens.weight.detach()
    raw = quants.quantize(embed.float().numpy(), GGMLQuantizationType[qtype])
    packed = cpu_quant.pack_blocks(torch.from_numpy(raw), qtype)
    model.embed_tokens = cpu_quant.QuantizedEmbedding(packed, qtype, *embed.shape, embed.dtype)
    head = model.lm_head
    head.packed, head.qtype, head.weight = packed, qtype, torch.nn.Parameter(torch.empty(0), requires_grad=False)
    return model


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """(Q4_1 target, draft, plain greedy outputs): unsharpened tiny models (near-ties everywhere)."""
    tmp = tmp_path_factory.mktemp("q41")
    target = load_model(str(save_hf(build_hf("llama", seed=0, num_hidden_layers=3, tie_word_embeddings=True), tmp / "t")),
                        dtype="float32", device=DEVICE, kernels="exact")
    quantise_native(target, "Q4_1")
    draft = load_model(str(save_hf(build_hf("llama", seed=1, num_hidden_layers=1), tmp / "d")), dtype="float32", device=DEVICE)
    assert kernel_path(target).exact and kernel_path(target).weights == "Q4_1 x 13"
    plain = specdec.SpecEngine(target, "none").generate(PROMPTS, specdec.SpecConfig(max_new_tokens=MAX_NEW))
    return target, draft, [r.token_ids for r in plain.rows]


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle", "medusa", "lookahead", "layer_skip", "suffix", "quantized"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_speculation_on_a_quantised_target_equals_its_plain_decoding(quantised, name, gamma):
    target, draft, plain = quantised
    drafter = make(name, target, draft)
    options = DrafterOptions(extra={"quant_format": "Q4_0"} if name == "quantized" else {})
    engine = specdec.SpecEngine(target, drafter, options) if isinstance(drafter, str) else specdec.SpecEngine(target, drafter)
    out = engine.generate(PROMPTS, specdec.SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == plain
    assert out.stats.drafted > 0


def test_a_quantised_target_is_the_model_preserved_not_its_float_original(tmp_path):
    """The power of the equality above: on these near-tie models, Q4_1 and float32 decode differently."""
    hf = save_hf(build_hf("llama", seed=0, num_hidden_layers=3, tie_word_embeddings=True), tmp_path / "t")
    floats = load_model(str(hf), dtype="float32", device=DEVICE)
    q = quantise_native(load_model(str(hf), dtype="float32", device=DEVICE), "Q4_1")
    config = specdec.SpecConfig(max_new_tokens=MAX_NEW)
    a = specdec.SpecEngine(floats, "none").generate(PROMPTS, config)
    b = specdec.SpecEngine(q, "none").generate(PROMPTS, config)
    assert [r.token_ids for r in a.rows] != [r.token_ids for r in b.rows]


def test_quantized_drafter_defaults_to_a_cheaper_format(quantised):
    target = quantised[0]
    with pytest.raises(UserError, match="already runs Q4_1"):
        specdec.SpecEngine(target, "quantized")


def test_drafters_borrow_quantised_rows_without_dequantising(quantised):
    target = quantised[0]
    rows = torch.tensor([5, 0, 95])
    head = take_rows(target.lm_head, rows, torch.float32)
    assert head.qtype == "Q4_1" and torch.equal(float_weight(head), float_weight(target.lm_head)[rows])
    floats = take_rows(target.lm_head, rows, torch.float32, dequantize=True)
    assert floats.qtype is None and torch.equal(floats.weight, float_weight(head))
    assert torch.equal(target.embed_tokens(rows), float_weight(target.lm_head)[rows])


@pytest.mark.slow
def test_the_default_model_runs_natively_and_bitwise_as_transformers_dequantises_it():
    from safetensors.torch import load_file

    native = load_model("default", device="cpu")
    assert native.layers[0].mlp.down_proj.qtype == "Q4_1" and native.lm_head.qtype == "Q8_0"
    assert kernel_path(native).weights == "Q4_1 x 120, Q8_0 x 1"
    ref = load_file(load_model.__globals__["hf_folder"](native) + "/model.safetensors")
    qkv = torch.cat([ref[f"model.layers.7.self_attn.{x}_proj.weight"] for x in "qkv"])  # q, k un-permuted
    assert torch.equal(float_weight(native.layers[7].self_attn.qkv_proj), qkv)
    assert torch.equal(native.embed_tokens(torch.arange(64)), ref["model.embed_tokens.weight"][:64])
    floats = load_model("default", device="cpu", gguf="dequantize")
    assert kernel_path(floats).weights == "float32 x 121"
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 28, 17]])
    with torch.inference_mode():
        a = native(ids, torch.arange(8)[None], native.new_cache(1, 16))
        b = floats(ids, torch.arange(8)[None], floats.new_cache(1, 16))
    assert torch.equal(a.logits, b.logits)


def test_bad_gguf_input_gives_one_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(UserError, match="not a readable GGUF"):
        load_model(str(bad), device="cpu")
    folder = save_hf(build_hf("llama", seed=0), tmp_path / "f")
    with pytest.raises(UserError, match="runs GGUF files"):
        load_model(str(folder), device="cpu", gguf="native")
    with pytest.raises(UserError, match="unknown gguf mode"):
        load_model(str(folder), device="cpu", gguf="int3")

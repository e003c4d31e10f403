"""The quantized drafter's integer path (specdec/models/int_dot.c, formats Q4_0-A8 and Q4_1-A8): 4-bit
blocks times activations quantised to int8 per block of 32.

- Kernel: against a float64 NumPy reference of the same quantised arithmetic (the activations rounded
  as the C code rounds them, exact integer block sums, the scales), within float32 rounding; on several
  K, N, M, threads 1 and 2, float32 and bfloat16 activations, and the portable (no AVX2) build. A row's
  output is bitwise the same alone, in a block of rows and on any threads. The tolerance is far below
  the activations' rounding, which the test checks, so a kernel that skipped it would fail.
- The drafter: greedy speculative output equals plain decoding (gamma 2 and 4, float32 and bfloat16
  targets, a quantised target); sampled output follows plain sampling's distribution, and a verifier
  that keeps every draft is caught; the draft's kernel path is reported; the CLI refuses bad
  combinations with one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import specdec
from conftest import DEVICE, build_hf, save_hf, tiny_folder_with_tokenizer, tiny_pair
from specdec.cli import main
from specdec.drafters import DrafterOptions
from specdec.errors import UserError
from specdec.models import cpu_gemm, cpu_quant, load_model
from specdec.models.kernels import draft_kernel_path
from specdec.models.views import HEAD_FORMATS
from test_engine import MAX_NEW, PROMPTS
from test_gguf_native import quantise_native
from test_sampling_e2e import ALPHA, PROMPT, ROWS, VOCAB, always_accept, distribution_pvalues, tokens_of

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE != "cpu" or not cpu_gemm.available(), reason="the integer kernels run on the CPU")
FORMATS = ["Q4_0-A8", "Q4_1-A8"]
SHAPES = [(32, 16, 1), (64, 40, 1), (96, 48, 3), (576, 160, 2), (128, 33, 5), (1536, 64, 8), (256, 80, 13)]  # (K, N, M)


def gguf_rows(N: int, K: int, fmt: str, seed: int) -> np.ndarray:
    """A random [N, K] weight as gguf's reference quantiser stores it in fmt's GGUF type: uint8 rows."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    return quants.quantize(w, GGMLQuantizationType[cpu_quant.FORMATS[fmt].gguf])


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    """x [M, K] with blocks of every kind: ordinary, large, tiny, all zero (scale 0), one value only."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[0, :32] *= 1e3
    if K >= 64:
        x[0, 32:64] = 0.0
    if M > 1:
        x[1, :32] *= 1e-4
        x[1, -32:] = 0.0
        x[1, -1] = -2.5
    return x


def reference(x: torch.Tensor, raw: np.ndarray, fmt: str) -> np.ndarray:
    """[M, N] float64: int_dot.c's arithmetic without its float32 roundings. The activations are rounded
    as the kernel rounds them (float32 d = max|x| / 127, q = rint(x * (1 / d))); the weights are read
    from the GGUF blocks (d, m float16; nibbles: element i low, element i + 16 high)."""
    q4_1 = cpu_quant.FORMATS[fmt].gguf == "Q4_1"
    N, K = raw.shape[0], x.shape[1]
    nb = K // 32
    blocks = raw.reshape(N, nb, -1)  # [N, nb, 18 or 20]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, nb]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if q4_1 else None
    nibbles = blocks[..., 4 if q4_1 else 2:]  # [N, nb, 16]
    qw = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.float64)  # [N, nb, 32]
    xb = x.float().numpy().reshape(-1, nb, 32)  # [M, nb, 32] float32
    dx = np.abs(xb).max(-1) / np.float32(127)  # [M, nb] float32
    inverse = np.divide(np.float32(1), dx, out=np.zeros_like(dx), where=dx != 0)
    qx = np.rint(xb * inverse[..., None]).astype(np.float64)  # [M, nb, 32]
    dots = np.einsum("mbk,nbk->mnb", qx, qw)  # [M, N, nb] exact
    if not q4_1:
        dots -= 8 * qx.sum(-1)[:, None, :]
    y = np.einsum("mnb,nb,mb->mn", dots, d, dx.astype(np.float64))
    if q4_1:
        y += np.einsum("nb,mb->mn", m, xb.astype(np.float64).sum(-1))
    return y


def product(x: torch.Tensor, raw: np.ndarray, fmt: str, bias: torch.Tensor | None = None, threads: int = 1,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    packed = cpu_quant.pack_blocks(torch.from_numpy(raw), fmt)
    padded_bias = cpu_gemm.pad_bias(bias, packed)
    cpu_gemm.KERNEL_THREADS[0] = threads
    try:
        return cpu_gemm.gemm(x, packed, padded_bias, raw.shape[0], qtype=fmt, out_dtype=out_dtype)
    finally:
        cpu_gemm.KERNEL_THREADS[0] = 0


def check_against_reference(fmt: str, K: int, N: int, M: int, seed: int) -> None:
    raw, x = gguf_rows(N, K, fmt, seed), activations(M, K, seed + 1)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(seed + 2))
    ref = torch.from_numpy(reference(x, raw, fmt)) + bias.double()  # [M, N]
    y = product(x, raw, fmt, bias)
    scale = ref.abs().amax(dim=1, keepdim=True)  # per row: rows differ in magnitude by 1e7
    assert ((y.double() - ref).abs() <= 2e-6 * scale + 1e-30).all(), (y.double() - ref).abs().max()
    assert torch.equal(product(x, raw, fmt, bias, threads=2), y)
    assert torch.equal(torch.cat([product(x[i : i + 1], raw, fmt, bias) for i in range(M)]), y)
    floats = x @ cpu_quant.dequantize(cpu_quant.pack_blocks(torch.from_numpy(raw), fmt), fmt, N, K).T + bias
    assert ((floats.double() - ref).abs() > 1e-4 * scale).any()  # the activations' rounding shows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("K,N,M", SHAPES)
def test_products_match_the_quantised_arithmetic(fmt, K, N, M):
    check_against_reference(fmt, K, N, M, seed=K + N + M)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_activations_and_outputs(fmt):
    """bfloat16 x is widened exactly, then quantised; a bfloat16 output is the float32 result rounded."""
    raw, x = gguf_rows(48, 128, fmt, 5), activations(3, 128, 6).bfloat16()
    y32 = product(x.float(), raw, fmt)
    assert torch.equal(product(x, raw, fmt, out_dtype=torch.float32), y32)
    assert torch.equal(product(x, raw, fmt), y32.bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_panels_hold_the_gguf_blocks(fmt):
    """Repacking is a bijection, dequantising gives gguf's weights, and rows can be taken from the panels."""
    raw = gguf_rows(40, 96, fmt, 7)
    packed = cpu_quant.pack_blocks(torch.from_numpy(raw), fmt)
    assert packed.shape == (3, 3 * cpu_quant.FORMATS[fmt].panel_block_bytes)
    assert torch.equal(cpu_quant.unpack_blocks(packed, fmt, 40), torch.from_numpy(raw))
    gguf_weight = quants.dequantize(raw, GGMLQuantizationType[cpu_quant.FORMATS[fmt].gguf])
    assert torch.equal(cpu_quant.dequantize(packed, fmt, 40, 96), torch.from_numpy(gguf_weight))
    rows = torch.tensor([39, 0, 17])
    assert torch.equal(cpu_quant.take_rows(packed, fmt, 40, rows), cpu_quant.pack_blocks(torch.from_numpy(raw[rows.numpy()]), fmt))


@pytest.fixture
def portable(monkeypatch):
    """The kernels built without -march=native (x86-64 baseline: no AVX2); the usual build afterwards."""
    cpu_gemm.library.cache_clear()
    cpu_gemm.say_once.cache_clear()
    monkeypatch.setattr(cpu_gemm, "FLAGS", [f for f in cpu_gemm.FLAGS if f != "-march=native"])
    assert cpu_gemm.build_status()["isa"] == "portable"
    yield
    monkeypatch.undo()
    cpu_gemm.library.cache_clear()
    cpu_gemm.say_once.cache_clear()
    assert cpu_gemm.available()


def test_the_portable_build_computes_the_same_arithmetic(portable, tmp_path, capsys):
    for fmt in FORMATS:
        for K, N, M in [(64, 40, 1), (96, 48, 3), (576, 160, 2), (256, 80, 13)]:
            check_against_reference(fmt, K, N, M, seed=K + N + M)
    target = tiny_pair(tmp_path, "llama", seed=0, logit_scale=8.0)[0]
    capsys.readouterr()
    config = specdec.SpecConfig(gamma=4, max_new_tokens=MAX_NEW)
    plain = specdec.SpecEngine(target, "none").generate(PROMPTS, config)
    for _ in range(2):
        out = specdec.SpecEngine(target, "quantized", DrafterOptions(extra={"quant_format": "Q4_1-A8"})).generate(PROMPTS, config)
        assert [r.token_ids for r in out.rows] == [r.token_ids for r in plain.rows] and out.stats.drafted > 0
    assert capsys.readouterr().err.count("Q4_1-A8 draft: no AVX2 in this kernel build (portable)") == 1


@pytest.fixture
def without_vnni(monkeypatch):
    """The kernels built with VNNI switched off (AVX2's pairwise int16 sums); the usual build afterwards."""
    cpu_gemm.library.cache_clear()
    monkeypatch.setattr(cpu_gemm, "FLAGS", cpu_gemm.FLAGS + ["-mno-avxvnni", "-mno-avx512vnni"])
    yield
    monkeypatch.undo()
    cpu_gemm.library.cache_clear()
    assert cpu_gemm.available()


@pytest.mark.skipif(not cpu_gemm.available() or not cpu_gemm.build_status()["int_dot"].endswith("vnni"),
                    reason="this CPU's build has no VNNI to compare with AVX2")
def test_vnni_gives_the_bits_of_avx2(request):
    """Where the build uses VNNI (one dpbusd adds a column's 4 products into int32), its products are
    bitwise those of the AVX2 build (maddubs pairs in int16, madd at the block's end): the block sums are
    exact integers either way, and the float steps are the same."""
    cases = [(fmt, K, N, M) for fmt in FORMATS for K, N, M in [(576, 160, 1), (1536, 64, 3), (256, 80, 13)]]
    inputs = {case: (gguf_rows(case[2], case[1], case[0], sum(case[1:])), activations(case[3], case[1], 9)) for case in cases}
    with_vnni = {case: product(x, raw, case[0]) for case, (raw, x) in inputs.items()}
    request.getfixturevalue("without_vnni")
    assert cpu_gemm.build_status()["int_dot"] == "avx2"
    for case, (raw, x) in inputs.items():
        assert torch.equal(product(x, raw, case[0]), with_vnni[case]), case


# --- the drafter ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """{dtype: (a 3-layer tiny target, its plain greedy outputs)}, float32 and bfloat16; and "Q4_1": the
    float32 one's weights as Q4_1 blocks (a native GGUF's kind), unsharpened (near-ties everywhere)."""
    folder = save_hf(build_hf("llama", seed=0, logit_scale=8.0, num_hidden_layers=3), tmp_path_factory.mktemp("int-dot") / "t")
    models = {dtype: load_model(str(folder), dtype=dtype, device=DEVICE) for dtype in ("float32", "bfloat16")}
    folder = save_hf(build_hf("llama", seed=0, num_hidden_layers=3, tie_word_embeddings=True), folder.parent / "q")
    models["Q4_1"] = quantise_native(load_model(str(folder), dtype="float32", device=DEVICE, kernels="exact"), "Q4_1")
    out = {}
    for name, target in models.items():
        plain = specdec.SpecEngine(target, "none").generate(PROMPTS, specdec.SpecConfig(max_new_tokens=MAX_NEW))
        out[name] = target, [r.token_ids for r in plain.rows]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gamma", [2, 4])
@pytest.mark.parametrize("target", ["float32", "bfloat16", "Q4_1"])
def test_greedy_speculation_equals_plain_decoding(targets, fmt, gamma, target):
    model, plain = targets[target]
    engine = specdec.SpecEngine(model, "quantized", DrafterOptions(extra={"quant_format": fmt}))
    out = engine.generate(PROMPTS, specdec.SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == plain
    assert out.stats.drafted > 0 and out.stats.acceptance_rate > 0.3  # the same model in 4 bits drafts often right
    path = draft_kernel_path(engine.drafter)
    head = HEAD_FORMATS.get(fmt)  # a Q4_1 copy's head is Q4_0
    layers = f"{fmt} x 12, {head} x 1" if head else f"{fmt} x 13"  # 3 layers x 4 products, the LM head
    assert path.name == "cpu-exact" and path.weights == f"{layers}, the head's top 8 rescored in int8"
    status = cpu_gemm.build_status()
    assert f"({status['isa']}; int8 dot products: {status['int_dot']})" in path.detail and "one C call" in path.detail


@pytest.fixture(scope="module")
def sampling(tmp_path_factory):
    """(a 3-layer tiny target of VOCAB tokens, its plain samples [ROWS, 4]). Its logits are sharp (scale
    64), so the 4-bit copy's distributions differ from the target's enough (acceptance about 0.91) that
    keeping every draft shows (p about 1e-41); at scale 4 (acceptance 0.96) it did not (p 0.69). VOCAB (12)
    is not a whole number of the kernels' panels, as a vocabulary of 32001 is not: the head's logits are a
    view of wider rows."""
    target = tiny_pair(tmp_path_factory.mktemp("int-dot-sampling"), "llama", seed=0, logit_scale=64.0, vocab_size=VOCAB,
                       num_hidden_layers=3)[0]
    return target, tokens_of(sample(target, None, seed=1))


def sample(target, fmt: str | None, seed: int):
    """ROWS samples of PROMPT at temperature 1: plain (fmt None), or drafted by the 4-bit copy at gamma 3."""
    drafter, options = ("none", None) if fmt is None else ("quantized", DrafterOptions(extra={"quant_format": fmt}))
    spec = specdec.SpecConfig(gamma=3, max_new_tokens=4, sampling=specdec.SamplingParams(temperature=1.0, seed=seed))
    return specdec.SpecEngine(target, drafter, options).generate([PROMPT] * ROWS, spec)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sampled_speculation_follows_plain_sampling(sampling, fmt):
    target, plain = sampling
    out = sample(target, fmt, seed=2)
    assert 0 < out.stats.accepted < out.stats.drafted  # both acceptance and rejection were exercised
    pvalues = distribution_pvalues(tokens_of(out), plain)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues  # Bonferroni over the checks


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_verifier_that_keeps_every_draft_is_caught(sampling, fmt, monkeypatch):
    target, plain = sampling
    monkeypatch.setattr(specdec.verify, "rejection_sample", always_accept)
    pvalues = distribution_pvalues(tokens_of(sample(target, fmt, seed=2)), plain)
    assert min(pvalues.values()) < ALPHA, pvalues


def test_a_4_bit_heads_best_logits_are_rescored_by_the_targets_rows():
    """RescoredHead: the R best of the 4-bit head's logits become the int8 rows' products, the others stay.
    A near-tie the 4-bit head ranks the wrong way round comes out in the target's order."""
    from specdec.models.linear import Linear
    from specdec.models.views import RESCORED, RescoredHead

    V, D = 64, 32
    head = Linear(D, V, bias=False)
    torch.nn.init.normal_(head.weight, generator=torch.Generator().manual_seed(0))
    rescored = RescoredHead.of(head)
    int8_rows = rescored.weight.float() * rescored.scale[:, None]  # [V, D]
    assert rescored.weight.dtype == torch.int8 and (int8_rows - head.weight).abs().max() <= head.weight.abs().max() / 254
    h = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(1))  # [B, T, D]
    scores = (h @ int8_rows.T)[0, 0]  # [V] what the rows say
    a, b = scores.topk(2).indices.tolist()
    logits = scores.clone()[None, None] - 0.5 * torch.rand(V, generator=torch.Generator().manual_seed(2))
    logits[..., b], logits[..., a] = scores[a] + 0.01, scores[a] - 0.01  # the 4-bit head puts b first, just
    out = rescored.apply(logits.clone(), h)
    assert logits.argmax() == b and out.argmax() == a
    top = logits.topk(RESCORED, dim=-1).indices[0, 0]
    assert torch.allclose(out[0, 0, top], scores[top], atol=1e-5)
    rest = torch.ones(V, dtype=torch.bool)
    rest[top] = False
    assert torch.equal(out[0, 0, rest], logits[0, 0, rest])  # the others untouched


@pytest.mark.parametrize("V", [5, 64, 1003])
def test_rescoring_picks_each_rows_best_logits_lower_index_first(V):
    """The C pass behind RescoredHead, row by row ([2, 3] rows): exactly each row's R best logits are
    rescored (a tie at the R-th place keeps the lower index), in vocabularies shorter than R, of whole
    blocks of 8, and with a tail; the best may sit anywhere, the last logit included."""
    from specdec.models.views import RESCORED

    D, gen = 24, torch.Generator().manual_seed(V)
    weight = torch.randint(-127, 128, (V, D), dtype=torch.int8, generator=gen)
    scale = torch.rand(V, generator=gen) / 100
    hidden = torch.randn(2, 3, D, generator=gen)
    logits = torch.randn(2, 3, V, generator=gen)
    logits[0, 0, -1] = 10.0  # the best is the last logit
    if V > RESCORED:  # row (1, 2): a tie at the R-th place, between a lower and a higher index
        order = logits[1, 2].argsort(descending=True)
        logits[1, 2, order[RESCORED]] = logits[1, 2, order[RESCORED - 1]]
    out = cpu_gemm.rescore(logits.clone(), hidden, weight, scale, RESCORED)
    for b in range(2):
        for t in range(3):
            ranked = sorted(range(V), key=lambda v: (-float(logits[b, t, v]), v))[:RESCORED]  # best, ties by index
            chosen = torch.zeros(V, dtype=torch.bool)
            chosen[ranked] = True
            expected = (weight[ranked].float() @ hidden[b, t]) * scale[ranked]
            assert torch.allclose(out[b, t, ranked], expected, rtol=1e-5, atol=1e-6), (b, t)
            assert torch.equal(out[b, t, ~chosen], logits[b, t, ~chosen]), (b, t)


def test_a_model_without_blocks_of_32_inputs_is_refused(tmp_path):
    target = tiny_pair(tmp_path, "llama", seed=0, hidden_size=48)[0]
    with pytest.raises(UserError, match="blocks of 32 inputs, but this model has layers of 48 inputs; use int8"):
        specdec.SpecEngine(target, "quantized", DrafterOptions(extra={"quant_format": "Q4_1-A8"}))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--quant-format", "Q4_1-A8"], "--quant-format is an option of the quantized drafter, not of ngram"),
    (["bench", "--drafters", "ngram,eagle", "--quant-format", "Q4_0-A8"],
     "--quant-format is an option of the quantized drafter, not of ngram, eagle"),
])
def test_the_cli_refuses_a_format_without_the_drafter(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and err == f"specdec: error: {message}\n"


def test_the_cli_refuses_an_unknown_format(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--drafter", "quantized", "--quant-format", "Q4_1-A4"])
    assert exit_.value.code == 2 and "invalid choice: 'Q4_1-A4'" in capsys.readouterr().err


def test_generate_json_reports_the_draft_kernels(capsys, tmp_path):
    folder = tiny_folder_with_tokenizer(tmp_path)
    code, out, _ = run_cli(capsys, "generate", "the cat sat", "--model", str(folder), "--drafter", "quantized",
                           "--quant-format", "Q4_1-A8", "--gamma", "2", "--max-new-tokens", "8", "--json", "--check-lossless")
    assert code == 0
    report = json.loads(out)
    assert report["lossless"] is True
    assert report["draft_kernels"]["weights"] == "Q4_1-A8 x 8, Q4_0-A8 x 1, the head's top 8 rescored in int8" and report["kernels"]["weights"] == "float32 x 9"

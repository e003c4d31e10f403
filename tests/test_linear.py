"""specdec.models.linear.Linear and the CPU kernel (cpu_gemm / skinny_gemm.c): the same results as
F.linear, the same bits for a row whatever the number of rows beside it (what makes greedy decoding
exactly equal between plain and speculative steps, in float32 and bfloat16), and F.linear when
training.

The kernel is a CPU-only path, so most tests here run on the CPU whatever SPECDEC_TEST_DEVICE says;
the last one checks a layer on the test device (on CUDA: no packing, plain F.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from specdec.models import cpu_gemm
from specdec.models.linear import Linear, quantize_int8, use_cpu_kernels

IN, OUT = 72, 40  # OUT not a multiple of the 16-column panels: exercises the padding
ROWS = (1, 2, 5, 11, 16, 33, 64)  # 1 to 6-row chunks, the single-row 4-panel kernel, blocked large products
KINDS = ["float32", "bfloat16", "int8-float32", "int8-bfloat16"]  # weights (int8: quantised) and activations

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler: the CPU kernel could not be built")


def dtype_of(kind: str) -> torch.dtype:
    return torch.bfloat16 if kind.endswith("bfloat16") else torch.float32


def packed_linear(bias: bool, kind: str = "float32", in_features: int = IN, out_features: int = OUT) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias).to(dtype_of(kind))
    if bias:
        torch.nn.init.normal_(layer.bias)
    if kind.startswith("int8"):
        quantize_int8(layer, layer)
    else:
        assert use_cpu_kernels(layer)
    return layer


def reference(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """F.linear in float32 with the weight the layer stands for, in x's dtype."""
    weight = layer.weight if layer.scales is None else cpu_gemm.dequantize(layer.packed, layer.scales, layer.out_features)
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), weight.float(), bias).to(x.dtype)


def inputs(*shape: int, dtype=torch.float32, features: int = IN) -> torch.Tensor:  # [..., features]
    return torch.randn(*shape, features, generator=torch.Generator().manual_seed(1)).to(dtype)


def test_pack_layout():
    w = torch.arange(OUT * IN, dtype=torch.float32).view(OUT, IN)  # [N, K]
    packed = cpu_gemm.pack(w)  # [ceil(N/16), K, 16]
    assert packed.shape == (3, IN, 16) and packed.is_contiguous()
    assert torch.equal(packed[1, :, 3], w[16 + 3])  # panel 1, column 3 is output row 19
    assert torch.count_nonzero(packed[2, :, OUT - 32 :]) == 0  # padding columns are zero


def test_bfloat16_pack_layout():
    """bfloat16 panels store columns 4-7 and 8-11 of each row swapped (the order AVX2 widens them in)."""
    w = torch.arange(OUT * IN, dtype=torch.float32).view(OUT, IN).to(torch.bfloat16)  # [N, K]
    packed = cpu_gemm.pack(w)  # [3, K, 16]
    assert packed.dtype == torch.bfloat16 and packed.shape == (3, IN, 16)
    for column, stored in [(0, 0), (3, 3), (4, 8), (7, 11), (8, 4), (11, 7), (12, 12), (15, 15)]:
        assert torch.equal(packed[1, :, stored], w[16 + column]), column


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (5,), (2, 3), (7,), (3, 33)], ids=str)
def test_matches_f_linear(kind, bias, shape):
    layer = packed_linear(bias, kind)
    x = inputs(*shape, dtype=dtype_of(kind))
    with torch.inference_mode():
        y = layer(x)  # [*shape, OUT]
    assert y.shape == (*shape, OUT) and y.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(y, reference(layer, x), atol=1e-5, rtol=1e-5)
    else:  # both round a float32 sum to bfloat16: at most one bfloat16 step apart
        torch.testing.assert_close(y.float(), reference(layer, x).float(), atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_row_gets_the_same_bits_alone_or_with_any_number_of_rows(kind, bias):
    """Each row of an M-row product is bitwise the row computed alone, for every M (K = 200 and 77
    output columns: a K tail, padded panels, 4-panel single rows and blocked products)."""
    layer = packed_linear(bias, kind, in_features=200, out_features=77 + 16 * 8)
    x = inputs(max(ROWS), dtype=dtype_of(kind), features=200)  # [64, 200]
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])  # [64, OUT], M = 1 each
        for rows in ROWS:
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_the_kernel_is_what_runs_for_any_number_of_rows():
    layer = packed_linear(bias=False)
    layer.packed = torch.zeros_like(layer.packed)
    with torch.inference_mode():
        for rows in (3, 17, 300):  # no size falls back to F.linear
            assert torch.count_nonzero(layer(inputs(rows))) == 0, rows


def test_grad_enabled_falls_back_to_f_linear():
    layer = packed_linear(bias=True)
    layer.packed = torch.zeros_like(layer.packed)  # a stale pack must not be used while training
    x = inputs(1)  # [1, IN]
    y = layer(x)  # [1, OUT]
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.expand(OUT, IN))


def test_layer_on_the_test_device():
    """use_cpu_kernels packs a layer only on the CPU; either way the results are F.linear's."""
    torch.manual_seed(0)
    layer = Linear(IN, OUT, bias=True).to(DEVICE)
    use_cpu_kernels(layer)
    assert (layer.packed is not None) == (torch.device(DEVICE).type == "cpu")
    x = inputs(2, 3).to(DEVICE)  # [2, 3, IN]
    with torch.inference_mode():
        y = layer(x)  # [2, 3, OUT]
    assert y.device == layer.weight.device
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)

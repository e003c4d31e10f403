"""specdec.models.linear.Linear and the CPU kernel (cpu_gemm / skinny_gemm.c): the same results as
F.linear, the same bits for a row whatever the number of rows beside it (what makes float32 greedy
decoding exactly equal between plain and speculative steps), and F.linear when training.

The kernel is a CPU-only path, so most tests here run on the CPU whatever SPECDEC_TEST_DEVICE says;
the last one checks a layer on the test device (on CUDA: no packing, plain F.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from specdec.models import cpu_gemm
from specdec.models.linear import MAX_KERNEL_ROWS, Linear, use_cpu_kernels

IN, OUT = 72, 40  # OUT not a multiple of the 16-column panels: exercises the padding

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler: the CPU kernel could not be built")


def packed_linear(bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(IN, OUT, bias=bias)
    if bias:
        torch.nn.init.normal_(layer.bias)
    assert use_cpu_kernels(layer)
    return layer


def inputs(*shape: int) -> torch.Tensor:  # [..., IN]
    return torch.randn(*shape, IN, generator=torch.Generator().manual_seed(1))


def test_pack_layout():
    w = torch.arange(OUT * IN, dtype=torch.float32).view(OUT, IN)  # [N, K]
    packed = cpu_gemm.pack(w)  # [ceil(N/16), K, 16]
    assert packed.shape == (3, IN, 16) and packed.is_contiguous()
    assert torch.equal(packed[1, :, 3], w[16 + 3])  # panel 1, column 3 is output row 19
    assert torch.count_nonzero(packed[2, :, OUT - 32 :]) == 0  # padding columns are zero


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (5,), (2, 3), (7,), (MAX_KERNEL_ROWS,)], ids=str)
def test_matches_f_linear(bias, shape):
    layer = packed_linear(bias)
    x = inputs(*shape)  # [*shape, IN]
    with torch.inference_mode():
        y = layer(x)  # [*shape, OUT]
    assert y.shape == (*shape, OUT)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_a_row_gets_the_same_bits_alone_or_in_a_block():
    layer = packed_linear(bias=True)
    x = inputs(MAX_KERNEL_ROWS)  # [16, IN]
    with torch.inference_mode():
        block = layer(x)  # [16, OUT]
        for i in range(MAX_KERNEL_ROWS):
            assert torch.equal(layer(x[i : i + 1])[0], block[i]), i


def test_the_kernel_is_what_runs():
    layer = packed_linear(bias=False)
    layer.packed = torch.zeros_like(layer.packed)
    with torch.inference_mode():
        assert torch.count_nonzero(layer(inputs(3))) == 0
        assert torch.count_nonzero(layer(inputs(MAX_KERNEL_ROWS + 1))) > 0  # larger blocks use F.linear


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

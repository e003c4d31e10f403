"""specdec.models.linear.Linear: the CPU [in, out] weight copy gives F.linear's results, and
training (grad enabled) falls back to F.linear so gradients reach the weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.linear import Linear, use_cpu_kernels

IN, OUT = 64, 48


def linear_with_copy(bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(IN, OUT, bias=bias)
    use_cpu_kernels(layer)
    return layer


def inputs(*shape: int) -> torch.Tensor:  # [..., IN]
    return torch.randn(*shape, IN, generator=torch.Generator().manual_seed(1))


def test_use_cpu_kernels_stores_contiguous_transpose():
    layer = linear_with_copy(bias=False)
    assert layer.weight_t.shape == (IN, OUT) and layer.weight_t.is_contiguous()
    assert torch.equal(layer.weight_t, layer.weight.t())


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (5,), (2, 3)], ids=["1-row", "1x1-rows", "5-rows", "2x3-rows"])
def test_matches_f_linear(bias, shape):
    layer = linear_with_copy(bias)
    x = inputs(*shape)  # [*shape, IN]
    with torch.inference_mode():
        y = layer(x)  # [*shape, OUT]
    assert y.shape == (*shape, OUT)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_single_row_reads_the_copy():
    """The [in, out] copy is what a single row is multiplied by (so the test above exercises it)."""
    layer = linear_with_copy(bias=False)
    layer.weight_t = torch.zeros(IN, OUT)
    with torch.inference_mode():
        assert torch.count_nonzero(layer(inputs(1))) == 0


def test_grad_enabled_falls_back_to_f_linear():
    layer = linear_with_copy(bias=True)
    layer.weight_t = torch.zeros(IN, OUT)  # a stale copy must not be used while training
    x = inputs(1)  # [1, IN]
    y = layer(x)  # [1, OUT]
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.expand(OUT, IN))

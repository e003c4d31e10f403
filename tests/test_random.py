"""sampling.uniforms: counter-based random numbers (splitmix64 on torch int64).

Bit-exact against a pure-Python splitmix64 (so CPU and CUDA, which both must match it, agree bit for
bit), uniform (Kolmogorov-Smirnov), independent across neighbouring counters and neighbouring seeds
(chi-square on pairs, correlation), deterministic, and independent of which rows share the batch.
Statistical checks use threshold ALPHA with Bonferroni over the checks of a test.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare, kstest, pearsonr

from conftest import DEVICE
from specdec.sampling import mix64, seed_of, uniforms
from test_sampling import no_host_sync

ALPHA = 1e-3
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def py_mix64(z: int) -> int:
    """splitmix64's finaliser on Python ints (unsigned 64-bit)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def py_uniform(seed: int, i: int) -> float:
    return (py_mix64((py_mix64(seed & MASK) + i * GOLDEN) & MASK) >> 40) / 2**24


def as_int64(bits: int) -> int:
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def stream(seed: int, n: int, offset: int = 0) -> torch.Tensor:
    """[n] numbers offset.. of one seed's stream."""
    return uniforms(torch.tensor([seed], device=DEVICE), torch.tensor([offset], device=DEVICE), n)[0]


def test_mix64_is_splitmix64():
    # splitmix64 seeded with 0: its first output is mix64(GOLDEN) = 0xE220A8397B1DCDAF.
    got = mix64(torch.tensor([as_int64(GOLDEN), 0, -1, 12345], device=DEVICE))
    assert got.tolist() == [as_int64(py_mix64(z & MASK)) for z in (GOLDEN, 0, -1, 12345)]
    assert got[0].item() == as_int64(0xE220A8397B1DCDAF)


@pytest.mark.parametrize("seed", [0, 1, 7, 2**62 + 12345, 2**63 - 1])
def test_uniforms_are_bit_exact(seed):
    offset = 2**40 + 3 if seed % 2 else 0
    got = stream(seed, 64, offset)
    assert got.dtype == torch.float32
    assert got.tolist() == [py_uniform(seed, offset + i) for i in range(64)]


def test_range_and_resolution():
    u = uniforms(torch.arange(100, device=DEVICE), torch.zeros(100, dtype=torch.long, device=DEVICE), 1000)
    assert u.shape == (100, 1000)
    assert 0 <= u.min() and u.max() < 1
    assert torch.equal(u * 2**24, (u * 2**24).floor())  # 24 random bits, exact in float32


def test_deterministic_and_offsets_index_the_stream():
    seed, offset = torch.tensor([5, 2**50], device=DEVICE), torch.tensor([0, 17], device=DEVICE)
    u = uniforms(seed, offset, 10)
    assert torch.equal(u, uniforms(seed, offset, 10))
    assert torch.equal(u[:, 4:], uniforms(seed, offset + 4, 6))  # drawing 4 then 6 = drawing 10


def test_a_row_does_not_depend_on_its_batch():
    seeds = torch.tensor([3, 1, 4, 1, 5], device=DEVICE)
    offsets = torch.tensor([0, 9, 2, 9, 100], device=DEVICE)
    batch = uniforms(seeds, offsets, 8)
    for b in range(5):
        assert torch.equal(batch[b], uniforms(seeds[b : b + 1], offsets[b : b + 1], 8)[0])
    assert torch.equal(batch[1], batch[3])  # same seed and counter, same numbers
    assert not torch.equal(batch[0], batch[2])


def test_uniform_distribution():
    """KS along one seed's counters, and across neighbouring seeds at one counter."""
    n = 100_000
    seeds = torch.arange(n, device=DEVICE)
    samples = {
        "seed 0": stream(0, n),
        "seed 2**62": stream(2**62, n, offset=5),
        "seeds 0..n": uniforms(seeds, torch.zeros_like(seeds), 1)[:, 0],
        "seeds 0..n, counter 1": uniforms(seeds, torch.ones_like(seeds), 1)[:, 0],
    }
    pvalues = {name: kstest(u.cpu().double().numpy(), "uniform").pvalue for name, u in samples.items()}
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues


def pair_pvalue(a: torch.Tensor, b: torch.Tensor, cells: int = 10) -> float:
    """Chi-square p-value that pairs (a, b) fill a cells x cells grid evenly (independent uniforms)."""
    index = (a * cells).long() * cells + (b * cells).long()
    observed = torch.bincount(index.cpu(), minlength=cells * cells).double().numpy()
    return float(chisquare(observed).pvalue)


def test_neighbours_are_independent():
    """Pairs of neighbouring counters (one seed) and of neighbouring seeds (one counter): even on a grid,
    and uncorrelated."""
    n = 100_000
    along = stream(11, n + 1)  # [n+1]
    across = uniforms(torch.arange(n + 1, device=DEVICE), torch.full((n + 1,), 3, device=DEVICE), 2)  # [n+1, 2]
    pairs = {
        "counter, counter + 1": (along[:-1], along[1:]),
        "seed, seed + 1": (across[:-1, 0], across[1:, 0]),
        "counter 3, counter 4": (across[:, 0], across[:, 1]),
    }
    pvalues = {}
    for name, (a, b) in pairs.items():
        pvalues[f"grid {name}"] = pair_pvalue(a, b)
        pvalues[f"correlation {name}"] = float(pearsonr(a.cpu().double().numpy(), b.cpu().double().numpy()).pvalue)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues


def test_a_broken_generator_is_caught():
    """The pair check has power: a stream whose neighbours are correlated (u[i+1] = frac(u[i] + small))
    fails it, though each number alone is uniform."""
    u = stream(11, 100_001)
    follower = torch.frac(u[:-1] + 0.05 * u[1:])
    assert pair_pvalue(u[:-1], follower) < ALPHA


def test_seed_of():
    fresh = {seed_of(None) for _ in range(8)}
    assert len(fresh) == 8 and all(0 <= s < 2**63 for s in fresh)
    assert seed_of(0) == 0 and seed_of(123) == 123 and seed_of(2**63 - 1) == 2**63 - 1
    assert 0 <= seed_of(-1) < 2**63 and 0 <= seed_of(2**70 + 5) < 2**63  # any int fits an int64 tensor
    torch.tensor([seed_of(-1), seed_of(None)], device=DEVICE)


def test_uniforms_are_graph_safe():
    seed, offset = torch.tensor([1, 2**62], device=DEVICE), torch.tensor([0, 5], device=DEVICE)
    with no_host_sync():
        u = uniforms(seed, offset, 16)
    assert u.shape == (2, 16)

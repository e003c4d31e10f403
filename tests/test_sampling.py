"""sampling.py: logits -> probs on hand-computed examples (shared and per-row parameters), agreement with
the old sort-based filters, sampling from uniforms, parameter validation, and the graph-safety guard
that every graph-safe function of sampling.py and verify.py runs under.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from scipy.stats import chisquare

from conftest import DEVICE, seeded_generator
from specdec.config import SamplingParams
from specdec.errors import UserError
from specdec.sampling import TOP_K_CAP, RowSampling, greedy_tokens, keep_likely, logits_to_probs, sample, select_threshold, topk_in_slices, topk_wide, uniforms

PROBS = [0.5, 0.3, 0.15, 0.05]  # a distribution whose kept sets are easy to work out by hand
ALPHA = 1e-3


# ---------------------------------------------------------------- the graph-safety guard

SYNCING_METHODS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                   "masked_select", "unique")
SYNCING_FUNCTIONS = ("equal", "nonzero", "masked_select", "argwhere", "unique", "bincount")


@contextmanager
def no_host_sync():
    """Fail on anything in the block that makes the host wait for the device, so the block could run
    inside a CUDA graph capture: reading values (.item(), .tolist(), bool(t), int(t), torch.equal),
    data-dependent shapes (.nonzero(), boolean-mask indexing x[mask]). Proves it on a CPU; on CUDA the
    sync debug mode also turns any synchronising call into an error."""

    def refuse(name: str):
        def refuse_call(*args, **kwargs):
            raise AssertionError(f"{name} synchronises with the host: not graph-safe")

        return refuse_call

    def has_mask(index) -> bool:
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)

    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def checked_getitem(self, index):
        if has_mask(index):
            raise AssertionError("boolean-mask indexing has a data-dependent shape: not graph-safe")
        return getitem(self, index)

    def checked_setitem(self, index, value):
        if has_mask(index):
            raise AssertionError("boolean-mask assignment synchronises with the host: not graph-safe")
        return setitem(self, index, value)

    cuda = torch.device(DEVICE).type == "cuda"
    with pytest.MonkeyPatch.context() as mp:
        for name in SYNCING_METHODS:
            mp.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        for name in SYNCING_FUNCTIONS:
            mp.setattr(torch, name, refuse(f"torch.{name}"))
        mp.setattr(torch.Tensor, "__getitem__", checked_getitem)
        mp.setattr(torch.Tensor, "__setitem__", checked_setitem)
        if cuda:
            torch.cuda.synchronize()
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(mode)


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: bool(t.any()),
        lambda t: int(t.sum()),
        lambda t: float(t.sum()),
        lambda t: range(t.sum()),
        lambda t: t.nonzero(),
        lambda t: torch.nonzero(t),
        lambda t: torch.equal(t, t),
        lambda t: t[t > 0],
        lambda t: t.__setitem__(t > 0, 0),
        lambda t: t.unique(),
    ],
    ids=["item", "tolist", "bool", "int", "float", "index", "nonzero", "torch.nonzero", "equal", "mask", "mask-set",
         "unique"],
)
def test_the_guard_catches_host_syncs(op):
    t = torch.arange(4, device=DEVICE)
    op(t)  # fine outside
    with pytest.raises(AssertionError, match="graph-safe"), no_host_sync():
        op(t)


def test_the_guard_lets_graph_safe_code_through():
    t = torch.arange(4, device=DEVICE)
    with no_host_sync():
        t[:, None][..., 0] + torch.where(t > 1, t, 0).gather(0, t)
    assert t.tolist() == [0, 1, 2, 3]  # and everything is restored afterwards


# ---------------------------------------------------------------- logits -> probs, by hand


def log_probs(probs: list[float]) -> torch.Tensor:
    """[V] logits whose softmax is `probs`."""
    return torch.tensor(probs, device=DEVICE).log()


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    assert torch.allclose(actual, torch.tensor(expected, device=actual.device), atol=1e-6), actual


def to_probs(logits: torch.Tensor, params: SamplingParams, per_row: bool) -> torch.Tensor:
    """logits_to_probs with the params shared (SamplingParams) or given to every row (RowSampling)."""
    if not per_row:
        return logits_to_probs(logits, params)
    batched = logits if logits.dim() > 1 else logits[None]
    probs = logits_to_probs(batched, RowSampling.of([params] * batched.shape[0], DEVICE))
    return probs if logits.dim() > 1 else probs[0]


per_row = pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per-row"])


@per_row
def test_temperature_one_is_softmax(per_row):
    logits = torch.tensor([0.0, math.log(2), math.log(4)], device=DEVICE)
    assert_probs(to_probs(logits, SamplingParams(temperature=1.0), per_row), [1 / 7, 2 / 7, 4 / 7])


@per_row
def test_temperature_divides_logits(per_row):
    logits = torch.tensor([0.0, math.log(2), math.log(4)], device=DEVICE)  # at T=2: weights 1, sqrt(2), 2
    total = 3 + math.sqrt(2)
    probs = to_probs(logits, SamplingParams(temperature=2.0), per_row)
    assert_probs(probs, [1 / total, math.sqrt(2) / total, 2 / total])


@per_row
def test_greedy_is_one_hot_at_the_argmax(per_row):
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]], device=DEVICE)  # [B, V]
    probs = to_probs(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5), per_row)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


@per_row
def test_top_k_keeps_the_k_largest(per_row):
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0], device=DEVICE)
    e1, e2 = math.exp(3.0), math.exp(2.0)
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_k=2), per_row)
    assert_probs(probs, [0.0, e1 / (e1 + e2), e2 / (e1 + e2), 0.0])


@per_row
def test_top_k_larger_than_vocab_keeps_everything(per_row):
    logits = log_probs(PROBS)
    assert_probs(to_probs(logits, SamplingParams(temperature=1.0, top_k=100), per_row), PROBS)


@per_row
def test_a_top_k_past_int64_keeps_everything(per_row):
    """A request may send any top_k >= 0; past TOP_K_CAP the rows carry TOP_K_CAP, which keeps every token
    as the request's would (a top_k past int64 would not fit the device tensor)."""
    logits = log_probs(PROBS)
    assert_probs(to_probs(logits, SamplingParams(temperature=1.0, top_k=10**30), per_row), PROBS)
    rows = RowSampling.of([SamplingParams(temperature=1.0, top_k=10**30)], DEVICE)
    rows.put(torch.tensor([0], device=DEVICE), [SamplingParams(temperature=1.0, top_k=2**62)])
    assert rows.top_k.tolist() == [TOP_K_CAP]


@per_row
@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.45, [1.0, 0.0, 0.0, 0.0]),  # the top token alone reaches 0.45
        (0.75, [0.625, 0.375, 0.0, 0.0]),  # 0.5 < 0.75 <= 0.8: two tokens
        (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.8 < 0.9 <= 0.95: three tokens
        (1.0, PROBS),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, expected, per_row):
    assert_probs(to_probs(log_probs(PROBS), SamplingParams(temperature=1.0, top_p=top_p), per_row), expected)


@per_row
def test_top_p_applies_after_temperature(per_row):
    """top_p filters the tempered distribution: at T=2 these logits give PROBS (two tokens reach 0.6);
    untempered they are sharper (the top token alone has 0.25 / 0.365 = 0.68 >= 0.6)."""
    logits = log_probs(PROBS) * 2
    assert_probs(to_probs(logits, SamplingParams(temperature=2.0, top_p=0.6), per_row), [0.625, 0.375, 0.0, 0.0])
    assert_probs(to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6), per_row), [1.0, 0.0, 0.0, 0.0])


@per_row
@pytest.mark.parametrize(
    "min_p, expected",
    [
        (0.2, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # threshold 0.1
        (0.5, [0.625, 0.375, 0.0, 0.0]),  # threshold 0.25
        (0.9, [1.0, 0.0, 0.0, 0.0]),  # threshold 0.45
    ],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p, expected, per_row):
    assert_probs(to_probs(log_probs(PROBS), SamplingParams(temperature=1.0, min_p=min_p), per_row), expected)


@per_row
def test_filters_combine(per_row):
    logits = log_probs([0.4, 0.3, 0.2, 0.06, 0.04])
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.85, min_p=0.6), per_row)
    # top_k=4 drops 0.04; renormalised top 3 carry 0.9/0.96 = 0.9375 >= 0.85, the top 2 only 0.729;
    # min_p keeps tokens >= 0.6 * max, i.e. 0.4 and 0.3.
    assert_probs(probs, [4 / 7, 3 / 7, 0.0, 0.0, 0.0])


@per_row
def test_batched_logits_are_filtered_per_row(per_row):
    logits = torch.stack([log_probs(PROBS), log_probs(PROBS[::-1])])[:, None]  # [B=2, T=1, V]
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_p=0.75), per_row)  # [B, T, V]
    assert probs.shape == (2, 1, 4)
    assert_probs(probs[:, 0], [[0.625, 0.375, 0.0, 0.0], [0.0, 0.0, 0.375, 0.625]])


@per_row
def test_ties_at_the_cut_are_all_kept(per_row):
    """Documented tie rule: tokens as likely as the last one kept are kept too, whatever their order."""
    logits = log_probs([0.4, 0.2, 0.2, 0.2])
    assert_probs(to_probs(logits, SamplingParams(temperature=1.0, top_k=2), per_row), [0.4, 0.2, 0.2, 0.2])
    assert_probs(to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5), per_row), [0.4, 0.2, 0.2, 0.2])
    assert_probs(to_probs(logits, SamplingParams(temperature=1.0, top_p=0.4), per_row), [1.0, 0.0, 0.0, 0.0])


# ---------------------------------------------------------------- per-row parameters

ROW_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=0.0, top_k=5, top_p=0.5),  # greedy: the filters do not matter
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=1.0),
]


def test_row_sampling_of_and_index():
    rows = RowSampling.of(ROW_PARAMS, DEVICE)
    assert rows.temperature.dtype == torch.float32 and rows.top_k.dtype == torch.long
    assert rows.top_k.tolist() == [p.top_k for p in ROW_PARAMS]
    assert rows.greedy.tolist() == [p.greedy for p in ROW_PARAMS]
    picked = rows.index(torch.tensor([3, 1], device=DEVICE))
    assert picked.top_p.tolist() == pytest.approx([0.8, 0.95]) and picked.min_p.tolist() == pytest.approx([0.02, 0.0])
    assert rows.index(slice(0, 2)).temperature.tolist() == pytest.approx([0.0, 0.7])


@pytest.mark.parametrize("shape", [(256,), (3, 256)], ids=["[B, V]", "[B, T, V]"])
def test_each_row_gets_its_own_parameters(shape):
    """Row b of a RowSampling batch equals logits_to_probs of that row alone with its SamplingParams."""
    logits = 3 * torch.randn(len(ROW_PARAMS), *shape, generator=seeded_generator(0), device=DEVICE)
    probs = logits_to_probs(logits, RowSampling.of(ROW_PARAMS, DEVICE))
    for b, params in enumerate(ROW_PARAMS):
        alone = logits_to_probs(logits[b], params)
        assert torch.equal(probs[b] > 0, alone > 0), (b, params)
        assert torch.allclose(probs[b], alone, rtol=1e-6, atol=1e-9), (b, params)


def test_a_max_top_k_promise_changes_nothing_but_the_cost():
    logits = 3 * torch.randn(len(ROW_PARAMS), 2, 256, generator=seeded_generator(5), device=DEVICE)
    rows = RowSampling.of(ROW_PARAMS, DEVICE)
    unknown = logits_to_probs(logits, rows)
    rows.max_top_k = max(p.top_k for p in ROW_PARAMS)  # a bound: torch.topk instead of a radix select
    assert torch.equal(logits_to_probs(logits, rows), unknown)
    assert torch.equal(logits_to_probs(logits[1:3], rows.index(slice(1, 3))), unknown[1:3])
    without_top_k = RowSampling.of([p for p in ROW_PARAMS if p.top_k == 0], DEVICE)
    kept = [b for b, p in enumerate(ROW_PARAMS) if p.top_k == 0]
    without_top_k.max_top_k = 0  # no row uses top-k: skipped
    assert torch.equal(logits_to_probs(logits[kept], without_top_k), unknown[kept])


@pytest.mark.parametrize("V", [100, 4096, 4097, 49152, 50001])
@pytest.mark.parametrize("k", [1, 4, 10])
@pytest.mark.parametrize("split", ["slices of 1024", "slices of 37", "topk_wide"])
def test_a_topk_in_slices_finds_the_same_values_as_torch_topk(V, k, split):
    """Values bit for bit, indices pointing at them, largest first; with ties (rounded logits) and a
    vocabulary that is not a multiple of the slice (padding must never be picked)."""
    x = (4 * torch.randn(3, 2, V, generator=seeded_generator(V + k), device=DEVICE)).round()  # many ties
    x[0, 0] = -1e30  # a row of equal, very negative values: the -inf padding must still never be picked
    chunk = {"slices of 1024": 1024, "slices of 37": 37}.get(split)
    values, index = topk_wide(x, k) if chunk is None else topk_in_slices(x, k, chunk)
    assert torch.equal(values, x.topk(k, dim=-1).values)
    assert index.max() < V and torch.equal(x.gather(-1, index), values)
    assert (index.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct entries
    assert (values[..., :-1] >= values[..., 1:]).all()


# ---------------------------------------------------------------- agreement with the old sort-based filters


def old_logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The implementation this module replaced (verbatim): top-k on logits, top-p by sorting."""
    logits = logits.float()
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = kept / kept.sum(-1, keepdim=True)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def exact_kept(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented rule in float64 with explicit tie handling: (kept [R, V], near_cut [R, V]), where
    near_cut marks tokens whose decision is within float32 rounding of a cut (either answer is right)."""
    x = logits.double() / params.temperature
    p = x.softmax(-1)  # [R, V]
    kept = torch.ones_like(p, dtype=torch.bool)
    near = torch.zeros_like(kept)
    rel = 1e-5
    if params.top_k > 0:
        kth = p.topk(min(params.top_k, p.shape[-1]), dim=-1).values[..., -1:]
        kept &= p >= kth
        near |= ((p - kth).abs() <= rel * kth) & (p != kth)  # exact ties are decided, near ties are not
    if params.top_p < 1:
        q = torch.where(kept, p, 0.0)
        q = q / q.sum(-1, keepdim=True)
        # mass of strictly more likely tokens, per token (ties share it): sum over the row of q[q > q_i]
        srt, _ = q.sort(-1, descending=True)
        before = srt.cumsum(-1) - srt  # [R, V] in sorted order
        first = torch.searchsorted(-srt.contiguous(), -q.contiguous(), right=False)  # index of q_i's first tie
        mass_before = before.gather(-1, first)  # [R, V]
        kept &= mass_before < params.top_p
        near |= (mass_before - params.top_p).abs() <= rel
    if params.min_p > 0:
        cut = params.min_p * p.amax(-1, keepdim=True)
        kept &= p >= cut
        near |= ((p - cut).abs() <= rel * cut) & (p != cut)
    return kept, near


CASES = {
    "random": lambda g, R, V: 3 * torch.randn(R, V, generator=g, device=DEVICE),
    "peaked": lambda g, R, V: 12 * torch.randn(R, V, generator=g, device=DEVICE),
    "flat": lambda g, R, V: 0.05 * torch.randn(R, V, generator=g, device=DEVICE),
    "ties": lambda g, R, V: torch.randint(0, 6, (R, V), generator=g, device=DEVICE).float() * 0.7,
}
FILTERS = [
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.5, top_k=300),
    SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.2, top_k=40, top_p=0.7, min_p=0.01),
]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("params", FILTERS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_filters_match_the_exact_rule_and_the_old_code(case, params):
    """New (shared and per-row parameters) keeps exactly the tokens of the rule computed in float64,
    except at a cut that float32 cannot resolve; without ties it also equals the old sort-based code."""
    R, V = 6, 4096
    logits = CASES[case](seeded_generator(1), R, V)
    kept, near = exact_kept(logits, params)
    reference = torch.where(kept, (logits.double() / params.temperature).softmax(-1), 0.0)
    reference = (reference / reference.sum(-1, keepdim=True)).float()
    old = old_logits_to_probs(logits, params)
    for probs in (logits_to_probs(logits, params), logits_to_probs(logits, RowSampling.of([params] * R, DEVICE))):
        assert not (((probs > 0) ^ kept) & ~near).any(), case
        if torch.equal(probs > 0, kept):
            assert torch.allclose(probs, reference, atol=1e-6, rtol=1e-4)
        if case != "ties":  # the old code breaks ties by sort order
            assert not (((old > 0) ^ (probs > 0)) & ~near).any()
            if torch.equal(probs > 0, old > 0):
                assert torch.allclose(probs, old, atol=1e-6, rtol=1e-4)


def test_full_vocabulary_matches_the_old_code():
    """The benchmark's shape: V = 49152 at temperature 0.7, top-p 0.95 (and top-k 50)."""
    logits = 4 * torch.randn(5, 49152, generator=seeded_generator(2), device=DEVICE)
    for params in (SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=0.7, top_k=50, top_p=0.95)):
        old = old_logits_to_probs(logits, params)
        for probs in (logits_to_probs(logits, params), logits_to_probs(logits, RowSampling.of([params] * 5, DEVICE))):
            assert torch.equal(probs > 0, old > 0)
            assert torch.allclose(probs, old, atol=1e-6, rtol=1e-4)


def test_select_threshold_keeps_the_lightest_drop():
    """Keys 0..9 with weights w: the floor is the smallest key whose weight at or below it exceeds
    `droppable` (a tie group is dropped or kept whole)."""
    keys = torch.tensor([[7, 3, 9, 3, 0, 1 << 20, (1 << 20) + 5, 2, 3, 8]], dtype=torch.int32, device=DEVICE)
    weights = torch.ones(1, 10, dtype=torch.float64, device=DEVICE)
    # sorted keys: 0, 2, 3, 3, 3, 7, 8, 9, 2**20, 2**20+5; cumulative counts 1, 2, 5, 5, 5, 6, 7, 8, 9, 10
    for droppable, floor in [(0, 0), (0.5, 0), (1, 2), (2, 3), (4, 3), (5, 7), (8, 1 << 20), (9, (1 << 20) + 5), (-1, 0)]:
        got = select_threshold(keys, weights, torch.tensor([[droppable]], dtype=torch.float64, device=DEVICE))
        assert got.tolist() == [[floor]], (droppable, got)


# ---------------------------------------------------------------- sampling from uniforms


def test_sample_is_a_function_of_u():
    probs = torch.full((64, 10), 0.1, device=DEVICE)  # [B, V]
    u = uniforms(torch.arange(64, device=DEVICE), torch.zeros(64, dtype=torch.long, device=DEVICE), 2)  # [B, 2]
    first = sample(probs, u[:, 0])
    assert torch.equal(first, sample(probs, u[:, 0]))
    assert not torch.equal(first, sample(probs, u[:, 1]))


def test_sample_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]], device=DEVICE).expand(5, 6)  # [B, V]
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-24], device=DEVICE)  # [B] including both ends
    assert sample(probs, u).tolist() == [1, 1, 3, 3, 3]


def test_sample_never_runs_past_the_last_token_when_u_times_total_rounds_up():
    probs = torch.tensor([[0.1] * 7 + [0.0] * 3], device=DEVICE)  # cumsum in float32 is not exactly 0.7
    u = torch.tensor([1 - 2**-24], device=DEVICE)
    assert sample(probs, u).tolist() == [6]


def test_sample_keeps_leading_dims():
    probs = torch.full((2, 3, 5), 0.2, device=DEVICE)  # [B, T, V]
    assert sample(probs, torch.full((2, 3), 0.5, device=DEVICE)).shape == (2, 3)


def test_sample_follows_probs():
    g = seeded_generator(3)
    probs = (2 * torch.randn(12, generator=g, device=DEVICE)).softmax(-1)  # [V]
    probs[4] = 0.0
    n = 50_000
    u = uniforms(torch.full((1,), 99, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE), n)[0]  # [n]
    tokens = sample(probs.expand(n, -1), u)
    observed = torch.bincount(tokens.cpu(), minlength=12).double()
    assert observed[4] == 0
    expected = probs.cpu().double() * n
    keep = expected > 5
    expected = expected[keep] * observed[keep].sum() / expected[keep].sum()
    assert chisquare(observed[keep].numpy(), expected.numpy()).pvalue > ALPHA


def flat_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The one-level inverse CDF that sample's two levels compute: the first token whose cumulative mass
    (float64) exceeds u * total."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    return torch.searchsorted(cdf, u.double()[:, None] * cdf[:, -1:], right=True).squeeze(-1)


def test_sample_over_several_blocks_is_the_inverse_cdf():
    """Two levels (a block, then a token in it: CUDA's way) give the token of one inverse CDF over the
    whole vocabulary for the same u, across blocks, with empty blocks and a short last block; rounding
    may move a few u that fall within float32 steps of a boundary."""
    from specdec.sampling import SAMPLE_BLOCK

    V, n = 3 * SAMPLE_BLOCK + 17, 20_000
    g = seeded_generator(5)
    probs = (3 * torch.randn(V, generator=g, device=DEVICE)).softmax(-1)  # [V]
    probs[SAMPLE_BLOCK : 2 * SAMPLE_BLOCK] = 0.0  # an empty block
    probs[SAMPLE_BLOCK - 1] = probs[2 * SAMPLE_BLOCK] = 0.0  # zero tokens beside it
    probs[3 * SAMPLE_BLOCK + 16] = 0.2  # a heavy token at the end of the short last block
    u = uniforms(torch.full((1,), 7, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE), n)[0]  # [n]
    tokens = sample(probs.expand(n, -1), u, block=SAMPLE_BLOCK)
    assert not torch.isin(tokens, torch.tensor([SAMPLE_BLOCK - 1, 2 * SAMPLE_BLOCK], device=DEVICE)).any()
    assert not ((tokens >= SAMPLE_BLOCK) & (tokens < 2 * SAMPLE_BLOCK)).any()
    same = (tokens == flat_inverse_cdf(probs.expand(n, -1), u)).float().mean().item()
    assert same > 0.999, same
    observed = torch.bincount(tokens.cpu(), minlength=V).double()
    expected = probs.cpu().double() * n
    keep = expected > 5
    assert observed[~keep].sum() < 0.02 * n
    expected = expected[keep] * observed[keep].sum() / expected[keep].sum()
    assert chisquare(observed[keep].numpy(), expected.numpy()).pvalue > ALPHA


def test_sample_of_an_all_zero_row_is_a_token():
    probs = torch.zeros(2, 2 * 256 + 3, device=DEVICE)  # [B, V] (a residual p - q that vanished)
    for block in (None, 256):
        tokens = sample(probs, torch.tensor([0.0, 0.9], device=DEVICE), block)
        assert ((tokens >= 0) & (tokens < probs.shape[-1])).all()


# ---------------------------------------------------------------- graph safety


def test_sampling_is_graph_safe():
    logits = 3 * torch.randn(3, 2, 500, generator=seeded_generator(4), device=DEVICE)  # [B, T, V]
    rows = RowSampling.of(ROW_PARAMS[:3], DEVICE)
    seed, offset = torch.tensor([1, 2, 3], device=DEVICE), torch.zeros(3, dtype=torch.long, device=DEVICE)
    with no_host_sync():
        probs = logits_to_probs(logits, rows)
        for params in FILTERS + [SamplingParams()]:
            logits_to_probs(logits, params)
        u = uniforms(seed, offset, 2)  # [B, 2]
        tokens = sample(probs, u)
        top_k = rows.top_k[:, None, None].expand(3, 2, 1).contiguous()  # [B, T, 1]
        keep_likely(probs, top_k, None, None)
        keep_likely(probs, top_k, None, None, max_top_k=5)
    assert tokens.shape == (3, 2)


# ---------------------------------------------------------------- parameter validation


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=-0.2),
        dict(top_k=-1),
        dict(min_p=-0.1),
        dict(min_p=1.0),
    ],
)
def test_invalid_sampling_params_raise_user_error(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_boundary_sampling_params_are_valid():
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    assert params.greedy
    assert not SamplingParams(temperature=0.5, top_p=1e-6, min_p=0.99).greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_tokens_take_the_first_of_tied_maxima(dtype):
    """greedy_tokens (max's indices) is argmax: rows of many exact ties (values 0-4) keep the first
    maximum, wherever it falls, over [B, T, V] at the default model's vocabulary and an odd one."""
    gen = seeded_generator(3)
    for V in (49152, 1003):
        logits = torch.randint(0, 5, (4, 3, V), generator=gen, device=DEVICE).to(dtype)
        logits[0, 0, -1] = 5  # the maximum alone, last
        logits[1, 1, :] = 2  # every logit tied
        tokens = greedy_tokens(logits)
        first = (logits == logits.amax(-1, keepdim=True)).int().argmax(-1)  # the first position holding the maximum
        assert torch.equal(tokens, first) and torch.equal(tokens, logits.argmax(-1))
        assert tokens[0, 0] == V - 1 and tokens[1, 1] == 0

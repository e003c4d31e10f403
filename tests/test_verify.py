"""verify.py: greedy acceptance on hand-built logits, and statistical losslessness of rejection sampling.

Statistical setup: the target p [k+1, V] and draft q [k, V] are fixed per position (they do not depend
on the prefix) and every batch row is an independent trial. Drafts are drawn independently per
position, so whether drafts 0..j-1 were accepted is independent of what happens at position j.
Hence, among rows that reach position j (num_accepted >= j), the emitted token at j must be
distributed exactly as p[j] (Leviathan et al. 2023, Theorem 1); that covers accepted, recovered and
bonus tokens alike. A chi-square goodness-of-fit test with threshold 1e-3 checks it; broken verifiers
defined below must fail the same check, which shows the test has power.

The verifiers' randomness is uniforms from `sampling.uniforms` (one seed per trial row), the same on CPU
and CUDA; test data (p, q, drafts) comes from generators on DEVICE, which differ between CPU and CUDA,
so no test asserts a particular draw. Also: mixed greedy / sampled batches (`verify_chain`), and the
graph-safety guard around every verifier.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from torch import Tensor

from conftest import DEVICE, seeded_generator
from specdec.config import SamplingParams
from specdec.sampling import RowSampling, logits_to_probs, sample, uniforms
from specdec.verify import VerifyResult, count_accepted, greedy_verify, rejection_sample, remove_rejected, verify_chain
from test_sampling import no_host_sync

V = 6  # vocabulary of the statistical tests
TRIALS = 20_000  # batch rows = independent trials
ALPHA = 1e-3  # a correct verifier fails a check less than once in 1000 runs
MIN_EXPECTED = 5.0  # chi-square bins expected to hold fewer samples are pooled


# ---------------------------------------------------------------- greedy_verify


def one_hot_logits(argmax: list[list[int]], vocab: int = 5) -> Tensor:
    """[B, T] argmax tokens -> logits [B, T, vocab] whose argmax is exactly those tokens."""
    tokens = torch.tensor(argmax, device=DEVICE)  # [B, T]
    logits = torch.randn(*tokens.shape, vocab, generator=seeded_generator(0), device=DEVICE)  # [B, T, V]
    return logits.scatter(-1, tokens[..., None], 10.0)


def test_greedy_verify_accepts_the_matching_prefix():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]  # target argmax at positions 0..k
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3]], device=DEVICE)  # [B, k]: all match / 2nd wrong / 1st wrong
    result = greedy_verify(drafts, one_hot_logits(target))
    assert result.num_accepted.tolist() == [3, 1, 0]
    assert result.tokens.tolist() == target  # accepted drafts, then the target's own next token


def test_greedy_verify_stops_at_the_first_mismatch():
    target = [[1, 2, 3, 4]]
    drafts = torch.tensor([[1, 0, 3]], device=DEVICE)  # third draft matches, but after a rejection it does not count
    assert greedy_verify(drafts, one_hot_logits(target)).num_accepted.tolist() == [1]


def test_greedy_verify_caps_acceptance_at_num_drafted():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]], device=DEVICE)  # all match, but rows drafted 3, 1, 0
    result = greedy_verify(drafts, one_hot_logits(target), num_drafted=torch.tensor([3, 1, 0], device=DEVICE))
    assert result.num_accepted.tolist() == [3, 1, 0]
    emitted = [row[: n + 1] for row, n in zip(result.tokens.tolist(), result.num_accepted.tolist())]
    assert emitted == [[1, 2, 3, 4], [1, 2], [1]]


def test_greedy_verify_with_no_drafts_emits_the_argmax():
    result = greedy_verify(torch.zeros(2, 0, dtype=torch.long, device=DEVICE), one_hot_logits([[3], [1]]))
    assert result.num_accepted.tolist() == [0, 0]
    assert result.tokens.tolist() == [[3], [1]]


def test_count_accepted_is_the_all_true_prefix():
    accept = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]], device=DEVICE)
    assert count_accepted(accept, None).tolist() == [2, 0, 4]
    assert count_accepted(accept, torch.tensor([1, 4, 2], device=DEVICE)).tolist() == [1, 0, 2]


# ---------------------------------------------------------------- statistical helpers


def random_dists(num: int, generator: torch.Generator, sharpness: float = 1.5) -> Tensor:
    """[num, V] random distributions, uneven enough that p and q differ clearly."""
    return (sharpness * torch.randn(num, V, generator=generator, device=DEVICE)).softmax(-1)


def draw_drafts(q: Tensor, generator: torch.Generator) -> Tensor:
    """q [k, V] -> drafts [TRIALS, k], each position drawn independently from its q."""
    return torch.multinomial(q, TRIALS, replacement=True, generator=generator).T


def pooled_chisquare(tokens: Tensor, probs: Tensor) -> float:
    """p-value of tokens [N] ~ probs [V]; bins expected to hold < MIN_EXPECTED samples are pooled."""
    tokens, probs = tokens.cpu(), probs.cpu()
    observed = torch.bincount(tokens, minlength=probs.shape[0]).double()  # [V]
    expected = probs.double() * tokens.shape[0]  # [V]
    impossible = expected == 0  # tokens a filter removed (top-p): never drawn, else the check fails outright
    if observed[impossible].sum() > 0:
        return 0.0
    observed, expected = observed[~impossible], expected[~impossible]
    small = expected < MIN_EXPECTED
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    expected = expected * observed.sum() / expected.sum()  # exact totals despite float rounding
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def position_pvalues(result: VerifyResult, p: Tensor) -> list[float]:
    """One p-value per output position j: tokens[:, j] of the rows that reach j, against p[j] [V]."""
    reach = [result.num_accepted >= j for j in range(p.shape[0])]  # [B] each
    return [pooled_chisquare(result.tokens[rows, j], p[j]) for j, rows in enumerate(reach)]


def expand(dist: Tensor) -> Tensor:
    """[T, V] per-position distribution -> [TRIALS, T, V] (same for every trial)."""
    return dist.expand(TRIALS, *dist.shape)


def trial_uniforms(n: int, seed: int, rows: int = TRIALS) -> Tensor:
    """[rows, n] uniforms, each row its own stream (as each request has its own seed)."""
    seeds = torch.arange(rows, device=DEVICE) + seed * rows
    return uniforms(seeds, torch.zeros(rows, dtype=torch.long, device=DEVICE), n)


# ---------------------------------------------------------------- broken verifiers (must be caught)


def chain_verify(draft_tokens: Tensor, q: Tensor, p: Tensor, u: Tensor, accept_prob, recover) -> VerifyResult:
    """A naive chain verifier with pluggable rules, to build broken variants from.

    draft_tokens [B, k], q [B, k, V], p [B, k+1, V], u [B, k+1]; accept_prob(p_x, q_x) -> [B, k]
    probabilities; recover(p_j, q_j) -> [B, V] distribution sampled from at the first rejection."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    num_accepted = (u[:, :k] < accept_prob(p_draft, q_draft)).long().cumprod(-1).sum(-1)  # [B]
    rejected = (num_accepted < k)[:, None]  # [B, 1]
    at = num_accepted.clamp(max=k - 1)  # [B]
    p_next = torch.where(rejected, recover(p[rows, num_accepted], q[rows, at]), p[rows, num_accepted])  # [B, V]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = sample(p_next, u[:, k])
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)


def residual(p: Tensor, q: Tensor) -> Tensor:
    r = (p - q).clamp(min=0)
    return r / r.sum(-1, keepdim=True)


def always_accept(draft_tokens, q, p, u) -> VerifyResult:
    return chain_verify(draft_tokens, q, p, u, lambda px, qx: torch.ones_like(px), residual)


def recover_from_p(draft_tokens, q, p, u) -> VerifyResult:
    """Right acceptance rule, but a rejection resamples from p instead of norm(max(p - q, 0))."""
    return chain_verify(draft_tokens, q, p, u, lambda px, qx: (px / qx).clamp(max=1), lambda pj, qj: pj)


def inverted_ratio(draft_tokens, q, p, u) -> VerifyResult:
    """Accepts with min(1, q/p) instead of min(1, p/q)."""
    return chain_verify(draft_tokens, q, p, u, lambda px, qx: (qx / px).clamp(max=1), residual)


# ---------------------------------------------------------------- losslessness of rejection_sample


def run_verifier(verifier, k: int, seed: int) -> tuple[VerifyResult, Tensor]:
    """Random p [k+1, V], q [k, V]; drafts from q; one verifier call over TRIALS rows -> (result, p)."""
    g = seeded_generator(seed)
    p, q = random_dists(k + 1, g), random_dists(k, g)
    result = verifier(draw_drafts(q, g), expand(q), expand(p), trial_uniforms(k + 1, seed))
    return result, p


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sample_emits_the_target_distribution(k, seed):
    result, p = run_verifier(rejection_sample, k, seed)
    pvalues = position_pvalues(result, p)
    assert min(pvalues) > ALPHA / len(pvalues), pvalues  # Bonferroni: the test as a whole fails < 1 in 1000 runs


@pytest.mark.parametrize("broken", [always_accept, recover_from_p, inverted_ratio])
@pytest.mark.parametrize("k", [1, 3])
def test_broken_verifiers_are_caught(broken, k):
    result, p = run_verifier(broken, k, seed=0)
    assert position_pvalues(result, p)[0] < ALPHA


def correct_chain_verify(draft_tokens, q, p, u) -> VerifyResult:
    return chain_verify(draft_tokens, q, p, u, lambda px, qx: (px / qx).clamp(max=1), residual)


def test_chain_verify_with_correct_rules_passes():
    """The harness that builds the broken variants is itself sound with the right rules, so the
    broken variants fail because of their one wrong rule."""
    result, p = run_verifier(correct_chain_verify, k=3, seed=0)
    assert min(pv := position_pvalues(result, p)) > ALPHA / len(pv)


@pytest.mark.parametrize("k", [1, 3])
def test_deterministic_drafts_emit_the_target_distribution(k):
    """q=None: drafts are one-hot guesses (here fixed per row before sampling, like a lookup drafter)."""
    g = seeded_generator(2)
    p = random_dists(k + 1, g)  # [k+1, V]
    likely = p[:k].argmax(-1).expand(TRIALS, k)  # [B, k] the most likely token: mostly accepted
    varied = torch.randint(0, V, (TRIALS, k), generator=g, device=DEVICE)  # [B, k] arbitrary guesses: often rejected
    drafts = torch.where(torch.rand(TRIALS, 1, generator=g, device=DEVICE) < 0.5, likely, varied)  # [B, k]
    result = rejection_sample(drafts, None, expand(p), trial_uniforms(k + 1, seed=2))
    pvalues = position_pvalues(result, p)
    assert min(pvalues) > ALPHA / len(pvalues), pvalues  # Bonferroni: the test as a whole fails < 1 in 1000 runs


def test_deterministic_drafts_always_accepted_are_caught():
    g = seeded_generator(2)
    p = random_dists(2, g)  # [2, V]
    drafts = torch.zeros(TRIALS, 1, dtype=torch.long, device=DEVICE)  # [B, 1]
    one_hot = torch.zeros(TRIALS, 1, V, device=DEVICE).scatter(-1, drafts[..., None], 1.0)  # [B, 1, V]
    result = always_accept(drafts, one_hot, expand(p), trial_uniforms(2, seed=2))
    assert position_pvalues(result, p)[0] < ALPHA


@pytest.mark.parametrize("with_q", [True, False])
def test_rows_with_fewer_drafts_emit_the_target_distribution(with_q):
    """Rows draft 0..k tokens; padding drafts are p's argmax, which a verifier ignoring num_drafted
    would mostly accept. Every row must still emit p[j] at every position j it reaches."""
    k = 3
    g = seeded_generator(3)
    p, q = random_dists(k + 1, g), random_dists(k, g)  # [k+1, V], [k, V]
    num_drafted = torch.randint(0, k + 1, (TRIALS,), generator=g, device=DEVICE)  # [B]
    padded = torch.arange(k, device=DEVICE) >= num_drafted[:, None]  # [B, k]
    drafts = torch.where(padded, p[:k].argmax(-1).expand(TRIALS, k), draw_drafts(q, g))  # [B, k]
    result = rejection_sample(drafts, expand(q) if with_q else None, expand(p), trial_uniforms(k + 1, seed=3), num_drafted)
    assert (result.num_accepted <= num_drafted).all()
    pvalues = position_pvalues(result, p)
    assert min(pvalues) > ALPHA / len(pvalues), pvalues  # Bonferroni: the test as a whole fails < 1 in 1000 runs
    bonus_pvalues = [pooled_chisquare(bonus_tokens(result, num_drafted, n), p[n]) for n in range(k)]
    assert min(bonus_pvalues) > ALPHA / len(bonus_pvalues), bonus_pvalues


def bonus_tokens(result: VerifyResult, num_drafted: Tensor, n: int) -> Tensor:
    """The bonus tokens [N] of rows that drafted n tokens (n < k) and had all of them accepted."""
    rows = (num_drafted == n) & (result.num_accepted == n)  # [B]
    return result.tokens[rows, n]


def test_rows_with_no_drafts_sample_from_p():
    g = seeded_generator(4)
    p = random_dists(1, g)  # [1, V]
    no_drafts = torch.zeros(TRIALS, 0, dtype=torch.long, device=DEVICE)
    result = rejection_sample(no_drafts, None, expand(p), trial_uniforms(1, seed=4))
    assert result.tokens.shape == (TRIALS, 1)
    assert (result.num_accepted == 0).all()
    assert pooled_chisquare(result.tokens[:, 0], p[0]) > ALPHA


def test_identical_draft_and_target_accepts_everything():
    g = seeded_generator(5)
    p = random_dists(3, g)  # [3, V]
    drafts = draw_drafts(p[:2], g)  # [B, 2]
    result = rejection_sample(drafts, expand(p[:2]), expand(p), trial_uniforms(3, seed=5))
    assert (result.num_accepted == 2).all()
    assert torch.equal(result.tokens[:, :2], drafts)


# ---------------------------------------------------------------- mixed greedy / sampled batches

MIXED = [  # a batch's rows: greedy and sampled, each with its own parameters
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=0.0, top_k=2),
    SamplingParams(temperature=1.3, top_k=3, min_p=0.05),
]


def mixed_batch(k: int, seed: int, vocab: int = 8):
    """Logits [B, k+1, V], drafts [B, k] (often the target's argmax, so greedy rows accept some),
    q [B, k, V], num_drafted [B] for the MIXED rows."""
    g = seeded_generator(seed)
    B = len(MIXED)
    logits = 2 * torch.randn(B, k + 1, vocab, generator=g, device=DEVICE)
    q = (2 * torch.randn(B, k, vocab, generator=g, device=DEVICE)).softmax(-1)
    guess = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(B, k)
    agree = torch.rand(B, k, generator=g, device=DEVICE) < 0.6
    drafts = torch.where(agree, logits[:, :k].argmax(-1), guess)
    num_drafted = torch.tensor([k, k, k - 1, k, 0], device=DEVICE)
    return logits, drafts, q, num_drafted


@pytest.mark.parametrize("with_q", [True, False])
def test_mixed_rows_verify_as_if_alone(with_q):
    """Greedy rows give exactly greedy_verify (whatever u); sampled rows give exactly rejection_sample
    with their own SamplingParams, as if each row were verified alone."""
    k = 4
    logits, drafts, q, num_drafted = mixed_batch(k, seed=6)
    q = q if with_q else None
    rows = RowSampling.of(MIXED, DEVICE)
    for seed in range(3):
        u = trial_uniforms(k + 1, seed, rows=len(MIXED))
        if seed == 2:
            u = torch.full_like(u, 1 - 2**-24)  # the extreme uniforms change nothing for greedy rows
        result = verify_chain(drafts, q, logits, rows, u, num_drafted, any_sampled=True)
        greedy = greedy_verify(drafts, logits, num_drafted)
        for b, params in enumerate(MIXED):
            one = slice(b, b + 1)
            if params.greedy:
                expected = VerifyResult(greedy.tokens[one], greedy.num_accepted[one])
            else:
                p = logits_to_probs(logits[one], params)
                expected = rejection_sample(drafts[one], None if q is None else q[one], p, u[one], num_drafted[one])
            n = int(expected.num_accepted)
            assert result.num_accepted[b] == n, (b, seed)
            assert torch.equal(result.tokens[b, : n + 1], expected.tokens[0, : n + 1]), (b, seed)


def test_an_all_greedy_batch_skips_the_probabilities(monkeypatch):
    import specdec.verify as verify

    def no_probs(*args):
        raise AssertionError("probabilities computed for an all-greedy batch")

    monkeypatch.setattr(verify, "sampled_probs", no_probs)
    k = 3
    logits, drafts, q, num_drafted = mixed_batch(k, seed=7)
    rows = RowSampling.of([SamplingParams()] * len(MIXED), DEVICE)
    u = trial_uniforms(k + 1, 0, rows=len(MIXED))
    result = verify_chain(drafts, q, logits, rows, u, num_drafted, any_sampled=False)
    greedy = greedy_verify(drafts, logits, num_drafted)
    assert torch.equal(result.tokens, greedy.tokens) and torch.equal(result.num_accepted, greedy.num_accepted)


def test_mixed_batch_sampled_rows_emit_the_target_distribution():
    """verify_chain over TRIALS rows alternating greedy and sampled: the sampled rows emit p at every
    position they reach, the greedy rows the argmax."""
    k = 2
    g = seeded_generator(8)
    target_logits = 1.5 * torch.randn(k + 1, V, generator=g, device=DEVICE)  # [k+1, V]
    params = SamplingParams(temperature=1.0, top_p=0.9)
    p = logits_to_probs(target_logits, params)  # [k+1, V]
    q = random_dists(k, g)
    drafts = draw_drafts(q, g)
    rows = RowSampling.of([SamplingParams(), params] * (TRIALS // 2), DEVICE)
    result = verify_chain(drafts, expand(q), expand(target_logits), rows, trial_uniforms(k + 1, seed=8), None, True)
    sampled = VerifyResult(result.tokens[1::2], result.num_accepted[1::2])
    pvalues = position_pvalues(sampled, p)
    assert min(pvalues) > ALPHA / len(pvalues), pvalues
    greedy = greedy_verify(drafts[::2], expand(target_logits)[::2])
    assert torch.equal(result.tokens[::2], greedy.tokens) and torch.equal(result.num_accepted[::2], greedy.num_accepted)


# ---------------------------------------------------------------- graph safety


def test_chain_verification_is_graph_safe():
    k = 3
    logits, drafts, q, num_drafted = mixed_batch(k, seed=9)
    rows = RowSampling.of(MIXED, DEVICE)
    u = trial_uniforms(k + 1, 0, rows=len(MIXED))
    p = logits_to_probs(logits, rows)
    with no_host_sync():
        count_accepted(drafts > 0, num_drafted)
        remove_rejected(p[:, 0], q[:, 0])
        greedy_verify(drafts, logits, num_drafted)
        greedy_verify(drafts, logits)
        rejection_sample(drafts, q, p, u, num_drafted)
        rejection_sample(drafts, None, p, u)
        rejection_sample(drafts[:, :0], None, p[:, :1], u[:, :1])
        verify_chain(drafts, q, logits, rows, u, num_drafted, any_sampled=True)
        verify_chain(drafts, None, logits, rows, u, None, any_sampled=False)

"""verify.py: greedy acceptance on hand-built logits, and statistical losslessness of rejection sampling.

Statistical setup: the target p [k+1, V] and draft q [k, V] are fixed per position (they do not depend
on the prefix) and every batch row is an independent trial. Drafts are drawn independently per
position, so whether drafts 0..j-1 were accepted is independent of what happens at position j.
Hence, among rows that reach position j (num_accepted >= j), the emitted token at j must be
distributed exactly as p[j] (Leviathan et al. 2023, Theorem 1); that covers accepted, recovered and
bonus tokens alike. A chi-square goodness-of-fit test with threshold 1e-3 checks it; broken verifiers
defined below must fail the same check, which shows the test has power.

Everything runs on DEVICE with generators on DEVICE: CPU and CUDA draw different samples from the same
seed, and the checks hold for either stream (no test asserts a particular draw).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from torch import Tensor

from conftest import DEVICE, seeded_generator
from specdec.verify import VerifyResult, count_accepted, greedy_verify, rejection_sample

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


# ---------------------------------------------------------------- broken verifiers (must be caught)


def chain_verify(draft_tokens: Tensor, q: Tensor, p: Tensor, generator: torch.Generator, accept_prob, recover) -> VerifyResult:
    """A naive chain verifier with pluggable rules, to build broken variants from.

    draft_tokens [B, k], q [B, k, V], p [B, k+1, V]; accept_prob(p_x, q_x) -> [B, k] probabilities;
    recover(p_j, q_j) -> [B, V] distribution sampled from at the first rejection."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(B, k, generator=generator, device=p.device)  # [B, k]
    num_accepted = (u < accept_prob(p_draft, q_draft)).long().cumprod(-1).sum(-1)  # [B]
    rejected = (num_accepted < k)[:, None]  # [B, 1]
    at = num_accepted.clamp(max=k - 1)  # [B]
    p_next = torch.where(rejected, recover(p[rows, num_accepted], q[rows, at]), p[rows, num_accepted])  # [B, V]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = torch.multinomial(p_next, 1, generator=generator).squeeze(-1)
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)


def residual(p: Tensor, q: Tensor) -> Tensor:
    r = (p - q).clamp(min=0)
    return r / r.sum(-1, keepdim=True)


def always_accept(draft_tokens, q, p, generator) -> VerifyResult:
    return chain_verify(draft_tokens, q, p, generator, lambda px, qx: torch.ones_like(px), residual)


def recover_from_p(draft_tokens, q, p, generator) -> VerifyResult:
    """Right acceptance rule, but a rejection resamples from p instead of norm(max(p - q, 0))."""
    return chain_verify(draft_tokens, q, p, generator, lambda px, qx: (px / qx).clamp(max=1), lambda pj, qj: pj)


def inverted_ratio(draft_tokens, q, p, generator) -> VerifyResult:
    """Accepts with min(1, q/p) instead of min(1, p/q)."""
    return chain_verify(draft_tokens, q, p, generator, lambda px, qx: (qx / px).clamp(max=1), residual)


# ---------------------------------------------------------------- losslessness of rejection_sample


def run_verifier(verifier, k: int, seed: int) -> tuple[VerifyResult, Tensor]:
    """Random p [k+1, V], q [k, V]; drafts from q; one verifier call over TRIALS rows -> (result, p)."""
    g = seeded_generator(seed)
    p, q = random_dists(k + 1, g), random_dists(k, g)
    result = verifier(draw_drafts(q, g), expand(q), expand(p), g)
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


def correct_chain_verify(draft_tokens, q, p, generator) -> VerifyResult:
    return chain_verify(draft_tokens, q, p, generator, lambda px, qx: (px / qx).clamp(max=1), residual)


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
    result = rejection_sample(drafts, None, expand(p), g)
    pvalues = position_pvalues(result, p)
    assert min(pvalues) > ALPHA / len(pvalues), pvalues  # Bonferroni: the test as a whole fails < 1 in 1000 runs


def test_deterministic_drafts_always_accepted_are_caught():
    g = seeded_generator(2)
    p = random_dists(2, g)  # [2, V]
    drafts = torch.zeros(TRIALS, 1, dtype=torch.long, device=DEVICE)  # [B, 1]
    one_hot = torch.zeros(TRIALS, 1, V, device=DEVICE).scatter(-1, drafts[..., None], 1.0)  # [B, 1, V]
    result = always_accept(drafts, one_hot, expand(p), g)
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
    result = rejection_sample(drafts, expand(q) if with_q else None, expand(p), g, num_drafted)
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
    result = rejection_sample(torch.zeros(TRIALS, 0, dtype=torch.long, device=DEVICE), None, expand(p), g)
    assert result.tokens.shape == (TRIALS, 1)
    assert (result.num_accepted == 0).all()
    assert pooled_chisquare(result.tokens[:, 0], p[0]) > ALPHA


def test_identical_draft_and_target_accepts_everything():
    g = seeded_generator(5)
    p = random_dists(3, g)  # [3, V]
    drafts = draw_drafts(p[:2], g)  # [B, 2]
    result = rejection_sample(drafts, expand(p[:2]), expand(p), g)
    assert (result.num_accepted == 2).all()
    assert torch.equal(result.tokens[:, :2], drafts)

"""End to end: speculative sampling through the engine emits the target's own distribution.

Many identical prompts run as one batch; each row is an independent sample of the generated tokens.
Per-position marginals (and joints of neighbouring positions) of speculative and plain sampling are compared
with a two-sample chi-square test (threshold 1e-3). A broken verifier (always accept) monkeypatched into
the engine must fail the same comparison, which shows the test has power.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency
from torch import Tensor

import specdec
import specdec.verify
from conftest import tiny_pair
from specdec import SamplingParams
from specdec.engine import GenerateOutput
from specdec.sampling import sample
from specdec.verify import VerifyResult

VOCAB = 12  # small, so each position has few likely tokens and the tests have power
ROWS = 3000  # identical prompts = independent samples
PROMPT = [1, 2, 3, 0, 0, 3]  # repeats itself, so the ngram drafter finds matches
MAX_NEW = 4  # token 0 comes from the prefill; 1..3 from speculative steps
GAMMA = 3
ALPHA = 1e-3
MIN_EXPECTED = 5.0  # chi-square bins expected to hold fewer samples (in either run) are pooled


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft): tiny random Llamas sharing a VOCAB-token vocabulary."""
    folder = tmp_path_factory.mktemp("e2e")
    target = tiny_pair(folder, "llama", seed=0, logit_scale=4.0, vocab_size=VOCAB)[0]
    draft = tiny_pair(folder, "llama", seed=1, logit_scale=4.0, vocab_size=VOCAB, num_hidden_layers=1)[0]
    return target, draft


def generate(models, drafter: str, seed: int) -> GenerateOutput:
    """Sample MAX_NEW tokens for each of ROWS copies of PROMPT."""
    target, draft = models
    return specdec.generate(
        [PROMPT] * ROWS,
        model=target,
        drafter=drafter,
        gamma=GAMMA,
        sampling=SamplingParams(temperature=1.0, seed=seed),
        max_new_tokens=MAX_NEW,
        draft_model=draft,
    )


def tokens_of(out: GenerateOutput) -> Tensor:
    return torch.tensor([row.token_ids for row in out.rows])  # [ROWS, MAX_NEW] on the CPU, for the statistics


@pytest.fixture(scope="module")
def plain_tokens(models) -> Tensor:
    return tokens_of(generate(models, "none", seed=1))  # [ROWS, MAX_NEW]


def two_sample_pvalue(a: Tensor, b: Tensor, num_bins: int) -> float:
    """p-value of samples a [N], b [M] (bin ids) coming from one distribution; sparse bins pooled."""
    table = torch.stack([torch.bincount(a, minlength=num_bins), torch.bincount(b, minlength=num_bins)])  # [2, bins]
    share = torch.tensor([len(a), len(b)])[:, None] / (len(a) + len(b))  # [2, 1]
    small = (table.sum(0) * share < MIN_EXPECTED).any(0)  # [bins]
    table = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], dim=1)
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table.numpy()).pvalue)


def pair_ids(tokens: Tensor, j: int) -> Tensor:
    """[N, MAX_NEW] -> [N] one bin id per pair (token j, token j+1)."""
    return tokens[:, j] * VOCAB + tokens[:, j + 1]


def distribution_pvalues(spec: Tensor, plain: Tensor) -> dict[str, float]:
    """spec, plain [N, MAX_NEW] -> p-values of the marginals of positions 1..3 and the joints of
    neighbouring positions (1-2, 2-3)."""
    pvalues = {f"position {j}": two_sample_pvalue(spec[:, j], plain[:, j], VOCAB) for j in range(1, MAX_NEW)}
    for j in range(1, MAX_NEW - 1):
        pvalues[f"joint {j}-{j + 1}"] = two_sample_pvalue(pair_ids(spec, j), pair_ids(plain, j), VOCAB * VOCAB)
    return pvalues


@pytest.mark.parametrize("drafter, seed", [("ngram", 2), ("draft_model", 3)])
def test_speculative_sampling_matches_plain_sampling(models, plain_tokens, drafter, seed):
    out = generate(models, drafter, seed)
    assert 0 < out.stats.accepted < out.stats.drafted  # both acceptance and rejection were exercised
    pvalues = distribution_pvalues(tokens_of(out), plain_tokens)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues  # Bonferroni over the checks


def always_accept(draft_tokens, q, p, u, num_drafted=None) -> VerifyResult:
    """A broken verifier: keeps every proposed draft (draft_tokens [B, k]), then samples the bonus
    token from p [B, k+1, V] with u [B, k+1]."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    num_accepted = torch.full((B,), k, device=p.device) if num_drafted is None else num_drafted  # [B]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = sample(p[rows, num_accepted], u[:, k])
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)


@pytest.mark.parametrize("drafter, seed", [("ngram", 2), ("draft_model", 3)])
def test_a_broken_verifier_is_caught(models, plain_tokens, drafter, seed, monkeypatch):
    monkeypatch.setattr(specdec.verify, "rejection_sample", always_accept)
    specdec.clear_cache()  # a cached engine's CUDA graphs hold the real verifier: build one that traces the broken
    try:
        pvalues = distribution_pvalues(tokens_of(generate(models, drafter, seed)), plain_tokens)
    finally:
        specdec.clear_cache()  # and let no later test reuse it
    assert min(pvalues.values()) < ALPHA, pvalues

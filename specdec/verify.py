"""Verification of draft tokens against the target: pure tensor functions, no models or caches.

Conventions (names as in Leviathan et al. 2023): the target's distribution is p, the drafter's q,
gamma = k draft tokens per row. Row b proposed num_drafted[b] <= k tokens (the rest is padding).
Each row emits num_accepted[b] + 1 tokens: the accepted drafts, then either the recovered token
(sampled from norm(max(p - q, 0)) at the first rejection) or the bonus token (sampled from p after
the last draft when every draft was accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.sampling import sample


@dataclass
class VerifyResult:
    tokens: Tensor  # [B, k+1] emitted tokens; row b's first num_accepted[b] + 1 are valid
    num_accepted: Tensor  # [B] accepted draft tokens (excludes the recovered / bonus token)


def count_accepted(accept: Tensor, num_drafted: Tensor | None) -> Tensor:
    """accept [B, k] bool -> [B] length of the all-accepted prefix, capped at num_drafted [B]."""
    if num_drafted is not None:
        accept = accept & (torch.arange(accept.shape[1], device=accept.device) < num_drafted[:, None])
    return accept.long().cumprod(-1).sum(-1)


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor, num_drafted: Tensor | None = None) -> VerifyResult:
    """draft_tokens [B, k], target_logits [B, k+1, V]: keep drafts while they equal the target's argmax."""
    k = draft_tokens.shape[1]
    target_tokens = target_logits.argmax(-1)  # [B, k+1]
    num_accepted = count_accepted(draft_tokens == target_tokens[:, :k], num_drafted)
    # Accepted drafts equal the argmax, and the token after them is the argmax: emit the argmax row.
    return VerifyResult(tokens=target_tokens, num_accepted=num_accepted)


def rejection_sample(
    draft_tokens: Tensor,  # [B, k]
    q: Tensor | None,  # [B, k, V] draft distribution; None = deterministic draft (one-hot q)
    p: Tensor,  # [B, k+1, V] target distribution
    generator: torch.Generator | None,
    num_drafted: Tensor | None = None,  # [B]
) -> VerifyResult:
    """Speculative sampling: accept draft x with prob min(1, p(x)/q(x)); at the first rejection
    sample from norm(max(p - q, 0)); after k acceptances sample the bonus token from p."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(B, k, generator=generator, device=p.device)  # [B, k]
    num_accepted = count_accepted(u * q_draft < p_draft, num_drafted)  # [B]

    p_next = p[rows, num_accepted]  # [B, V] target distribution after the accepted prefix
    limit = torch.full_like(num_accepted, k) if num_drafted is None else num_drafted
    rejected = num_accepted < limit  # [B] a draft was rejected (else: bonus)
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if q is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at][:, None], 1.0)  # [B, V]
        else:
            q_next = q[rows, at]  # [B, V]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # mass == 0 only when p == q there, where a rejection has probability zero; keep p to stay finite.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    next_token = sample(p_next, generator)  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = next_token
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)

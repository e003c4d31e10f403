"""`draft_model`: a separate, smaller model with the target's vocabulary drafts k tokens
autoregressively. Its own KV cache is kept in step with the tokens the target accepted.

Cache bookkeeping per row, with L = tokens so far (the last one pending): before a proposal the
draft cache holds some prefix of the sequence; propose feeds the rest (the pending token, and after
a fully accepted step also the last draft), then drafts d1..dk, feeding d1..d(k-1). After
verification everything up to and including the accepted drafts is still valid: trim to L' - 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.drafters.base import DecodeState, DrafterOptions, Proposal, register
from specdec.errors import UserError
from specdec.sampling import logits_to_probs, sample
from specdec.verify import VerifyResult


def check_same_vocabulary(target, draft) -> None:
    t_tok, d_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if t_tok is not None and d_tok is not None:
        if t_tok.get_vocab() != d_tok.get_vocab():
            raise UserError("the draft model's tokenizer differs from the target's: their vocabularies must match")
    elif target.config.vocab_size != draft.config.vocab_size:
        raise UserError(
            f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({target.config.vocab_size})"
        )


def fit_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Pad (with -inf) or cut the draft's logits [..., V_draft] to the target's vocab size."""
    extra = vocab_size - logits.shape[-1]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits[..., :vocab_size]


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, target, draft) -> None:
        check_same_vocabulary(target, draft)
        self.draft = draft
        self.vocab_size = target.config.vocab_size
        self.cache = None

    def max_tokens(self, gamma: int) -> int:
        return gamma

    def prefill(self, state: DecodeState) -> None:
        self.cache = self.draft.new_cache(state.batch_size, state.max_len)

    def propose(self, state: DecodeState, k: int) -> Proposal:
        B, dev = state.batch_size, state.device
        have = self.cache.lengths.tolist()
        feeds = [row[h:] if state.active[b] else row[-1:] for b, (row, h) in enumerate(zip(state.tokens, have))]
        for b in range(B):
            if not state.active[b]:  # keep finished rows parked on their last slot
                self.cache.lengths[b] = len(state.tokens[b]) - 1
        T = max(len(f) for f in feeds)
        block = torch.tensor([f + [f[-1]] * (T - len(f)) for f in feeds], device=dev)  # [B, T] right-padded
        start = self.cache.lengths.clone()  # [B]
        counts = torch.tensor([len(f) for f in feeds], device=dev)  # [B]
        out = self.draft(block, start[:, None] + torch.arange(T, device=dev), self.cache, logits_at=counts - 1)
        self.cache.trim(start + counts)
        tokens, probs = [], []
        logits = out.logits[:, -1]  # [B, V]
        for i in range(k):
            token, q = self.draw(logits, state)
            tokens.append(token)
            probs.append(q)
            if i < k - 1:
                positions = self.cache.lengths[:, None].clone()  # [B, 1]
                logits = self.draft(token[:, None], positions, self.cache).logits[:, -1]
        num_drafted = torch.tensor([k if a else 0 for a in state.active], device=dev)
        return Proposal(
            tokens=torch.stack(tokens, 1),  # [B, k]
            probs=None if state.sampling.greedy else torch.stack(probs, 1),  # [B, k, V]
            num_drafted=num_drafted,
        )

    def draw(self, logits: Tensor, state: DecodeState) -> tuple[Tensor, Tensor | None]:
        """Draft logits [B, V_draft] -> token [B] and q [B, V] (None when greedy)."""
        logits = fit_vocab(logits, self.vocab_size)
        if state.sampling.greedy:
            return logits.argmax(-1), None
        q = logits_to_probs(logits, state.sampling)
        return sample(q, state.generator), q

    def commit(self, state: DecodeState, result: VerifyResult) -> None:
        keep = torch.tensor([len(row) - 1 for row in state.tokens], device=self.cache.lengths.device)
        self.cache.trim(keep)


@register("draft_model")
def build(target, options: DrafterOptions) -> DraftModelDrafter:
    draft = options.draft_model
    if draft is None:
        raise UserError("the draft_model drafter needs a draft model (--draft-model PATH)")
    if isinstance(draft, str):
        from specdec.models import load_model

        p = next(target.parameters())
        draft = load_model(draft, dtype=p.dtype, device=str(p.device))
    return DraftModelDrafter(target, draft)

"""`draft_model`: a separate, smaller model with the target's vocabulary drafts k tokens
autoregressively. Its own KV cache is kept in step with the tokens the target accepted.

Cache bookkeeping per row, with L = tokens so far (the last one pending): before a proposal the
draft cache holds some prefix of the sequence; propose feeds the rest (the pending token, and after
a fully accepted step also the last draft), then drafts d1..dk, feeding d1..d(k-1). After
verification everything up to and including the accepted drafts is still valid: trim to L' - 1.

Shared-embedding drafts (`specdec train draft`): a folder whose config.json says
"specdec_shared_embeddings": true holds only the decoder layers and final norm (HF names, any float
dtype); the embeddings and LM head are the target's, borrowed at load time. With a `d2t` tensor
([Vd] target ids) in its model.safetensors, the draft reads out only those LM-head rows and its
logits are -inf elsewhere (q = 0 there: still lossless, and Vd rows cost Vd/V of the full read-out).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from specdec.drafters.base import DecodeState, DrafterOptions, Proposal, register
from specdec.drafters.shipped import trained_folder
from specdec.errors import UserError
from specdec.models.linear import Linear, use_cpu_kernels
from specdec.models.llama import LlamaModel, ModelConfig, ModelOutput
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
        num_drafted = torch.tensor([k if a else 0 for a in state.active], device=dev)  # [B]
        for i in range(k):
            token, q = self.draw(logits, state)
            tokens.append(token)
            probs.append(q)
            if state.draft_threshold is not None and i > 0:  # confidence policy: cut rows at their first unsure token
                unsure = logits.float().softmax(-1).amax(-1) < state.draft_threshold  # [B]
                num_drafted = torch.where(unsure & (num_drafted > i), i, num_drafted)
                if int(num_drafted.max()) <= i:
                    break
            if i < k - 1:
                positions = self.cache.lengths[:, None].clone()  # [B, 1]
                logits = self.draft(token[:, None], positions, self.cache).logits[:, -1]
        return Proposal(
            tokens=torch.stack(tokens, 1),  # [B, k'] (k' <= k when every row stopped early)
            probs=None if state.sampling.greedy else torch.stack(probs, 1),  # [B, k', V]
            num_drafted=num_drafted.clamp(max=len(tokens)),
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


class SharedDraftModel(LlamaModel):
    """A draft whose embeddings and LM head are the target's; `d2t` [Vd] (or None: the full LM head)
    says which target ids its read-out covers."""

    d2t: Tensor | None = None

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, cache, mask: Tensor | None = None,
                logits_at: Tensor | None = None) -> ModelOutput:
        out = super().forward(tokens, positions, cache, mask, logits_at)
        if self.d2t is None:
            return out
        full = out.logits.new_full((*out.logits.shape[:-1], self.config.vocab_size), float("-inf"))  # [B, T, V]
        return ModelOutput(logits=full.index_copy_(-1, self.d2t, out.logits), hidden=out.hidden)


def is_shared_draft(name: str) -> bool:
    config = Path(name).expanduser() / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("specdec_shared_embeddings"))


def load_shared_draft(folder: str | Path, target) -> SharedDraftModel:
    """A shared-embedding draft folder (see the module docstring), placed like the target."""
    from specdec.models.loading import fuse_hf_weights

    folder = Path(folder).expanduser()
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    t = target.config
    if (config.vocab_size, config.hidden_size) != (t.vocab_size, t.hidden_size):
        raise UserError(f"{folder}: this draft was trained for another target (vocabulary or width differ)")
    if not (folder / "model.safetensors").exists():
        raise UserError(f"{folder}: no model.safetensors")
    p = next(target.parameters())
    state = load_file(str(folder / "model.safetensors"))
    d2t = state.pop("d2t", None)
    state["model.embed_tokens.weight"] = target.embed_tokens.weight  # for the name mapping only: borrowed below
    state["lm_head.weight"] = target.lm_head.weight
    try:
        fused = fuse_hf_weights(state, config)
    except KeyError as e:
        raise UserError(f"{folder}: draft weights missing from model.safetensors ({e})") from None
    with torch.device("meta"):
        draft = SharedDraftModel(config)
    own = {k: v.to(device=p.device, dtype=p.dtype) for k, v in fused.items() if k.startswith(("layers.", "norm."))}
    draft.load_state_dict(own, assign=True, strict=False)
    borrow_target_weights(draft, target, None if d2t is None else d2t.long())
    use_cpu_kernels(draft.layers)
    draft.name = str(folder)
    return draft


def borrow_target_weights(draft: SharedDraftModel, target, d2t: Tensor | None, kernels: bool = True) -> SharedDraftModel:
    """Give `draft` (its own layers and norm already in place) the target's embeddings and LM head, or
    a copy of that head's rows d2t [Vd] (packed for the CPU kernel unless kernels=False)."""
    p = next(target.parameters())
    draft.embed_tokens = target.embed_tokens
    draft.inv_freq = draft.inv_freq.to(p.device)
    if d2t is None:
        draft.lm_head = target.lm_head
    else:
        draft.d2t = d2t.to(p.device)
        draft.lm_head = Linear(draft.config.hidden_size, len(d2t), bias=False, device=p.device, dtype=p.dtype)
        draft.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach()[draft.d2t].clone(), requires_grad=False)
        if kernels:
            use_cpu_kernels(draft.lm_head)
    return draft.eval()


def load_draft(draft, target):
    """A loaded draft as is; a name or path through load_model, or load_shared_draft for a shared-embedding folder."""
    if not isinstance(draft, str):
        return draft
    if is_shared_draft(draft):
        return load_shared_draft(draft, target)
    from specdec.models import load_model

    p = next(target.parameters())
    return load_model(draft, dtype=p.dtype, device=str(p.device))


@register("draft_model")
def build(target, options: DrafterOptions) -> DraftModelDrafter:
    draft = options.draft_model
    if draft is None:
        draft = trained_folder("draft", target, None, "--draft-model")
    return DraftModelDrafter(target, load_draft(draft, target))

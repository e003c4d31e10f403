"""`draft_model`: a separate, smaller model with the target's vocabulary drafts k tokens
autoregressively. Its own KV cache (one row per slot) is kept in step with the tokens the target kept.

Cache bookkeeping per row, with L = tokens so far (the last one pending): the cache length is what the
draft has been fed of the row's kept tokens, and it is fed lazily (catch_up.py). A proposal first feeds
every running row its tokens from its cache length to L - 1 (`catch_up`: the token the last step added
beyond the drafts it fed, or whatever the steps at gamma 0 since its last draft added), whose last
logits give d1, then drafts d1..dk, feeding d1..d(k-1) (each possibly rejected), and leaves the cache at
L; `commit` adds the accepted drafts the draft was fed (at most k - 1), so after a drafting step a row
lags by one or two tokens (`Lag.behind`). A step at gamma 0 runs no draft forward at all. How the
catch-up feeds depends on the stepper:

- eager stepper on the CPU (`catches_up(batch)`), in gaps: `join` feeds nothing (the prompt is a row's
  first gap), and each row is fed exactly its gap.
- any other stepper (graphed ones, and eager ones on a GPU), in chunks of SHORT_GAP positions: `join`
  runs the draft over the prompt, and the host runs more chunks before a propose after a long stretch
  at gamma 0 (Stepper.launch), so every shape is fixed and the proposal is captured in a CUDA graph.
  (Before, a graphed proposal fed each row's last two tokens: after a stretch at gamma 0 the slots in
  between held no keys and values of the row's tokens, and the next drafts attended to stale entries.)

Shared-embedding drafts (`specdec train draft`): a folder whose config.json says
"specdec_shared_embeddings": true holds only the decoder layers and final norm (HF names, any float
dtype); the embeddings and LM head are the target's, borrowed at load time. With a `d2t` tensor
([Vd] target ids) in its model.safetensors, the draft reads out only those LM-head rows and its
logits are -inf elsewhere (q = 0 there: still lossless, and Vd rows cost Vd/V of the full read-out).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Verified, register
from specdec.drafters.catch_up import SHORT_GAP, Lag, catches_up, feed_chunk, feed_gaps
from specdec.drafters.shipped import trained_folder
from specdec.errors import UserError, first_line
from specdec.kv_cache import KVCache
from specdec.models.checkpoint import check_shapes, read_config, read_weights
from specdec.models.linear import take_rows, use_cpu_kernels
from specdec.models.llama import LlamaModel, ModelConfig, ModelOutput
from specdec.models.views import follow_kernels
from specdec.sampling import greedy_tokens, logits_to_probs, sample


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


def draw(logits: Tensor, batch, u: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Draft logits [B, V] -> tokens [B] and q [B, V]: argmax when no row samples (q = None, one-hot),
    else each row's own sampling parameters (greedy rows still take the argmax) with uniforms u [B]."""
    if u is None:
        return greedy_tokens(logits), None
    q = logits_to_probs(logits, batch.sampling)
    return sample(q, u), q


@dataclass
class DraftState:
    cache: KVCache  # the draft's, one row per slot (SHORT_GAP spare slots: a catch-up's padding), or `follows`'s view
    lag: Lag | None = None  # a chunked catch-up's host-side bound; None: in gaps (catch_up.py)
    # [B] the target cache's lengths, where `cache` is a view of the target's own first layers (layer_skip):
    # the draft has then been fed whatever the target has read, all but a row's pending token
    follows: Tensor | None = None


class DraftModelDrafter:
    name = "draft_model"
    graphable = True

    def __init__(self, target, draft) -> None:
        check_same_vocabulary(target, draft)
        self.draft = draft
        self.vocab_size = target.config.vocab_size

    def shape(self, gamma: int) -> DraftShape:
        return DraftShape(width=gamma, depth=gamma, lanes=gamma)

    def attach(self, batch) -> None:
        cache = self.draft.new_cache(batch.capacity, batch.max_len + SHORT_GAP, static=batch.static)
        # fed its drafts, a row lags a drafting step by the target's token, and the last draft if all were kept
        batch.draft = DraftState(cache, None if catches_up(batch) else Lag(SHORT_GAP, behind=2))

    def join(self, batch, slots: Tensor, hidden: Tensor) -> None:
        """In gaps: nothing fed yet. In chunks: run the draft over the new rows' prompts (into a scratch
        cache), then copy that into their slots."""
        cache = batch.draft.cache
        if batch.draft.lag is None:
            cache.lengths.index_fill_(0, slots, 0)
            return
        lengths = batch.prompt_length[slots]  # [n]
        T = hidden.shape[1]
        # its T slots are all written: no overflow check (a host wait, which a captured join cannot make)
        scratch = self.draft.new_cache(len(slots), T, static=True)
        prompts = batch.tokens[slots, :T]  # [n, T] right-padded (the pad is later output or zeros: never read)
        self.draft(prompts, torch.arange(T, device=prompts.device).expand_as(prompts), scratch, logits_at=lengths - 1)
        cache.k[:, slots, :, :T] = scratch.k
        cache.v[:, slots, :, :T] = scratch.v
        cache.lengths[slots] = lengths

    def propose(self, batch, gamma: int, u: Tensor | None) -> Proposal:
        cache = batch.draft.cache
        L = batch.length  # [B] tokens so far, the last one pending
        known = cache.lengths.clone()  # [B]
        logits = self.catch_up(batch)  # [B, V_draft] at the pending token
        tokens, probs = [], []
        num_drafted = torch.full_like(L, gamma)  # [B]
        for i in range(gamma):
            logits = fit_vocab(logits, self.vocab_size)
            token, q = draw(logits, batch, None if u is None else u[:, i])
            tokens.append(token)
            probs.append(q)
            if batch.confidence is not None and i > 0:  # confidence policy: cut rows at their first unsure token
                unsure = logits.softmax(-1).amax(-1) < batch.confidence  # [B]
                num_drafted = torch.where(unsure & (num_drafted > i), i, num_drafted)
            if i < gamma - 1:
                logits = self.draft(token[:, None], (L + i)[:, None], cache).logits[:, -1]
        cache.lengths.copy_(torch.where(batch.active, L, known))  # the row's tokens (the drafts may be rejected)
        return Proposal(tokens=torch.stack(tokens, 1), q=None if u is None else torch.stack(probs, 1),
                        num_drafted=num_drafted)

    def catch_up(self, batch) -> Tensor:
        """Feed every running row its tokens from its cache length to L - 1 (in gaps: all of them, one
        forward for the rows a step or a few behind, one per row further behind; in chunks: up to Lag.width);
        [B, V_draft] logits at the pending token (zeros for rows not running: they draft, masked, from
        nothing)."""
        state = batch.draft
        if state.follows is not None:
            state.cache.lengths.copy_(state.follows)
        gap = torch.where(batch.active, batch.length - state.cache.lengths, 0).clamp(min=0)  # [B] tokens to feed

        def feed(view: KVCache, rows: slice, positions: Tensor, last: Tensor) -> Tensor:
            tokens = batch.tokens[rows].gather(1, positions.clamp(max=batch.max_len - 1))  # [n, w]
            return self.draft(tokens, positions, view, logits_at=last).logits[:, -1]  # [n, V_draft]

        if state.lag is not None:
            return feed_chunk(state.cache, gap, feed, state.lag.width)
        logits = feed_gaps(state.cache, gap, feed)
        if logits is None:  # no row running: nothing to draft from
            return torch.zeros(batch.capacity, self.draft.config.vocab_size, device=batch.device)
        return logits

    def commit(self, batch, verified: Verified) -> None:
        """The accepted drafts the proposal fed (d1..d(k-1)) are the row's tokens now."""
        fed = max(verified.proposal.tokens.shape[1] - 1, 0)
        batch.draft.cache.lengths += torch.where(verified.kept > 0, verified.accepted.clamp(max=fed), 0)


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
    folder = Path(name).expanduser()
    return (folder / "config.json").is_file() and bool(read_config(folder, "a draft model folder").get("specdec_shared_embeddings"))


def load_shared_draft(folder: str | Path, target) -> SharedDraftModel:
    """A shared-embedding draft folder (see the module docstring), placed like the target."""
    from specdec.models.loading import fuse_hf_weights

    folder = Path(folder).expanduser()
    config = ModelConfig.from_hf(read_config(folder, "a draft model folder"), f"{folder}/config.json")
    t = target.config
    if (config.vocab_size, config.hidden_size) != (t.vocab_size, t.hidden_size):
        raise UserError(f"{folder}: this draft was trained for another target (vocabulary or width differ)")
    p = next(target.parameters())
    state = read_weights(folder / "model.safetensors")
    d2t = state.pop("d2t", None)
    state["model.embed_tokens.weight"] = target.embed_tokens.weight  # for the name mapping only: borrowed below
    state["lm_head.weight"] = target.lm_head.weight
    try:
        fused = fuse_hf_weights(state, config)
    except KeyError as e:
        raise UserError(f"{folder}: draft weights missing from model.safetensors ({e})") from None
    except RuntimeError as e:  # torch.cat of q/k/v or gate/up pieces of the wrong widths
        raise UserError(f"{folder}/model.safetensors does not match its config.json: {first_line(e)}") from None
    with torch.device("meta"):
        draft = SharedDraftModel(config)
    own = {k: v.to(device=p.device, dtype=p.dtype) for k, v in fused.items() if k.startswith(("layers.", "norm."))}
    check_shapes(own, draft.state_dict(), f"{folder}/model.safetensors")
    draft.load_state_dict(own, assign=True, strict=False)
    borrow_target_weights(draft, target, None if d2t is None else d2t.long())
    use_cpu_kernels(draft.layers)
    follow_kernels(draft, target)
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
        draft.lm_head = take_rows(target.lm_head, draft.d2t, p.dtype, dequantize=not kernels)
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
    library = any(getattr(m, "kernels", None) == "library" for m in target.modules())
    return load_model(draft, dtype=p.dtype, device=str(p.device), kernels="library" if library else "auto")


@register("draft_model")
def build(target, options: DrafterOptions) -> DraftModelDrafter:
    draft = options.draft_model
    if draft is None:
        draft = trained_folder("draft", target, None, "--draft-model")
    return DraftModelDrafter(target, load_draft(draft, target))

"""Any transformers AutoModelForCausalLM behind the specdec model contract (slower path, batch 1).

Architectures without a native implementation still get lossless speculative decoding through
this adapter: the cache is transformers' DynamicCache, and `trim` crops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specdec.errors import UserError
from specdec.models.llama import ModelOutput


@dataclass(frozen=True)
class AdapterConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


class HFCache:
    """A DynamicCache with the KVCache interface (lengths, trim) for one row."""

    def __init__(self, max_len: int, device: torch.device) -> None:
        from transformers import DynamicCache

        self.past = DynamicCache()
        self.lengths = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.max_len = max_len

    @property
    def batch_size(self) -> int:
        return 1

    def trim(self, lengths: Tensor) -> None:
        n = min(int(self.lengths[0]), int(lengths[0]))
        if n < int(self.lengths[0]):  # crop takes minus the number of tokens to drop (transformers 5 refuses n > 0)
            self.past.crop(n - int(self.lengths[0]))
        self.lengths.fill_(n)


class HFAdapter(nn.Module):
    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model.eval()
        c = hf_model.config
        eos = c.eos_token_id
        self.config = AdapterConfig(
            model_type=c.model_type,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ()),
        )
        self.tokenizer = None

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, batch_size: int, max_len: int) -> HFCache:
        if batch_size != 1:
            raise UserError(
                f"the transformers adapter (used for model type {self.config.model_type!r}) runs batch size 1 only; "
                f"got {batch_size}. Native Llama-family models run any batch size."
            )
        return HFCache(max_len, next(self.hf.parameters()).device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [1, T]
        positions: Tensor,  # [1, T]
        cache: HFCache,
        mask: Tensor | None = None,
        logits_at: Tensor | None = None,  # [1]
        aux_layers: tuple[int, ...] | None = None,  # HF's hidden_states[i]: the input of layer i (llama.py)
    ) -> ModelOutput:
        if mask is not None:
            raise UserError("tree attention masks need a native model; the transformers adapter runs chains only")
        if int(cache.lengths[0]) + tokens.shape[1] > cache.max_len:
            raise UserError(f"sequence would exceed the context of {cache.max_len} tokens")
        out = self.hf(
            input_ids=tokens, position_ids=positions, past_key_values=cache.past, use_cache=True, output_hidden_states=True
        )
        cache.lengths += tokens.shape[1]
        logits = out.logits if logits_at is None else out.logits[:, logits_at[0] : logits_at[0] + 1]
        aux = None if aux_layers is None else torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)
        return ModelOutput(logits=logits.float(), hidden=out.hidden_states[-1], aux=aux)


def load_hf_adapter(folder: Path, dtype: torch.dtype, device: torch.device) -> HFAdapter:
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"transformers could not load {folder}: {str(e).splitlines()[0]}") from e
    return HFAdapter(hf.to(device))

"""Peer baselines measured in the same run, on the same prompts, as specdec's own methods.

- `hf`: transformers `generate`, plain (greedy or sampling), the same weights and dtype;
- `hf-pld`: transformers prompt lookup decoding (`prompt_lookup_num_tokens` = gamma);
- `hf-assisted`: transformers assisted generation with the draft model (`num_assistant_tokens` = gamma,
  constant schedule, so each gamma is what it says);
- `llamacpp` / `llamacpp-pld` / `llamacpp-draft`: llama.cpp through llama-cpp-python, when installed and
  the target is a GGUF file: plain, prompt lookup, and draft-model speculation with a draft GGUF
  (`--draft-gguf`; benchmarks/draft_gguf.py writes specdec's draft as one). llama.cpp quantises
  activations to 8 bits in its CPU products where specdec keeps float32, so its outputs need not equal
  specdec's even on the same quantised file (benchmarks/llamacpp_agreement.py measures how often they
  agree); it is a speed reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import SamplingParams
from specdec.errors import UserError

PEERS = ("hf", "hf-pld", "hf-assisted", "llamacpp", "llamacpp-pld", "llamacpp-draft")


@dataclass
class PeerOutput:
    token_ids: list[int]  # generated tokens (EOS included when it ended the output)
    wall_s: float


def hf_generate_kwargs(sampling: SamplingParams) -> dict:
    """`generate` settings that draw from the distribution specdec samples (temperature, then top-k, top-p
    and min-p, the order transformers applies them in). Each is passed even when off, because one left out
    falls back to the model's or transformers' default (top_k 50). transformers skips top_k 0 and top_p 1 as off,
    but applies min-p whenever it is not None, so min_p 0 goes as None."""
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": sampling.min_p or None}


def neutral_generation_config(loaded):
    """A GenerationConfig with only the special token ids of `loaded` (the model folder's
    generation_config.json). `generate` fills every setting a call leaves out from the model's own config,
    so a shipped temperature, top_p, min_p or repetition_penalty would otherwise change what the peer
    samples, and a repetition penalty would change even its greedy output."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=loaded.bos_token_id, eos_token_id=loaded.eos_token_id, pad_token_id=loaded.pad_token_id
    )


class HFPeer:
    """transformers `generate` on an AutoModelForCausalLM loaded from the target's own folder."""

    def __init__(self, folder: str, dtype: torch.dtype, device: torch.device, assistant_folder: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.model.generation_config = neutral_generation_config(self.model.generation_config)
        self.device = device
        self.assistant = None
        if assistant_folder is not None:
            self.assistant = AutoModelForCausalLM.from_pretrained(assistant_folder, dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, mode: str, gamma: int = 0) -> PeerOutput:
        ids = torch.tensor([prompt], device=self.device)
        kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": max_new_tokens, **hf_generate_kwargs(sampling)}
        if mode == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = gamma
        elif mode == "hf-assisted":
            if self.assistant is None:
                raise UserError("hf-assisted needs a draft model (--draft-model)")
            self.assistant.generation_config.num_assistant_tokens = gamma
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            kwargs["assistant_model"] = self.assistant
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        t = time.perf_counter()
        out = self.model.generate(ids, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return PeerOutput(token_ids=out[0, len(prompt):].tolist(), wall_s=time.perf_counter() - t)


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_draft_model(path: Path, gamma: int, threads: int, context: int):
    """A llama-cpp-python draft model (its speculative loop's interface) that runs a draft GGUF in llama.cpp
    and proposes its `gamma` greedy tokens; it keeps its own cache across calls, re-reading only what
    differs from what it read last."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class DraftGGUF(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads, verbose=False)

        def __call__(self, input_ids, /, **kwargs):
            llm, ids = self.llm, [int(t) for t in input_ids]
            known = llm.input_ids[: llm.n_tokens].tolist()
            same = next((i for i, (a, b) in enumerate(zip(known, ids)) if a != b), min(len(known), len(ids)))
            llm.n_tokens = min(same, len(ids) - 1)  # eval drops the cache past n_tokens; read at least one token
            llm.eval(ids[llm.n_tokens:])
            drafted = []
            for i in range(gamma):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                drafted.append(int(logits.argmax()))
                if i + 1 < gamma:
                    llm.eval(drafted[-1:])
            return np.array(drafted, dtype=np.intc)

    return DraftGGUF()


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) on the target's GGUF file; `draft`: a draft GGUF for llamacpp-draft."""

    def __init__(self, gguf: Path, threads: int, context: int, draft: Path | None = None) -> None:
        from llama_cpp import Llama

        self.gguf, self.threads, self.context, self.draft = gguf, threads, context, draft
        self.plain = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, verbose=False)
        self.speculative: dict[tuple[str, int], object] = {}

    def model_for(self, mode: str, gamma: int):
        if mode == "llamacpp":
            return self.plain
        if (mode, gamma) not in self.speculative:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            drafter = (LlamaPromptLookupDecoding(num_pred_tokens=gamma) if mode == "llamacpp-pld"
                       else llama_cpp_draft_model(self.draft, gamma, self.threads, self.context))
            self.speculative[mode, gamma] = Llama(model_path=str(self.gguf), n_ctx=self.context, n_threads=self.threads,
                                                  verbose=False, draft_model=drafter)
        return self.speculative[mode, gamma]

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, mode: str, gamma: int = 0) -> PeerOutput:
        llm = self.model_for(mode, gamma)
        llm.reset()
        t = time.perf_counter()
        tokens: list[int] = []
        params = {"temp": 0.0, "top_k": 1} if sampling.greedy else llama_cpp_sampling(sampling)
        for token in llm.generate(prompt, reset=True, **params):
            tokens.append(token)
            if token == llm.token_eos() or len(tokens) >= max_new_tokens:
                break
        return PeerOutput(token_ids=tokens, wall_s=time.perf_counter() - t)


def llama_cpp_sampling(sampling: SamplingParams) -> dict:
    """llama-cpp-python `generate` settings for a sampled run. Each is passed because its defaults are not
    off (top_k 40, top_p 0.95, min_p 0.05); llama.cpp treats top_k 0, top_p 1 and min_p 0 as off, as specdec
    does. It applies the temperature after the filters, so with top-p or min-p on the kept set can differ."""
    return {"temp": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p}

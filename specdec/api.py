"""The one-call Python API: `specdec.generate(prompts, model=..., drafter=..., gamma=...)`."""

from __future__ import annotations

from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import DrafterOptions
from specdec.engine import GenerateOutput, SpecEngine
from specdec.errors import UserError
from specdec.models import load_model


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids for `prompt`; with chat=True wrapped in the tokenizer's chat template as a user turn."""
    if not prompt or not prompt.strip():
        raise UserError("the prompt is empty")
    if chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def generate(
    prompts: str | list[str] | list[list[int]],
    model="default",
    drafter: str = "ngram",
    gamma: int = 4,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 256,
    draft_model=None,
    stop: tuple[str, ...] = (),
    chat: bool = True,
    ngram_max: int = 3,
    ngram_min: int = 1,
) -> GenerateOutput:
    """Generate for one prompt or a batch. `model` and `draft_model` are names/paths or loaded models;
    prompts are strings (chat template applied unless chat=False) or lists of token ids."""
    target = load_model(model) if isinstance(model, str) else model
    config = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens, stop=tuple(stop), sampling=sampling or SamplingParams())
    options = DrafterOptions(draft_model=draft_model, ngram_max=ngram_max, ngram_min=ngram_min)
    engine = SpecEngine(target, drafter, options)
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompts and all(isinstance(p, str) for p in prompts):
        if target.tokenizer is None:
            raise UserError("this model has no tokenizer: pass token ids instead of strings")
        prompts = [encode_prompt(target.tokenizer, p, chat) for p in prompts]
    return engine.generate(prompts, config)

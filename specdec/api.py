"""The one-call Python API: `specdec.generate(prompts, model=..., drafter=..., gamma=...)`."""

from __future__ import annotations

from collections import OrderedDict

from specdec.config import SamplingParams, spec_config_for
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


# Loaded models (by name) and engines (by target, drafter and options) that `generate` reuses across
# calls: an engine holds its drafter's heads and its CUDA graphs, which take seconds to rebuild. A
# cached engine keeps its target alive; `clear_cache()` lets them go.
MODELS: OrderedDict[str, object] = OrderedDict()
ENGINES: OrderedDict[tuple, SpecEngine] = OrderedDict()
MAX_MODELS, MAX_ENGINES = 2, 4


def clear_cache() -> None:
    """Forget the models and engines `generate` kept (their memory is freed once nothing else holds them)."""
    MODELS.clear()
    ENGINES.clear()


def remember(cache: OrderedDict, key, build, limit: int):
    """cache[key], built by build() on a miss; the least recently used entry beyond `limit` is dropped."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    cache[key] = value = build()
    while len(cache) > limit:
        cache.popitem(last=False)
    return value


def identity(x) -> object:
    """A cache key part: a name as itself, a loaded model by identity (the cached engine keeps it alive,
    so its id cannot be reused while the entry exists)."""
    return x if x is None or isinstance(x, str) else ("object", id(x))


def generate(
    prompts: str | list[str] | list[list[int]],
    model="default",
    drafter: str = "ngram",
    gamma: int | str = 4,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 256,
    draft_model=None,
    stop: tuple[str, ...] = (),
    chat: bool = True,
    ngram_max: int = 3,
    ngram_min: int = 1,
    gamma_policy: str = "cost",
) -> GenerateOutput:
    """Generate for one prompt or a batch. `model` and `draft_model` are names/paths or loaded models;
    prompts are strings (chat template applied unless chat=False) or lists of token ids. Models loaded
    by name and the engine (drafter heads, CUDA graphs) are kept for the next call with the same
    model, drafter and options (see clear_cache). gamma: draft tokens per step, or "auto" (chosen per row
    by `gamma_policy`, as the CLI's `--gamma auto`)."""
    target = remember(MODELS, model, lambda: load_model(model), MAX_MODELS) if isinstance(model, str) else model
    config = spec_config_for(gamma, gamma_policy, max_new_tokens=max_new_tokens, stop=tuple(stop),
                             sampling=sampling or SamplingParams())
    options = DrafterOptions(draft_model=draft_model, ngram_max=ngram_max, ngram_min=ngram_min)
    key = (identity(target), drafter, identity(draft_model), ngram_max, ngram_min)
    engine = remember(ENGINES, key, lambda: SpecEngine(target, drafter, options), MAX_ENGINES)
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompts and all(isinstance(p, str) for p in prompts):
        if target.tokenizer is None:
            raise UserError("this model has no tokenizer: pass token ids instead of strings")
        prompts = [encode_prompt(target.tokenizer, p, chat) for p in prompts]
    return engine.generate(prompts, config)

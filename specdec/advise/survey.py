"""The speculative-decoding family as a table: what drafts, what verifies, how hard it is to retrofit,
when it is at its best, and what its authors published. `advise` puts its own measurements beside
these columns; the published figures are theirs (other models, other hardware) and are always shown
as published, with their source.

complexity ranks the work of adopting a method on an existing deployment, 1 (a flag) to 5 (train a
network against the target's hidden features); `easiest_retrofit` in decide.py ranks by it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    drafter: str  # specdec's drafter name
    method: str  # the method's usual name
    drafts: str  # what proposes the draft tokens
    verifies: str  # what the target checks in its one forward
    complexity: int  # 1 (a flag) .. 5 (train a head on the target's features)
    retrofit: str  # what adopting it takes
    trained: bool  # needs a trained drafter for this target
    best_when: str
    published: str  # typical speedup as published (their models and hardware)
    source: str


FAMILIES: dict[str, Family] = {f.drafter: f for f in (
    Family("ngram", "Prompt lookup (n-gram)", "the continuation of the latest n-gram match in the prompt and output",
           "a chain", 1, "a flag: no model, no training (transformers `prompt_lookup_num_tokens`, vLLM `ngram`)", False,
           "the output copies its input: summaries, document QA, code edits, RAG",
           "2-4x on input-grounded tasks", "Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding"),
    Family("layer_skip", "Self-speculation (layer skip)", "the target itself with some decoder layers skipped",
           "a chain", 2, "no new weights; pick the layers once (`specdec tune layer-skip`)", False,
           "no draft model exists and memory is tight",
           "up to 1.99x (LLaMA-2, no training)", "Zhang et al. 2024, Draft & Verify, arXiv:2309.08168"),
    Family("quantized", "Quantized self-draft", "an int8 weight-only copy of the target", "a chain", 2,
           "no training; a second, smaller copy of the weights (CPU kernel)", False,
           "the target is bandwidth-bound and its int8 copy agrees with it",
           "no published figure used here", "-"),
    Family("lookahead", "Lookahead decoding", "n-grams from Jacobi iterations kept in a pool",
           "Jacobi window and candidate n-grams in one forward", 3, "no model; a custom attention layout per step",
           False, "spare compute at batch 1 and repetitive text; no draft model",
           "up to 1.8x (MT-bench, one GPU), up to 4x (code, several GPUs)",
           "Fu et al. 2024, ICML, arXiv:2402.02057"),
    Family("draft_model", "Draft model (vanilla)", "a small model with the target's tokenizer", "a chain", 3,
           "a second model of the same vocabulary, served beside the target", True,
           "a small sibling model exists (same family) and agrees with the target",
           "2-3x (T5-XXL with a T5-small draft)",
           "Leviathan et al. 2023, ICML, arXiv:2211.17192"),
    Family("medusa", "Medusa heads", "extra heads on the target's last hidden state, one per position",
           "a tree of the heads' top candidates", 4, "train heads on the target's outputs (`specdec train medusa`)",
           True, "a trained head set exists for this target, on its domain",
           "2.2-3.6x (Vicuna 7B-33B, Zephyr 7B)", "Cai et al. 2024, ICML, arXiv:2401.10774"),
    Family("eagle", "EAGLE / EAGLE-2", "a one-layer head extrapolating the target's features",
           "a dynamic draft tree", 5, "train a head against the target's features (`specdec train eagle`)", True,
           "a trained head exists for this target, on its domain: the fastest there",
           "2.7-3.5x (EAGLE, LLaMA2-Chat 70B), 3.05-4.26x (EAGLE-2)",
           "Li et al. 2024, arXiv:2401.15077 (EAGLE) and arXiv:2406.16858 (EAGLE-2)"),
)}


def family_of(drafter: str) -> Family | None:
    return FAMILIES.get(drafter)

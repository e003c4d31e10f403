"""Top-1 agreement of specdec's native quantised target with llama.cpp's logits on the same tokens.

For each prompt: specdec decodes greedily (plain) `--tokens` tokens; then both models read the same
sequence (prompt + those tokens) in one teacher-forced pass, and the argmax of their logits is compared
at every generated position. specdec's CPU kernels keep activations in float32; llama.cpp's CPU path
quantises them to 8 bits per block of 32 (Q8_1) before its integer dot products, so the two differ by
that rounding, and at near-ties the argmax may differ. A kernel bug (a wrong nibble order, a swapped
scale, rows of q or k left permuted) shows as agreement far below 99 %. For reference the same positions
are also read by transformers on the dequantised float32 weights (`hf` below).

    python benchmarks/llamacpp_agreement.py --limit 10 --tokens 256 [--gguf native|dequantize] [--json OUT]

Needs llama-cpp-python (`pip install llama-cpp-python`, the optional `llamacpp` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

from specdec.api import encode_prompt
from specdec.bench.tasks import load_tasks
from specdec.engine import SpecEngine
from specdec.config import SpecConfig
from specdec.models import load_model
from specdec.models.kernels import kernel_path
from specdec.models.loading import hf_folder, resolve_gguf


def llama_argmax(llm, tokens: list[int]) -> np.ndarray:
    """llama.cpp's argmax after every position of `tokens` (one teacher-forced pass)."""
    llm.reset()
    llm.eval(tokens)
    return np.asarray(llm.scores[: len(tokens)]).argmax(-1)


@torch.inference_mode()
def hf_argmax(hf, tokens: list[int]) -> np.ndarray:
    return hf(torch.tensor([tokens])).logits[0].argmax(-1).numpy()


@torch.inference_mode()
def specdec_argmax(model, tokens: list[int]) -> np.ndarray:
    ids = torch.tensor([tokens])
    out = model(ids, torch.arange(len(tokens))[None], model.new_cache(1, len(tokens)))
    return out.logits[0].argmax(-1).numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--task", default="gsm8k-eval")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--gguf", default="native", choices=("native", "dequantize"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    try:
        from llama_cpp import Llama
    except ImportError:
        print("needs llama-cpp-python (pip install llama-cpp-python)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    path = resolve_gguf(args.model)
    if path is None:
        print(f"{args.model} is not a GGUF file", file=sys.stderr)
        return 2
    model = load_model(args.model, device="cpu", gguf=args.gguf)
    llm = Llama(model_path=str(path), n_ctx=4096, n_threads=args.threads, logits_all=True, verbose=False)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_folder(model), dtype=torch.float32).eval()
    engine = SpecEngine(model, "none")
    per_prompt = []
    for task in load_tasks(args.task, args.limit):
        prompt = encode_prompt(model.tokenizer, task.prompt, chat=True)
        generated = engine.generate([prompt], SpecConfig(max_new_tokens=args.tokens)).rows[0].token_ids
        tokens = prompt + generated
        start = len(prompt) - 1  # the logits that predicted each generated token
        ours, theirs = specdec_argmax(model, tokens)[start:-1], llama_argmax(llm, tokens)[start:-1]
        reference = hf_argmax(hf, tokens)[start:-1]
        per_prompt.append({"positions": len(ours), "agree": int((ours == theirs).sum()),
                           "agree_hf": int((ours == reference).sum()), "hf_agree_llamacpp": int((reference == theirs).sum())})
    positions = sum(r["positions"] for r in per_prompt)
    total = sum(r["agree"] for r in per_prompt) / positions
    with_hf = sum(r["agree_hf"] for r in per_prompt) / positions
    hf_llama = sum(r["hf_agree_llamacpp"] for r in per_prompt) / positions
    result = {"model": str(path), "gguf": args.gguf, "weights": kernel_path(model).weights, "prompts": len(per_prompt),
              "positions": positions, "top1_agreement": total, "top1_agreement_with_hf": with_hf,
              "hf_top1_agreement_with_llamacpp": hf_llama,
              "median_per_prompt": statistics.median(r["agree"] / r["positions"] for r in per_prompt), "per_prompt": per_prompt}
    print(f"{args.gguf} ({result['weights']}) vs llama.cpp: top-1 agreement {total:.2%} over {result['positions']} positions "
          f"of {len(per_prompt)} prompts (median per prompt {result['median_per_prompt']:.2%}); with transformers "
          f"(dequantised, float32) {with_hf:.2%}; transformers with llama.cpp {hf_llama:.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

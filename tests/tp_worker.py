"""One rank of the tensor-parallel parity test (tests/test_tensor_parallel.py), launched by torchrun:

    torchrun --nproc-per-node N tests/tp_worker.py TARGET DRAFT OUT_PREFIX

Loads this rank's shard of TARGET (a tiny Llama folder, float32, CPU, exact kernels) and a replicated
DRAFT, decodes the prompts greedily and with a seeded sampler for every drafter, and writes
OUT_PREFIX.rank<r>.json. With no torchrun environment it runs unsharded (tp 1).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import specdec  # noqa: E402
from specdec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig  # noqa: E402
from specdec.drafters.medusa import DEFAULT_TREE, MedusaDrafter, MedusaTree  # noqa: E402
from specdec.models import load_model  # noqa: E402
from specdec.models.tensor_parallel import finish_ranks, join_group  # noqa: E402

PROMPTS = [[5, 17, 3, 9, 44, 2, 71], [12, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 30, 31]]
MAX_NEW = 24
DRAFTERS = ["none", "ngram", "draft_model", "eagle", "medusa", "lookahead", "layer_skip", "suffix", "quantized"]


def make(name: str, target, draft):
    from test_eagle import random_head
    from test_medusa import random_heads

    if name == "draft_model":
        return DraftModelDrafter(target, draft)
    if name == "eagle":
        return EagleDrafter(target, random_head(target, draft_vocab=64), EagleTreeConfig(depth=4, branch=3, frontier=3, total_tokens=12))
    if name == "medusa":
        return MedusaDrafter(target, random_heads(target), MedusaTree.of(DEFAULT_TREE, 4))
    return name


def decode_all(target, draft) -> dict:
    """{drafter: {"greedy": tokens per prompt, "sampled": tokens per prompt}}."""
    out = {}
    for name in DRAFTERS:
        engine = specdec.SpecEngine(target, make(name, target, draft))
        greedy = engine.generate(PROMPTS, specdec.SpecConfig(gamma=3, max_new_tokens=MAX_NEW))
        sampled = engine.generate(PROMPTS, specdec.SpecConfig(gamma=3, max_new_tokens=MAX_NEW,
                                                              sampling=specdec.SamplingParams(temperature=1.0, seed=7)))
        out[name] = {"greedy": [r.token_ids for r in greedy.rows], "sampled": [r.token_ids for r in sampled.rows]}
    return out


def main(target_folder: str, draft_folder: str, prefix: str) -> None:
    shard = join_group(int(os.environ.get("WORLD_SIZE", "1")), "cpu")
    torch.set_num_threads(1)
    target = load_model(target_folder, dtype="float32", device="cpu", kernels="exact", shard=shard)
    draft = load_model(draft_folder, dtype="float32", device="cpu", kernels="exact")
    result = decode_all(target, draft)
    with torch.inference_mode():  # one forward's logits, for the test's check that tp 1 and 2 round differently
        ids = torch.tensor([PROMPTS[0]])
        result["logits"] = target(ids, torch.arange(ids.shape[1])[None], target.new_cache(1, 16)).logits[0].tolist()
    with open(f"{prefix}.rank{shard.rank}.json", "w") as f:
        json.dump(result, f)
    finish_ranks(shard)  # as the CLI ends a rank (a single rank returns)


if __name__ == "__main__":
    main(*sys.argv[1:4])

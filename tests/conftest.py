"""Shared fixtures: tiny random models built from configs (no downloads), saved as HF folders and
loaded through specdec's own loader, so every test also exercises loading."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tiny models run many small ops: one thread avoids OpenMP overhead (up to 50x on a busy 2-core CPU).
torch.set_num_threads(1)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def hf_config(model_type: str = "llama", **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def build_hf(model_type: str = "llama", seed: int = 0, logit_scale: float = 1.0, **overrides):
    """A random HF model; logit_scale > 1 sharpens its next-token distributions (peakier, fewer ties)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_type, **overrides), dtype=torch.float32).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


def save_hf(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def tiny_pair(tmp_path: Path, model_type: str = "llama", seed: int = 0, logit_scale: float = 1.0, **overrides):
    """(native specdec model, the HF model it was loaded from), float32 on the CPU."""
    from specdec.models import load_model

    hf = build_hf(model_type, seed, logit_scale, **overrides)
    folder = save_hf(hf, tmp_path / f"{model_type}-{seed}")
    return load_model(str(folder), dtype="float32", device="cpu"), hf


@pytest.fixture
def tiny(tmp_path):
    """A tiny native Llama with sharp logits (greedy decoding is then free of near-ties)."""
    return tiny_pair(tmp_path, "llama", seed=0, logit_scale=8.0)[0]


@pytest.fixture
def tiny_draft(tmp_path):
    """A second tiny Llama with the same vocabulary: a (poor) draft model for `tiny`."""
    return tiny_pair(tmp_path, "llama", seed=1, logit_scale=8.0, num_hidden_layers=1)[0]


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model (SmolLM2-135M-Instruct, float32, CPU); slow to build once per cache."""
    from specdec.models import load_model

    return load_model("default", dtype="float32", device="cpu")

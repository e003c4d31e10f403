"""Shared fixtures: tiny random models built from configs (no downloads), saved as HF folders and
loaded through specdec's own loader, so every test also exercises loading.

Device: `SPECDEC_TEST_DEVICE` (default `cpu`; e.g. `cuda`, `cuda:1`) puts every model, cache,
verification tensor and generator of the suite on that device. Tests import `DEVICE` from here (or
take the `device` fixture) and build their tensors with `device=DEVICE`. On CUDA, TF32 is switched
off so that float32 means float32 (the exactness and 1e-4 parity tests rely on it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")

# Tiny models run many small ops: one thread avoids OpenMP overhead (up to 50x on a busy 2-core CPU).
torch.set_num_threads(1)


def device_problem(device: str) -> str | None:
    """Why the suite cannot run on `device`, or None when it can."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        return f"SPECDEC_TEST_DEVICE={device!r} is not a torch device"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"SPECDEC_TEST_DEVICE={device!r}: only cpu and cuda[:N] are supported"
    if not torch.cuda.is_available():
        return f"SPECDEC_TEST_DEVICE={device!r} but CUDA is not available (torch {torch.__version__}); refusing to test the CPU instead"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"SPECDEC_TEST_DEVICE={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
    return None


def pytest_configure(config):
    problem = device_problem(DEVICE)
    if problem is not None:
        pytest.exit(problem, returncode=4)
    if torch.device(DEVICE).type == "cuda":  # float32 must mean float32 (exactness and 1e-4 parity tests)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def device_line() -> str:
    dev = torch.device(DEVICE)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        return f"specdec test device: {DEVICE} ({name}, torch {torch.__version__}, CUDA {torch.version.cuda}, TF32 off)"
    return f"specdec test device: {DEVICE} (torch {torch.__version__}, {torch.get_num_threads()} thread(s))"


def pytest_report_header(config):
    return device_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.get_verbosity() < 0:  # -q hides the header: say it at the end instead
        terminalreporter.write_line(device_line())


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Undo thread-count changes a test makes (the CLI sets all cores): tiny models are much slower with
    several threads on a busy CPU, and later tests would inherit it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def device() -> str:
    """The device every test runs on (SPECDEC_TEST_DEVICE, default cpu)."""
    return DEVICE


def on_device(t: torch.Tensor) -> bool:
    """Whether tensor t lives on DEVICE ("cuda" matches any CUDA index, "cuda:1" only that one)."""
    want = torch.device(DEVICE)
    return t.device.type == want.type and (want.index is None or t.device.index == want.index)


def seeded_generator(seed: int) -> torch.Generator:
    """A seeded generator on DEVICE (CPU and CUDA streams differ: assert distributions or
    reproducibility, never a particular draw)."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


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


def two_branch_tree() -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """A draft tree of two branches numbered branch by branch (the second one's slots are not its
    positions, and its nodes see slots with other nodes between them): (branches, depths [9], mask [9, 9])."""
    branches = [[0, 1, 2, 3], [0, 4, 5, 6, 7, 8]]
    depths, mask = torch.zeros(9, dtype=torch.long), torch.zeros(9, 9, dtype=torch.bool)
    for branch in branches:
        for depth, node in enumerate(branch):
            depths[node] = depth
            mask[node, branch[: depth + 1]] = True
    return branches, depths, mask


def hf_config(model_type: str = "llama", **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def build_hf(model_type: str = "llama", seed: int = 0, logit_scale: float = 1.0, **overrides):
    """A random HF model on the CPU (built there so its weights do not depend on the test device);
    logit_scale > 1 sharpens its next-token distributions (peakier, fewer ties)."""
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
    """(native specdec model, the HF model it was loaded from), float32, both on DEVICE."""
    from specdec.models import load_model

    hf = build_hf(model_type, seed, logit_scale, **overrides)
    folder = save_hf(hf, tmp_path / f"{model_type}-{seed}")
    return load_model(str(folder), dtype="float32", device=DEVICE), hf.to(DEVICE)


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
    """The embedded default model (SmolLM2-135M-Instruct, float32, on DEVICE); slow to build once per cache."""
    import importlib.util

    from specdec.models import load_model
    from specdec.models.loading import DEFAULT_PACKAGE

    if importlib.util.find_spec(DEFAULT_PACKAGE) is None:  # `make test` installs it; a bare GPU copy may lack it
        pytest.skip(f"the default model's package {DEFAULT_PACKAGE} is not installed")
    return load_model("default", dtype="float32", device=DEVICE)


WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "The", "Cat", "ing", "ed", " the", " cat",
         "+", "-", "=", "*", "/", "\n", " ", ".", ",", "?", "(", ")"] + [str(d) for d in range(10)]


def tiny_folder_with_tokenizer(tmp_path: Path) -> Path:
    """A tiny Llama folder (vocabulary 96) with a word-level tokenizer, so `--model FOLDER` works
    like a real model in CLI, bench and analyze tests."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_pair(tmp_path, "llama", seed=0, logit_scale=8.0)
    vocab = WORDS + [f"w{i}" for i in range(TINY["vocab_size"] - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "llama-0"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    return folder

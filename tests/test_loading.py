"""Loading: HF folders into native models, dtypes, user errors, the transformers adapter (explicit
and automatic for architectures without a native implementation), and config parsing."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DEVICE, TINY, build_hf, save_hf
from specdec.errors import UserError
from specdec.models import LlamaModel, ModelConfig, load_model
from specdec.models.hf_adapter import HFAdapter

ATOL = 1e-4
AUTO_DTYPE = torch.bfloat16 if torch.device(DEVICE).type == "cuda" else torch.float32  # what dtype="auto" picks


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """(HF Llama on DEVICE, the folder it was saved to with save_pretrained)."""
    hf = build_hf("llama")
    folder = save_hf(hf, tmp_path_factory.mktemp("llama") / "model")
    return hf.to(DEVICE), folder


def tokens_of(length: int, seed: int = 0) -> torch.Tensor:  # [1, length] on DEVICE
    # Drawn on the CPU, then moved: the same tokens on every device.
    return torch.randint(0, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def positions_of(start: int, length: int) -> torch.Tensor:  # [1, length]
    return torch.arange(start, start + length, device=DEVICE)[None]


def full_logits(model, tokens: torch.Tensor) -> torch.Tensor:  # tokens [1, T] -> [1, T, V]
    return model(tokens, positions_of(0, tokens.shape[1]), model.new_cache(1, tokens.shape[1])).logits


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:  # tokens [1, T] -> [1, T, V]
    with torch.no_grad():
        return hf(input_ids=tokens).logits.float()


# --- HF folders and dtypes ---------------------------------------------------------------------

def test_load_hf_folder_native(llama_folder):
    hf, folder = llama_folder
    model = load_model(str(folder), dtype="float32", device=DEVICE)
    assert isinstance(model, LlamaModel)
    assert model.name == str(folder)
    assert (model.config.num_layers, model.config.num_kv_heads, model.config.head_dim) == (2, 2, 16)
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight)
    q_rows = hf.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight[: q_rows.shape[0]], q_rows)


@pytest.mark.parametrize(
    "dtype, expected",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("auto", AUTO_DTYPE), (torch.bfloat16, torch.bfloat16)],
)
def test_dtype(llama_folder, dtype, expected):
    hf, folder = llama_folder
    model = load_model(str(folder), dtype=dtype, device=DEVICE)
    assert {p.dtype for p in model.parameters()} == {expected}
    tokens = tokens_of(8)
    logits = full_logits(model, tokens)  # [1, T, V]
    assert logits.dtype == torch.float32
    tolerance = ATOL if expected == torch.float32 else 0.02  # bf16 measured ~4e-3 on logits of magnitude ~0.6
    assert (logits - hf_logits(hf, tokens)).abs().max() < tolerance


# --- user errors -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="float8"), "unknown dtype 'float8'"),
        (dict(device="nonsense"), "unknown device 'nonsense'"),
        (dict(backend="jax"), "unknown backend 'jax'"),
    ],
)
def test_bad_arguments_raise_user_error(llama_folder, kwargs, message):
    _, folder = llama_folder
    with pytest.raises(UserError, match=message):
        load_model(str(folder), **{"dtype": "float32", "device": DEVICE, **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_raises_user_error(llama_folder):
    with pytest.raises(UserError, match="no CUDA device"):
        load_model(str(llama_folder[1]), device="cuda")


def test_missing_model_path_raises_user_error(tmp_path):
    with pytest.raises(UserError, match="model not found"):
        load_model(str(tmp_path / "no-such-model"), device=DEVICE)


def test_folder_without_config_or_gguf_raises_user_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UserError, match="has no config.json"):
        load_model(str(tmp_path), device=DEVICE)


def test_non_model_file_raises_user_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a model")
    with pytest.raises(UserError, match="neither a model folder nor a .gguf file"):
        load_model(str(path), device=DEVICE)


def test_folder_without_weights_raises_user_error(llama_folder, tmp_path):
    (tmp_path / "config.json").write_text((llama_folder[1] / "config.json").read_text())
    with pytest.raises(UserError, match="no .safetensors"):
        load_model(str(tmp_path), dtype="float32", device=DEVICE)


# --- the transformers adapter ------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter(llama_folder):
    return load_model(str(llama_folder[1]), dtype="float32", device=DEVICE, backend="hf")


def test_adapter_matches_native(llama_folder, adapter):
    native = load_model(str(llama_folder[1]), dtype="float32", device=DEVICE)
    assert isinstance(adapter, HFAdapter)
    tokens = tokens_of(16)
    diff = (full_logits(adapter, tokens) - full_logits(native, tokens)).abs().max()
    assert diff < ATOL


def test_adapter_incremental_with_trim(adapter):
    """Prefix, 3 rejected tokens trimmed away, then 1 and 4 tokens: same logits as one full forward."""
    tokens = tokens_of(16, seed=1)  # [1, 16]
    cache = adapter.new_cache(1, 32)
    prefix = adapter(tokens[:, :11], positions_of(0, 11), cache).logits  # [1, 11, V]
    adapter(tokens_of(3, seed=2), positions_of(11, 3), cache)
    cache.trim(torch.tensor([11], device=DEVICE))
    assert cache.lengths.tolist() == [11] and cache.past.get_seq_length() == 11
    step = adapter(tokens[:, 11:12], positions_of(11, 1), cache).logits  # [1, 1, V]
    block = adapter(tokens[:, 12:], positions_of(12, 4), cache).logits  # [1, 4, V]
    incremental = torch.cat([prefix, step, block], dim=1)  # [1, 16, V]
    assert (incremental - full_logits(adapter, tokens)).abs().max() < ATOL


def test_adapter_rejects_batches_and_trees(adapter):
    with pytest.raises(UserError, match="batch size 1"):
        adapter.new_cache(batch_size=2, max_len=16)
    mask = torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE).tril()  # [1, T, T]
    with pytest.raises(UserError, match="tree attention masks need a native model"):
        adapter(tokens_of(2), positions_of(0, 2), adapter.new_cache(1, 8), mask=mask)


@pytest.mark.parametrize("model_type", ["gpt2", "gemma"])
def test_non_native_architecture_loads_through_adapter(model_type, tmp_path):
    hf = build_hf(model_type)
    model = load_model(str(save_hf(hf, tmp_path / model_type)), dtype="float32", device=DEVICE, backend="auto")
    hf = hf.to(DEVICE)
    assert isinstance(model, HFAdapter) and model.config.model_type == model_type
    tokens = tokens_of(12)
    assert (full_logits(model, tokens) - hf_logits(hf, tokens)).abs().max() < ATOL


def test_native_backend_refuses_non_native_architecture(tmp_path):
    folder = save_hf(build_hf("gpt2"), tmp_path / "gpt2")
    with pytest.raises(UserError, match="no native implementation"):
        load_model(str(folder), dtype="float32", device=DEVICE, backend="native")


# --- config parsing ----------------------------------------------------------------------------

BASE_CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("scaling", list(SCALINGS.values()), ids=list(SCALINGS))
def test_old_and_new_rope_config_styles_agree(scaling):
    old = {**BASE_CONFIG, "rope_theta": 500000.0, "rope_scaling": scaling}
    new = {**BASE_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}}
    parsed = ModelConfig.from_hf(old)
    assert parsed == ModelConfig.from_hf(new)
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == scaling


def test_old_style_config_json_loads_like_new_style(tmp_path):
    """A config.json from older transformers (rope_theta + rope_scaling) builds the same model."""
    hf = build_hf("llama", rope_parameters={"rope_theta": 500000.0, **SCALINGS["llama3"]})
    folder = save_hf(hf, tmp_path / "new")
    new_model = load_model(str(folder), dtype="float32", device=DEVICE)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    old_model = load_model(str(folder), dtype="float32", device=DEVICE)
    assert old_model.config == new_model.config
    assert torch.equal(old_model.inv_freq, new_model.inv_freq)


@pytest.mark.parametrize(
    "extra, window",
    [
        (dict(sliding_window=8), 8),
        (dict(sliding_window=8, use_sliding_window=False), None),
        (dict(sliding_window=8, layer_types=["full_attention"] * 2), None),
        (dict(sliding_window=8, layer_types=["sliding_attention"] * 2), 8),
    ],
    ids=["mistral-style", "disabled", "no-sliding-layer", "all-sliding-layers"],
)
def test_sliding_window_parsing(extra, window):
    assert ModelConfig.from_hf({**BASE_CONFIG, **extra}).sliding_window == window


def test_mixed_sliding_layers_raise_user_error():
    config = {**BASE_CONFIG, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(UserError, match="backend='hf'"):
        ModelConfig.from_hf(config)


def test_a_cache_folder_written_twice_at_once_keeps_the_first(tmp_path):
    """Two processes loading one GGUF together (two servers, the ranks of --tp) each write the cache folder
    in a folder of their own and publish it: the second finds the first's in place and drops its copy,
    instead of failing with "Directory not empty" (seen on an H200 with two `specdec serve` started at once)."""
    from specdec.models.loading import publish_folder

    folder = tmp_path / "model-123"
    first, second = tmp_path / "model-123.a.tmp", tmp_path / "model-123.b.tmp"
    for tmp, text in ((first, "first"), (second, "second")):
        tmp.mkdir()
        (tmp / "config.json").write_text(text)
    publish_folder(first, folder)
    publish_folder(second, folder)
    assert (folder / "config.json").read_text() == "first"
    assert not first.exists() and not second.exists()
    stray = tmp_path / "model-9.tmp"  # a destination in the way that is no finished folder: still an error
    stray.mkdir()
    (stray / "x").write_text("x")
    blocked = tmp_path / "model-9"
    blocked.mkdir()
    (blocked / "partial").write_text("x")
    with pytest.raises(OSError):
        publish_folder(stray, blocked)


def test_copies_of_one_gguf_share_a_cache_key_and_a_rewrite_gets_a_new_one(tmp_path, monkeypatch):
    """The dequantised folder is named by the file's content: a fresh clone's copy of the embedded model (a
    new path and mtime) reuses it, where a key of size and mtime added a ~480 MB copy per clone. The digest
    is hashed once per path, size and mtime, then read from digests.json; other bytes of the same size, a
    new key."""
    import os

    import specdec.models.loading as loading

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    one, two = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path, mtime in ((one, 1_000_000), (two, 2_000_000)):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(range(256)) * 5000)
        os.utime(path, (mtime, mtime))
    assert loading.content_digest(one) == loading.content_digest(two)
    hashed = []
    real = loading.hashlib.sha256
    monkeypatch.setattr(loading.hashlib, "sha256", lambda: hashed.append(1) or real())
    assert loading.content_digest(one) == loading.content_digest(two) and not hashed  # remembered
    before = loading.content_digest(two)
    two.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 5000)  # same size, other bytes
    os.utime(two, (3_000_000, 3_000_000))
    assert loading.content_digest(two) != before and hashed == [1]
    assert len(json.loads((tmp_path / "cache" / "digests.json").read_text())) == 3
    one.unlink()
    two.write_bytes(b"GGUF")
    loading.content_digest(two)
    assert len(json.loads((tmp_path / "cache" / "digests.json").read_text())) == 3  # `one` forgotten, `two` thrice

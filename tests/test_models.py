"""Native models reproduce transformers' logits (float32): every supported architecture and RoPE
variant on tiny random configs, through the KV cache (incremental, rollback, ragged batches), with
explicit and tree attention masks; and the embedded default model against its own HF folder."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, TINY, build_hf, save_hf
from specdec.models import load_model
from specdec.models.rope import build_rope

ATOL = 1e-4
SEQ_LEN = 24  # longer than the sliding windows below, so the windows matter
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # < max_position_embeddings (512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}

CASES = {
    "llama": dict(model_type="llama"),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3-rope": dict(model_type="llama", rope_parameters=LLAMA3),
    "yarn-rope": dict(model_type="llama", rope_parameters=YARN),
    "linear-rope": dict(model_type="llama", rope_parameters=LINEAR),
    "mistral-window": dict(model_type="mistral", sliding_window=8),
    "qwen2": dict(model_type="qwen2"),
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0),
    "qwen3": dict(model_type="qwen3", head_dim=32),  # head_dim != hidden_size / heads
    "llama-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
}


def perturb_biases_and_norms(hf) -> None:
    """HF initialises biases to 0 and norm weights to 1; make them random so that dropping one fails."""
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))


def perturbed_pair(folder, model_type: str = "llama", **overrides):
    """(native model, HF model) of a random tiny config, float32, loaded through specdec's loader; both on DEVICE."""
    hf = build_hf(model_type, **overrides)
    perturb_biases_and_norms(hf)  # on the CPU, so the weights are the same whatever the test device
    return load_model(str(save_hf(hf, folder / "model")), dtype="float32", device=DEVICE), hf.to(DEVICE)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(native model, HF model) for one architecture case."""
    return perturbed_pair(tmp_path_factory.mktemp(request.param), **CASES[request.param])


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    return perturbed_pair(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def window_pair(tmp_path_factory):
    return perturbed_pair(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=4)


def random_tokens(length: int, seed: int) -> torch.Tensor:  # [1, length] on DEVICE
    # Drawn on the CPU, then moved: the same tokens on every device, so CPU and GPU runs test the same inputs.
    return torch.randint(0, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:  # tokens [B, T] -> [B, T, V]
    with torch.no_grad():
        return hf(input_ids=tokens).logits.float()


def chain_positions(start: int, length: int) -> torch.Tensor:  # [1, length]
    return torch.arange(start, start + length, device=DEVICE)[None]


def native_chunked(model, tokens: torch.Tensor, chunks: list[int], rollback: int = 0) -> torch.Tensor:
    """Feed tokens [1, T] through one cache in `chunks`; return logits [1, T, V].

    With rollback > 0, every chunk after the first is preceded by `rollback` junk tokens at the
    same positions that are trimmed away again, as a rejected speculation would be.
    """
    assert sum(chunks) == tokens.shape[1]
    cache = model.new_cache(1, tokens.shape[1] + rollback)
    outs, start = [], 0
    for i, n in enumerate(chunks):
        if rollback and i > 0:
            junk = random_tokens(rollback, seed=start)  # [1, rollback]
            model(junk, chain_positions(start, rollback), cache)
            cache.trim(torch.tensor([start], device=DEVICE))
        outs.append(model(tokens[:, start : start + n], chain_positions(start, n), cache).logits)
        start += n
    return torch.cat(outs, dim=1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff < atol, f"max abs logit diff {diff:.2e} >= {atol:.0e}"


def unscaled_inv_freq(model) -> torch.Tensor:  # [Dh/2]
    c = model.config
    return build_rope(c.head_dim, c.rope_theta, None, c.max_position_embeddings).inv_freq


# --- architectures x RoPE variants -------------------------------------------------------------

def test_rope_scaling_changes_frequencies(pair):
    model, hf = pair
    scaled = model.config.rope_scaling is not None
    assert scaled == (hf.config.rope_parameters["rope_type"] != "default")
    inv_freq = model.inv_freq.cpu()  # [Dh/2]
    assert torch.allclose(inv_freq, unscaled_inv_freq(model)) != scaled
    assert torch.allclose(inv_freq, hf.model.rotary_emb.inv_freq.float().cpu(), rtol=1e-6)
    assert model.rope_attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)


def test_full_forward_matches_transformers(pair):
    model, hf = pair
    tokens = random_tokens(SEQ_LEN, seed=1)  # [1, T]
    assert_close(native_chunked(model, tokens, [SEQ_LEN]), hf_logits(hf, tokens))


@pytest.mark.parametrize("rollback", [0, 3], ids=["plain", "rollback"])
def test_incremental_forward_matches_transformers(pair, rollback):
    model, hf = pair
    tokens = random_tokens(SEQ_LEN, seed=2)  # [1, T]
    chunks = [9, 1, 1, 4, 1, 3, 1, 4]  # prefix, then single tokens and verify-sized blocks
    assert_close(native_chunked(model, tokens, chunks, rollback), hf_logits(hf, tokens))


def test_ragged_batch_matches_transformers_per_row(pair):
    """Two rows, prompts of 20 and 13 tokens (right-padded), then 1 + 3 tokens each after a trim."""
    model, hf = pair
    prompt_lens, new = [20, 13], 4
    rows = [random_tokens(n + new, seed=10 + i)[0] for i, n in enumerate(prompt_lens)]  # each [n + new]
    width = max(prompt_lens)
    prompts = torch.zeros(2, width, dtype=torch.long, device=DEVICE)  # [2, width], pad id 0
    for i, n in enumerate(prompt_lens):
        prompts[i, :n] = rows[i][:n]
    lengths = torch.tensor(prompt_lens, device=DEVICE)  # [2]
    cache = model.new_cache(2, width + new)
    prefill = model(prompts, chain_positions(0, width).expand(2, -1), cache).logits  # [2, width, V]
    cache.trim(lengths)
    continuation = torch.stack([row[n:] for row, n in zip(rows, prompt_lens)])  # [2, new]
    step1 = model(continuation[:, :1], lengths[:, None], cache).logits  # [2, 1, V]
    step2 = model(continuation[:, 1:], lengths[:, None] + torch.arange(1, new, device=DEVICE), cache).logits  # [2, 3, V]
    assert cache.lengths.tolist() == [n + new for n in prompt_lens]
    for i, n in enumerate(prompt_lens):
        native = torch.cat([prefill[i, :n], step1[i], step2[i]])  # [n + new, V]
        assert_close(native, hf_logits(hf, rows[i][None])[0])


# --- explicit and tree masks -------------------------------------------------------------------

def causal_mask(batch: int, length: int) -> torch.Tensor:  # [B, T, T] bool
    return torch.ones(length, length, dtype=torch.bool, device=DEVICE).tril().expand(batch, -1, -1)


def test_explicit_causal_mask_equals_default(llama_pair):
    """On a ragged committed prefix: mask=causal and mask=None give identical logits."""
    model, _ = llama_pair
    tokens = torch.cat([random_tokens(12, seed=20), random_tokens(12, seed=21)])  # [2, 12]
    lengths, block = torch.tensor([7, 4], device=DEVICE), 5

    def run(mask):
        cache = model.new_cache(2, 16)
        model(tokens[:, :7], chain_positions(0, 7).expand(2, -1), cache)
        cache.trim(lengths)
        offsets = torch.arange(block, device=DEVICE)  # [block]
        new = tokens.gather(1, lengths[:, None] + offsets)  # [2, block]
        return model(new, lengths[:, None] + offsets, cache, mask=mask).logits  # [2, block, V]

    explicit, default = run(causal_mask(2, block)), run(None)
    assert torch.equal(explicit, default)
    assert not torch.allclose(run(torch.eye(block, dtype=torch.bool, device=DEVICE).expand(2, -1, -1)), default, atol=ATOL)


# A root shared by two branches; nodes are numbered branch by branch, so the second branch's slots
# run ahead of its positions (depths). It is longer than the window of `window_pair`.
BRANCHES = [[0, 1, 2, 3], [0, 4, 5, 6, 7, 8]]  # node indices of each root-to-leaf chain
NUM_NODES = 9


def tree_layout() -> tuple[torch.Tensor, torch.Tensor]:
    """depths [1, N] and mask [1, N, N] on DEVICE: each node sees itself and its ancestors."""
    depths = torch.zeros(NUM_NODES, dtype=torch.long)
    mask = torch.zeros(NUM_NODES, NUM_NODES, dtype=torch.bool)
    for branch in BRANCHES:
        for depth, node in enumerate(branch):
            depths[node] = depth
            mask[node, branch[: depth + 1]] = True
    return depths[None].to(DEVICE), mask[None].to(DEVICE)


def forward_after_prefix(model, prefix: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    """Logits [1, T, V] of tokens [1, T] at positions [1, T] under mask [1, T, T], after the chain prefix [1, P]."""
    cache = model.new_cache(1, prefix.shape[1] + tokens.shape[1])
    model(prefix, chain_positions(0, prefix.shape[1]), cache)
    return model(tokens, positions, cache, mask=mask).logits


@pytest.mark.parametrize("which", ["llama_pair", "window_pair"])
def test_tree_branches_match_chains(which, request):
    """Each tree node's logits equal those of its branch run alone as a chain (window: positions matter)."""
    model, hf = request.getfixturevalue(which)
    prefix, nodes = random_tokens(10, seed=30), random_tokens(NUM_NODES, seed=31)  # [1, P], [1, N]
    P = prefix.shape[1]
    depths, mask = tree_layout()
    tree = forward_after_prefix(model, prefix, nodes, P + depths, mask)  # [1, N, V]
    for branch in BRANCHES:
        chain = torch.cat([prefix, nodes[:, branch]], dim=1)  # [1, P + len(branch)]
        assert_close(tree[:, branch], hf_logits(hf, chain)[:, P:])


# --- the embedded default model ----------------------------------------------------------------

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Let's think step by step.")


@pytest.mark.slow
def test_default_model_matches_transformers(default_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model.name, dtype=torch.float32).eval().to(DEVICE)
    tokens = default_model.tokenizer(PROMPT, return_tensors="pt").input_ids.to(DEVICE)  # [1, T]
    assert 30 <= tokens.shape[1] <= 50
    native = native_chunked(default_model, tokens, [tokens.shape[1]])[0]  # [T, V]
    expected = hf_logits(hf, tokens)[0]  # [T, V]
    assert_close(native, expected, atol=1e-3)
    assert torch.equal(native.argmax(-1), expected.argmax(-1))

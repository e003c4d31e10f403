"""The EAGLE-3 head and drafter (`eagle3`): the target's inner-layer features, lossless drafting, training
with training-time test, and the speculators / vLLM / SGLang layout.

Greedy output equals plain greedy decoding on a tiny target with unsharpened (nearly tied) logits in
float32 on the exact kernels, at gamma 2 and 4, alone and batched; sampled output follows plain
sampling's distribution; asking a forward for inner layers changes none of its bits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import specdec
from conftest import DEVICE, build_hf, save_hf, tiny_pair
from specdec.batch import eos_ids
from specdec.drafters import DrafterOptions
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig, tree_config
from specdec.errors import UserError
from specdec.models import load_model
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, default_feature_layers, load_eagle3_head, save_eagle3_head
from specdec.models.kernels import kernel_path
from specdec.step import new_stepper
from test_eagle import check_sampling_matches_plain
from test_lazy_drafters import MAX_LEN, SCHEDULE, chunked_stepper, run_schedule

PROMPTS = [[5, 17, 3, 9, 44, 2, 71], [12, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 30, 31]]
MAX_NEW = 32
LAYERS = 6  # the tiny target's depth: default_feature_layers(6) = (2, 3, 3)
TREE = EagleTreeConfig(depth=4, branch=3, frontier=3, total_tokens=12)


def random_head3(target, draft_vocab: int | None = None, seed: int = 0, feature_layers: tuple[int, ...] | None = None) -> Eagle3Head:
    torch.manual_seed(seed)
    c = target.config
    head = Eagle3Head(Eagle3Config.for_target(c, draft_vocab or c.vocab_size, feature_layers=feature_layers))
    if draft_vocab:
        head.d2t = torch.randperm(c.vocab_size)[:draft_vocab].sort().values
    return head


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """(target, its HF model, plain greedy outputs): an unsharpened tiny float32 Llama on the exact kernels."""
    tmp = tmp_path_factory.mktemp("eagle3")
    hf = build_hf("llama", seed=0, num_hidden_layers=LAYERS)
    target = load_model(str(save_hf(hf, tmp / "t")), dtype="float32", device=DEVICE, kernels="exact")
    assert kernel_path(target).exact
    plain = specdec.SpecEngine(target, "none").generate(PROMPTS, specdec.SpecConfig(max_new_tokens=MAX_NEW))
    return target, hf.to(DEVICE), [r.token_ids for r in plain.rows]


def test_default_feature_layers_follow_the_reference():
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(LAYERS) == (2, 3, 3)
    assert default_feature_layers(2) == (1, 1, 0)


@pytest.mark.parametrize("kernels", ["exact", "library"])
def test_aux_layers_are_the_layers_inputs_and_change_no_bits(flat, tmp_path, kernels):
    """ModelOutput.aux is HF's hidden_states[i] (the input of layer i) side by side, and a forward asked for
    them gives the same logits and hidden states, bit for bit, on the C path (exact) and the PyTorch one."""
    _, hf, _ = flat
    target = load_model(str(save_hf(hf.cpu(), tmp_path / "t")), dtype="float32", device=DEVICE, kernels=kernels)
    hf.to(DEVICE)
    tokens = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]], device=DEVICE)  # [2, 7]
    positions = torch.arange(7, device=DEVICE).expand(2, 7)
    layers = (0, 2, 5)
    plain = target(tokens, positions, target.new_cache(2, 16))
    tapped = target(tokens, positions, target.new_cache(2, 16), aux_layers=layers)
    assert torch.equal(plain.logits, tapped.logits) and torch.equal(plain.hidden, tapped.hidden)
    with torch.no_grad():
        states = hf(input_ids=tokens, output_hidden_states=True).hidden_states
    expected = torch.cat([states[i] for i in layers], dim=-1)  # [2, 7, 3D]
    assert tapped.aux.shape == (2, 7, 3 * target.config.hidden_size)
    torch.testing.assert_close(tapped.aux, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gamma", [2, 4])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("lookup", [0, 3], ids=["tree", "tree+lookup"])
def test_eagle3_greedy_equals_plain_with_near_ties(flat, gamma, batch, lookup):
    target, _, plain = flat
    prompts, expected = (PROMPTS, plain) if batch == 3 else (PROMPTS[2:], plain[2:])
    drafter = EagleDrafter(target, random_head3(target, draft_vocab=64), replace(TREE, lookup=lookup))
    assert drafter.name == "eagle3" and drafter.feature_layers == (2, 3, 3)
    out = specdec.SpecEngine(target, drafter).generate(prompts, specdec.SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == expected
    assert out.stats.draft_nodes > 0


@pytest.mark.skipif(DEVICE != "cpu", reason="catching up in gaps runs on the CPU only (catch_up.catches_up)")
def test_eagle3_drafts_alike_caught_up_in_gaps_and_in_chunks(flat):
    """Both catch-ups feed project(aux) at the same positions: the same drafts."""
    target, _, _ = flat
    drafter = EagleDrafter(target, random_head3(target, draft_vocab=64), EagleTreeConfig(depth=3, branch=2, frontier=2, total_tokens=6))
    lazy = new_stepper(target, drafter, 2, MAX_LEN, list(eos_ids(target)), graphs=False)
    assert lazy.batch.draft.features.shape[-1] == 3 * target.config.hidden_size
    lazy_drafts = run_schedule(lazy)
    assert lazy_drafts == run_schedule(chunked_stepper(target, drafter))
    assert len(lazy_drafts) == sum(g > 0 for g, _ in SCHEDULE)


def test_eagle3_sampling_matches_plain_sampling(tmp_path):
    check_sampling_matches_plain(tmp_path, random_head3)


def test_eagle3_registered_and_saved_head_round_trips(flat, tmp_path):
    target, _, _ = flat
    head = random_head3(target, draft_vocab=32, seed=3)
    save_eagle3_head(head, tmp_path / "head")
    loaded = load_eagle3_head(tmp_path / "head")
    assert loaded.config == head.config
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    options = DrafterOptions(extra={"eagle3_path": str(tmp_path / "head")})
    config = specdec.SpecConfig(gamma=4, max_new_tokens=12)
    out_a = specdec.SpecEngine(target, "eagle3", options).generate(PROMPTS, config)
    out_b = specdec.SpecEngine(target, EagleDrafter(target, head, tree_config(target, DrafterOptions()))).generate(PROMPTS, config)
    assert out_a.stats.accepted_per_position == out_b.stats.accepted_per_position


def test_a_head_of_another_target_is_one_clear_error(flat, tmp_path):
    target, _, _ = flat
    other = tiny_pair(tmp_path, "llama", seed=2, num_hidden_layers=4)[0]  # same vocabulary and width, 4 layers
    with pytest.raises(UserError, match="eagle3 head was trained for another target.*6 layers"):
        EagleDrafter(other, random_head3(target), TREE)
    with pytest.raises(UserError, match="feature layers"):
        random_head3(target, feature_layers=(1, 6))
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text('{"specdec_drafter": "eagle"}')
    (tmp_path / "eagle" / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="not an EAGLE-3 head"):
        load_eagle3_head(tmp_path / "eagle")
    with pytest.raises(UserError, match="--eagle3-head"):
        specdec.SpecEngine(target, "eagle3")


# ---- training with training-time test -------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny sharp target and Features of its own greedy continuations of random prompts (like --data self)."""
    from specdec.train.data import Example, Features, teacher_force

    target = tiny_pair(tmp_path_factory.mktemp("eagle3-train"), "llama", seed=0, logit_scale=8.0, num_hidden_layers=4)[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (6,), generator=g).tolist() for _ in range(40)]
    rows = specdec.SpecEngine(target, "none").generate(prompts, specdec.SpecConfig(max_new_tokens=20)).rows
    examples = [Example(p, r.token_ids) for p, r in zip(prompts, rows)]
    features = Features([torch.tensor(e.prompt + e.response) for e in examples], teacher_force(target, examples, progress=False),
                        [len(e.prompt) for e in examples], "self")
    return target, features


SMALL = dict(batch_tokens=256, lr=3e-3, draft_vocab=64, held_out=0.15, warmup=4, ttt_steps=3)


def test_ttt_mask_sees_step_zero_causally_and_each_later_step_on_the_diagonal():
    from specdec.train.eagle3 import ttt_mask

    assert ttt_mask(3, 0).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert ttt_mask(3, 2).int().tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                                             [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_ttt_unroll_is_what_chain_drafting_computes(corpus):
    """Training's unroll (differentiable, no cache) gives the head's outputs of the drafting path (a KV cache,
    tree masks), and those are a chain drafted from one anchor, fed as the drafter feeds it."""
    from specdec.train.eagle3 import unroll, unroll_drafting

    target, _ = corpus
    head = random_head3(target, draft_vocab=64).attach(target, kernels=False).float()
    tokens = torch.tensor([[5, 17, 3, 9, 44, 2, 71, 8]], device=DEVICE)  # [1, 8]
    out = target(tokens, torch.arange(8, device=DEVICE)[None], target.new_cache(1, 8), aux_layers=head.feature_layers)
    with torch.no_grad():
        g = head.project(out.aux)  # [1, 8, D]
        trained, drafted = unroll(head, g, tokens, 3), unroll_drafting(head, g, tokens, 3)
        for a, b in zip(trained, drafted):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        t = 4  # a chain from anchor t: committed pairs 0..t, then (h^{k-1}_t, x_{t+k+1}) at position t+k
        cache = head.new_cache(1, 16)
        h = head.features(g[:, : t + 1], tokens[:, 1 : t + 2], torch.arange(t + 1, device=DEVICE)[None], cache)[:, -1:]
        for k in (1, 2):
            h = head.features(h, tokens[:, t + k + 1 : t + k + 2], torch.tensor([[t + k]], device=DEVICE), cache)
            torch.testing.assert_close(h[0, 0], trained[k][0, t], rtol=1e-5, atol=1e-5)


def test_training_learns_and_resumes_to_the_same_weights(corpus, tmp_path, monkeypatch):
    from specdec.train import eagle3 as train3
    from specdec.train.common import load_checkpoint

    target, features = corpus
    config = train3.Eagle3TrainConfig(steps=12, checkpoint_every=4, evaluations=1, **SMALL)
    whole = train3.train_eagle3(target, features, config, tmp_path / "whole", progress=False)
    again = train3.train_eagle3(target, features, config, tmp_path / "again", progress=False)
    assert whole.history[-1]["train_loss"] < whole.history[0]["train_loss"]
    assert len(whole.held_out.tau) == 3 and whole.held_out.tau[0] <= whole.held_out.tau[-1] <= 4
    real_step, calls = train3.train_step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 10:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train3, "train_step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        train3.train_eagle3(target, features, config, tmp_path / "cut", progress=False)
    monkeypatch.setattr(train3, "train_step", real_step)
    assert load_checkpoint(tmp_path / "cut", config.resume_key(features)).step == 8
    resumed = train3.train_eagle3(target, features, config, tmp_path / "cut", resume=True, progress=False)
    for (name, a), b, c in zip(whole.head.state_dict().items(), resumed.head.state_dict().values(), again.head.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), name
    assert resumed.history == whole.history
    other = train3.Eagle3TrainConfig(steps=12, checkpoint_every=4, evaluations=1, **{**SMALL, "ttt_steps": 2})
    with pytest.raises(UserError, match="ttt_steps"):
        train3.train_eagle3(target, features, other, tmp_path / "cut", resume=True, progress=False)

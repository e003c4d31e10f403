"""The distilled draft model: training on a tiny target lowers the KL and raises agreement; the saved
folder (layers only: embeddings and LM head borrowed from the target, with or without a reduced
read-out vocabulary d2t) loads through the draft_model drafter, which stays lossless (greedy, batch 1
and 3; sampling distribution); resume gives the uninterrupted result."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import specdec
from conftest import DEVICE, tiny_pair
from specdec import SamplingParams
from specdec.cli import main
from specdec.drafters.draft_model import SharedDraftModel, is_shared_draft, load_shared_draft
from specdec.train import draft as train_draft
from specdec.train.draft import init_draft, init_layer_ids, save_draft
from test_engine import MAX_NEW, PROMPTS, models, plain  # noqa: F401  (fixtures)
from test_sampling_e2e import ALPHA, PROMPT, ROWS, VOCAB, distribution_pvalues, tokens_of
from test_train_eagle import setup  # noqa: F401  (fixture: a tiny target and features of its own continuations)


def train_args(target, features_file, out, steps: int, *extra: str) -> list[str]:
    return ["train", "draft", "--model", target.name, "--features", str(features_file), "--dtype", "float32",
            "--device", DEVICE, "--threads", "1", "--steps", str(steps), "--batch-tokens", "256", "--layers", "1",
            "--draft-vocab", "64", "--lr", "3e-3", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):  # noqa: F811
    """(target, features file, out folder) after 60 steps of a one-layer draft of the tiny two-layer target."""
    target, features, _ = setup
    tmp = tmp_path_factory.mktemp("draft-train")
    features.save(tmp / "features.safetensors")
    assert main(train_args(target, tmp / "features.safetensors", tmp / "out", 60)) == 0
    return target, tmp / "features.safetensors", tmp / "out"


def test_distillation_lowers_kl_and_raises_agreement(trained):
    _, _, out = trained
    report = json.loads((out / "report.json").read_text())
    before, after = report["held_out_before"], report["held_out_after"]
    assert after["positions"] > 50
    assert after["kl"] < 0.5 * before["kl"], (before, after)
    assert after["top1"] > before["top1"] + 0.1 and after["expected_acceptance_t1"] > before["expected_acceptance_t1"]
    assert report["train_kl"]["last_steps"] < report["train_kl"]["first_steps"]
    assert report["init_layers"] == [0]  # one layer: the target's first


def test_saved_draft_holds_only_its_own_layers(trained):
    target, _, out = trained
    config = json.loads((out / "config.json").read_text())
    assert config["specdec_shared_embeddings"] is True and config["num_hidden_layers"] == 1
    assert config["specdec_draft_vocab_size"] == 64 and config["architectures"] == ["LlamaForCausalLM"]
    weights = load_file(str(out / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in weights)
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16
    assert weights["d2t"].shape == (64,) and is_shared_draft(str(out))
    draft = load_shared_draft(out, target)
    assert draft.embed_tokens is target.embed_tokens
    assert all(p.device.type != "meta" for p in draft.parameters())


def test_trained_draft_accepts_more_and_stays_lossless(trained):
    target, _, out = trained
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.config.vocab_size, (6,), generator=g).tolist() for _ in range(3)]  # unseen
    config = specdec.SpecConfig(gamma=4, max_new_tokens=24)
    plain_ids = [r.token_ids for r in specdec.SpecEngine(target, "none").generate(prompts, config).rows]
    d2t = load_shared_draft(out, target).d2t.cpu()
    start = init_draft(target, 1, None, d2t)
    accepted = {}
    for name, draft in (("start", start), ("trained", str(out))):
        result = specdec.generate(prompts, model=target, drafter="draft_model", draft_model=draft, gamma=4, max_new_tokens=24)
        assert [r.token_ids for r in result.rows] == plain_ids, name
        accepted[name] = result.stats.accepted
    assert accepted["trained"] > 1.5 * accepted["start"] + 5, accepted


def test_a_full_depth_draft_is_the_target(models, tmp_path):  # noqa: F811
    """Started from every target layer with the full vocabulary, the draft is the target: all accepted."""
    target, _, _ = models
    save_draft(init_draft(target, target.config.num_layers, None, None), tmp_path / "full")
    draft = load_shared_draft(tmp_path / "full", target)
    assert draft.lm_head is target.lm_head and "d2t" not in load_file(str(tmp_path / "full" / "model.safetensors"))
    out = specdec.generate(PROMPTS, model=target, drafter="draft_model", gamma=4, max_new_tokens=MAX_NEW, draft_model=str(tmp_path / "full"))
    assert out.stats.acceptance_rate > 0.95  # float16 weights: near-ties may flip


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "d2t"])
@pytest.mark.parametrize("batch", [1, 3])
def test_shared_draft_greedy_equals_plain(models, plain, tmp_path, reduced, batch):  # noqa: F811
    target, _, _ = models
    prompts, expected = (PROMPTS, plain) if batch == 3 else (PROMPTS[2:], plain[2:])
    d2t = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40].sort().values if reduced else None
    save_draft(init_draft(target, 1, 96, d2t), tmp_path / "draft")
    for gamma in (1, 4):
        out = specdec.generate(prompts, model=target, drafter="draft_model", gamma=gamma, max_new_tokens=MAX_NEW,
                               draft_model=str(tmp_path / "draft"))
        assert [r.token_ids for r in out.rows] == expected
        assert 0 < out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "d2t"])
def test_shared_draft_sampling_matches_plain_sampling(tmp_path, reduced):
    target = tiny_pair(tmp_path, "llama", seed=0, logit_scale=4.0, vocab_size=VOCAB)[0]
    d2t = torch.tensor([0, 1, 2, 3, 5, 8, 9]) if reduced else None  # q = 0 on the other ids
    save_draft(init_draft(target, 1, None, d2t), tmp_path / "draft")
    config = lambda seed: specdec.SpecConfig(gamma=3, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=seed))  # noqa: E731
    plain_tokens = tokens_of(specdec.SpecEngine(target, "none").generate([PROMPT] * ROWS, config(1)))
    engine = specdec.SpecEngine(target, "draft_model", specdec.drafters.DrafterOptions(draft_model=str(tmp_path / "draft")))
    assert isinstance(engine.drafter.draft, SharedDraftModel)
    out = engine.generate([PROMPT] * ROWS, config(2))
    assert 0 < out.stats.accepted < out.stats.drafted
    pvalues = distribution_pvalues(tokens_of(out), plain_tokens)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues


def test_init_layers_are_the_first_ones():
    assert init_layer_ids(30, 2) == [0, 1]
    assert init_layer_ids(30, 1) == [0]
    assert init_layer_ids(4, 4) == [0, 1, 2, 3]


def test_resume_gives_the_uninterrupted_result(trained, tmp_path, monkeypatch):
    target, features_file, _ = trained
    monkeypatch.setattr(train_draft, "CHECKPOINT_EVERY", 10)
    assert main(train_args(target, features_file, tmp_path / "whole", 30)) == 0
    real_step, calls = train_draft.train_step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 25:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_draft, "train_step", interrupted_step)
    assert main(train_args(target, features_file, tmp_path / "cut", 30)) == 130  # interrupted
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 20
    monkeypatch.setattr(train_draft, "train_step", real_step)
    assert main(train_args(target, features_file, tmp_path / "cut", 30, "--resume")) == 0
    whole, resumed = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("extra,message", [(["--layers", "3"], "--layers must be in 1..2"),
                                           (["--intermediate-size", "999"], "--intermediate-size must be at most")])
def test_bad_train_input_is_one_line(trained, tmp_path, capsys, extra, message):
    target, features_file, _ = trained
    code = main(train_args(target, features_file, tmp_path / "none", 2, *extra))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specdec: error: ") and message in err and err.count("\n") == 1

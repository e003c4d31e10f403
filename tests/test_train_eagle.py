"""EAGLE training on a tiny model: it learns (loss down, held-out top-1 agreement and tree acceptance
up, output still lossless), resumes exactly, picks the right draft vocabulary, and its heads
round-trip through our own format and the reference (SafeAILab/EAGLE, vLLM) layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import specdec
from conftest import DEVICE, tiny_folder_with_tokenizer, tiny_pair
from specdec.cli import main
from specdec.drafters.eagle import CPU_TREE, GPU_LOOKUP, EagleDrafter, EagleTreeConfig
from specdec.models.eagle import load_eagle_head, save_eagle_head
from specdec.train import eagle as train_module
from specdec.train.common import CHECKPOINT, first_tokens, frequent_vocab, load_checkpoint
from specdec.train.data import Example, Features, teacher_force
from specdec.train.eagle import (
    EagleTrainConfig,
    evaluate,
    export_reference,
    import_reference,
    init_head,
    train_eagle,
)

VOCAB = 96  # conftest.TINY
DRAFT_VOCAB = 64
SMALL = dict(batch_tokens=256, lr=3e-3, draft_vocab=DRAFT_VOCAB, held_out=0.15, warmup=10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and Features of its own greedy continuations of random prompts (like --data self)."""
    target = tiny_pair(tmp_path_factory.mktemp("eagle"), "llama", seed=0, logit_scale=8.0)[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (6,), generator=g).tolist() for _ in range(80)]
    rows = specdec.SpecEngine(target, "none").generate(prompts, specdec.SpecConfig(max_new_tokens=24)).rows
    examples = [Example(p, r.token_ids) for p, r in zip(prompts, rows)]
    hidden = teacher_force(target, examples, progress=False)
    features = Features([torch.tensor(e.prompt + e.response) for e in examples], hidden,
                        [len(e.prompt) for e in examples], "self")
    return target, features, prompts


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    target, features, _ = setup
    return train_eagle(target, features, EagleTrainConfig(steps=150, **{**SMALL, "lr": 1e-2}), tmp_path_factory.mktemp("run"), progress=False)


def test_training_lowers_loss_and_raises_held_out_agreement(setup, trained):
    target, features, _ = setup
    first, last = trained.history[0], trained.history[-1]
    assert last["train_loss"] < 0.8 * first["train_loss"]
    start = evaluate(init_head(target, trained.head.d2t, None), target, features, held_out_examples(features), 256)
    assert trained.held_out.positions == start.positions > 100
    assert trained.held_out.top1 > start.top1 + 0.08, (start.top1, trained.held_out.top1)
    assert trained.held_out.top1 > 20 / VOCAB  # chance is about 1 / VOCAB
    assert trained.held_out.loss < start.loss


def held_out_examples(features: Features) -> list[int]:
    from specdec.train.common import split_held_out

    return split_held_out(len(features.tokens), SMALL["held_out"], 0)[1]


def test_trained_head_drafts_better_and_stays_lossless(setup, trained):
    target, _, _ = setup
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (6,), generator=g).tolist() for _ in range(3)]  # unseen in training
    config = specdec.SpecConfig(gamma=4, max_new_tokens=24)
    plain = [r.token_ids for r in specdec.SpecEngine(target, "none").generate(prompts, config).rows]
    tree = EagleTreeConfig(depth=4, branch=2, frontier=2, total_tokens=6)
    accepted = {}
    for name, head in (("start", init_head(target, trained.head.d2t, None)), ("trained", trained.head)):
        out = specdec.SpecEngine(target, EagleDrafter(target, head, tree)).generate(prompts, config)
        assert [r.token_ids for r in out.rows] == plain, name
        accepted[name] = out.stats.accepted
    assert accepted["trained"] > 2 * accepted["start"], accepted


def test_resume_continues_at_the_saved_step_with_the_same_result(setup, tmp_path, monkeypatch):
    target, features, _ = setup
    config = EagleTrainConfig(steps=30, checkpoint_every=10, evaluations=2, **SMALL)
    whole = train_eagle(target, features, config, tmp_path / "whole", progress=False)

    real_step, calls = train_module.train_step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 25:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        train_eagle(target, features, config, tmp_path / "cut", progress=False)
    monkeypatch.setattr(train_module, "train_step", real_step)
    assert load_checkpoint(tmp_path / "cut", config.resume_key(features)).step == 20

    resumed = train_eagle(target, features, config, tmp_path / "cut", resume=True, progress=False)
    for (name, a), b in zip(whole.head.state_dict().items(), resumed.head.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.history == whole.history
    assert resumed.positions_seen == whole.positions_seen


def test_resume_refuses_a_checkpoint_of_other_settings(setup, tmp_path):
    target, features, _ = setup
    train_eagle(target, features, EagleTrainConfig(steps=2, **SMALL), tmp_path, progress=False)
    other = EagleTrainConfig(steps=4, **{**SMALL, "lr": 1e-4})
    with pytest.raises(specdec.errors.UserError, match="other settings"):
        train_eagle(target, features, other, tmp_path, resume=True, progress=False)


def test_draft_vocabulary_is_eos_plus_the_most_frequent_response_tokens():
    # responses: token 5 x4, 7 x3, 9 x2, 11 x1; prompts full of 3 (not counted); EOS = 50 never appears
    tokens = [torch.tensor([3, 3, 3, 5, 5, 7, 9]), torch.tensor([3, 3, 5, 5, 7, 7, 9, 11])]
    features = Features(tokens, [torch.zeros(len(t), 4) for t in tokens], [3, 2], "text")
    vocab = frequent_vocab(features, [0, 1], size=4, vocab_size=60, always=(50,))
    assert vocab.tolist() == [5, 7, 9, 50]
    assert frequent_vocab(features, [0], size=3, vocab_size=60, always=(50,)).tolist() == [5, 7, 50]
    filled = frequent_vocab(features, [0, 1], size=7, vocab_size=60, always=(50,))
    assert filled.tolist() == [0, 1, 5, 7, 9, 11, 50]  # unseen ids fill up by smaller id


def test_max_tokens_keeps_the_first_examples_that_fit():
    tokens = [torch.arange(n) for n in (5, 7, 4)]
    features = Features(tokens, [torch.zeros(len(t), 4) for t in tokens], [1, 1, 1], "text")
    assert [len(t) for t in first_tokens(features, 12).tokens] == [5, 7]
    assert len(first_tokens(features, None).tokens) == 3
    with pytest.raises(specdec.errors.UserError, match="holds no example"):
        first_tokens(features, 4)


def test_trainer_uses_the_frequent_vocabulary(setup, trained):
    target, features, _ = setup
    train = sorted(set(range(len(features.tokens))) - set(held_out_examples(features)))
    assert torch.equal(trained.head.d2t.cpu(), frequent_vocab(features, train, DRAFT_VOCAB, VOCAB, ()).cpu())


def random_weights(head, seed: int, scale: float = 1.0) -> None:
    """Random float16-representable weights (the reference export is float16), nonzero fc bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc.", "layers.")):
                p.copy_((torch.randn(p.shape, generator=g) * scale).half().float())


def test_own_save_load_round_trips_in_float16(setup, tmp_path):
    target, _, _ = setup
    head = init_head(target, torch.arange(0, VOCAB, 2), None)
    random_weights(head, 1)
    save_eagle_head(head, tmp_path, extra={"steps": 3}, dtype=torch.float16)
    assert all(v.dtype in (torch.float16, torch.int64) for v in load_file(str(tmp_path / "model.safetensors")).values())
    loaded = load_eagle_head(tmp_path)
    for name, value in head.state_dict().items():
        if name.startswith(("fc.", "layers.", "d2t")):
            assert torch.equal(loaded.state_dict()[name].cpu(), value.cpu()), name
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 3


REFERENCE_NAMES = {
    "fc.weight", "embed_tokens.weight", "layers.0.post_attention_layernorm.weight",
    *(f"layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
}


@pytest.mark.parametrize("bias", [False, True])
def test_reference_export_round_trips_exactly(setup, trained, tmp_path, bias):
    target, _, _ = setup
    head = init_head(target, trained.head.d2t, None)
    random_weights(head, 2)
    if not bias:
        head.fc.bias.data.zero_()
    export_reference(head, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) == REFERENCE_NAMES | ({"fc.bias"} if bias else set())
    c = target.config
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (c.num_kv_heads * c.head_dim, c.hidden_size)
    assert weights["layers.0.mlp.gate_proj.weight"].shape == (c.intermediate_size, c.hidden_size)
    assert torch.equal(weights["embed_tokens.weight"].float(), target.embed_tokens.weight.half().float().cpu())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["bias"] is bias and config["num_key_value_heads"] == c.num_kv_heads

    back = import_reference(tmp_path)
    for name, value in head.state_dict().items():
        if name.startswith(("fc.", "layers.", "d2t")):
            assert torch.equal(back.state_dict()[name].cpu(), value.cpu()), name
    back.attach(target, kernels=False)  # same weights, same function, as a trained head runs: identical features
    hidden, tokens = torch.randn(2, 5, c.hidden_size, device=DEVICE), torch.randint(0, VOCAB, (2, 5), device=DEVICE)
    positions = torch.arange(5, device=DEVICE).expand(2, 5)
    with torch.no_grad():
        assert torch.equal(back.features(hidden, tokens, positions, None), head.features(hidden, tokens, positions, None))


def test_exported_head_computes_the_same_in_a_transformers_llama_layer(setup, tmp_path):
    """An independent reading of the export: transformers' LlamaDecoderLayer (what EAGLE's cnets1 and
    vLLM build) without the input norm, after fc, gives our head's features."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    target, _, _ = setup
    head = init_head(target, torch.arange(VOCAB), None)
    random_weights(head, 4, scale=0.2)
    export_reference(head, tmp_path)
    config = LlamaConfig(**json.loads((tmp_path / "config.json").read_text()))
    config._attn_implementation = "eager"
    weights = {k: v.float() for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")})
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
    fc.load_state_dict({k.removeprefix("fc."): v for k, v in weights.items() if k.startswith("fc.")})
    B, T = 2, 7
    hidden, tokens = torch.randn(B, T, config.hidden_size), torch.randint(0, VOCAB, (B, T))
    positions = torch.arange(T).expand(B, T)
    with torch.no_grad():
        x = fc(torch.cat([head.embed_tokens.weight.cpu()[tokens], hidden], -1))
        cos_sin = LlamaRotaryEmbedding(config)(x, positions)
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
        expected = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
        expected = expected[0] if isinstance(expected, tuple) else expected
        ours = head.features(hidden.to(DEVICE), tokens.to(DEVICE), positions.to(DEVICE), None).cpu()
    assert (ours - expected).abs().max() < 1e-4
    assert (expected - x).abs().max() > 0.1  # the layer does something: the match is not vacuous


def test_import_reads_a_pytorch_bin_release_without_draft_vocabulary(setup, tmp_path):
    target, _, _ = setup
    head = init_head(target, torch.arange(VOCAB), None)
    random_weights(head, 3)
    export_reference(head, tmp_path)
    torch.save(load_file(str(tmp_path / "model.safetensors")), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "draft_vocab.safetensors").unlink()
    back = import_reference(tmp_path)
    assert torch.equal(back.d2t.cpu(), torch.arange(VOCAB))
    assert torch.equal(back.fc.weight.cpu(), head.fc.weight.cpu())


def test_cli_trains_saves_and_resumes(setup, tmp_path, capsys):
    target, features, _ = setup
    features.save(tmp_path / "features.safetensors")
    out = tmp_path / "out"
    args = lambda steps: ["train", "eagle", "--model", target.name, "--features", str(tmp_path / "features.safetensors"),  # noqa: E731
                          "--dtype", "float32", "--device", DEVICE, "--threads", "1", "--steps", str(steps),
                          "--batch-tokens", "256", "--draft-vocab", "32", "--out", str(out)]
    assert main(args(4)) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 4 and config["trained_with"].startswith("specdec train eagle --model")
    assert config["data"] == "self" and config["tokens"] == features.num_tokens and 0 <= config["held_out_top1"] <= 1
    assert (out / CHECKPOINT).exists()
    assert load_eagle_head(out).d2t.shape == (32,)
    assert "held-out top-1 agreement" in capsys.readouterr().out
    assert main(args(6) + ["--resume"]) == 0
    assert json.loads((out / "config.json").read_text())["steps"] == 6
    assert torch.load(out / CHECKPOINT, weights_only=True)["step"] == 6


@pytest.mark.parametrize("extra,message", [
    (["--resume"], "no checkpoint"),
    (["--features", "/no/such/file"], "no such file"),
    (["--steps", "0"], "--steps >= 1"),
    (["--draft-vocab", "0"], "--draft-vocab must be >= 1"),
])
def test_bad_train_input_is_one_line(tmp_path, capsys, extra, message):
    code = main(["train", "eagle", "--out", str(tmp_path / "none"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specdec: error: ") and message in err and err.count("\n") == 1


def test_bench_and_generate_take_an_eagle_head(tmp_path, capsys):
    folder = tiny_folder_with_tokenizer(tmp_path)
    target = specdec.load_model(str(folder), dtype="float32", device=DEVICE)
    save_eagle_head(init_head(target, torch.arange(VOCAB), None), tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["the cat sat on the mat . the cat sat on"]}\n{"turns": ["1 + 2 = 3 . 4 + 5 ="]}\n')
    common = ["--model", str(folder), "--device", DEVICE, "--dtype", "float32", "--max-new-tokens", "10", "--raw", "--threads", "1"]
    assert main(["bench", "--task", str(prompts), "--drafters", "eagle", "--eagle-head", str(tmp_path / "head"),
                 "--gammas", "3", "--peers", "", "--out", str(tmp_path / "bench"), "--json", *common]) == 0
    methods = {m["name"]: m for m in json.loads(capsys.readouterr().out)["methods"]}
    assert methods["specdec/eagle/3"]["lossless"] and methods["specdec/eagle/3"]["num_outputs"] == 2
    lookup = GPU_LOOKUP if DEVICE.startswith("cuda") else CPU_TREE["lookup"]
    assert methods["specdec/eagle/3"]["tree"]["lookup"] == lookup  # the tree that ran, its defaults included
    assert "tree" not in methods["specdec/none"]
    assert main(["generate", "the cat sat", "--drafter", "eagle", "--eagle-head", str(tmp_path / "head"),
                 "--check-lossless", "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)["lossless"] is True
    for command in (["generate", "the cat", "--drafter", "eagle"], ["bench", "--drafters", "eagle", "--peers", ""]):
        assert main([*command, *common]) == 2  # the shipped head fits the default model only
        assert "needs --eagle-head PATH" in capsys.readouterr().err

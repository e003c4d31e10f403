"""The Medusa drafter, its heads, their training and their exports.

With random heads the drafter must stay lossless: greedy output equals plain greedy decoding (batch 1
and 3) and sampled output matches plain sampling's distribution. Each proposal must read the target's
feature at the last kept token. Trees are validated and built from rank accuracies. Heads survive
save/load and both export layouts (FasterDecoding/Medusa, vLLM). A short training run on a tiny
target lowers the loss and writes a loadable, resumable result.
"""

from __future__ import annotations

import json
import pytest
import torch

import specdec
from conftest import DEVICE, tiny_folder_with_tokenizer, tiny_pair
from specdec import SamplingParams
from specdec.drafters import DrafterOptions
from specdec.drafters.medusa import CPU_CHAIN, DEFAULT_TREE, MedusaDrafter, MedusaTree, sparse_tree, tree_for
from specdec.errors import UserError
from safetensors.torch import load_file

from specdec.cli import main
from specdec.models.checkpoint import read_config
from specdec.models.medusa import MedusaConfig, MedusaHeads, export_medusa, load_medusa_heads, save_medusa_heads
from specdec.train import medusa as train_medusa
from test_engine import MAX_NEW, PROMPTS, models, plain  # noqa: F401  (fixtures)
from test_train_eagle import setup  # noqa: F401  (fixture: a tiny target and features of its own continuations)
from test_sampling_e2e import ALPHA, PROMPT, ROWS, VOCAB, distribution_pvalues, tokens_of

SMALL_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def random_heads(target, num_heads: int = 4, draft_vocab: int | None = None, seed: int = 0) -> MedusaHeads:
    """Heads with random residual blocks (a trained set is not needed for losslessness)."""
    torch.manual_seed(seed)
    c = target.config
    heads = MedusaHeads(MedusaConfig(c.hidden_size, c.vocab_size, num_heads, draft_vocab or c.vocab_size))
    for block in heads.medusa_head:
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
        torch.nn.init.normal_(block[0].linear.bias, std=0.5)
    if draft_vocab:
        heads.d2t = torch.randperm(c.vocab_size)[:draft_vocab].sort().values
    return heads


@pytest.mark.parametrize("tree", [DEFAULT_TREE, SMALL_TREE], ids=["default", "small"])
@pytest.mark.parametrize("batch", [1, 3])
def test_medusa_greedy_equals_plain(models, plain, tree, batch):  # noqa: F811
    target, _, _ = models
    prompts, expected = (PROMPTS, plain) if batch == 3 else (PROMPTS[2:], plain[2:])
    heads = random_heads(target, draft_vocab=64)
    drafter = MedusaDrafter(target, heads, MedusaTree.of(tree, 4))
    out = specdec.SpecEngine(target, drafter).generate(prompts, specdec.SpecConfig(gamma=4, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == expected
    assert out.stats.draft_nodes > out.stats.drafted > 0


def test_medusa_reads_the_feature_of_the_last_kept_token(models):  # noqa: F811
    """Before every proposal the drafter's feature is the target's hidden state at the token before the
    pending one (the one whose logits gave it), as a fresh forward over the whole sequence computes it."""
    target, _, _ = models
    drafter = MedusaDrafter(target, random_heads(target), MedusaTree.of(DEFAULT_TREE, 4))
    seen = []
    propose = drafter.propose

    def spy(batch, gamma, u):
        rows = [batch.tokens[b, : int(batch.length[b])].tolist() for b in range(batch.capacity)]
        seen.append((rows, batch.active.tolist(), batch.draft.clone()))  # batch.draft: the features [B, D]
        return propose(batch, gamma, u)

    drafter.propose = spy
    engine = specdec.SpecEngine(target, drafter, graphs=False)  # the spy reads rows back: eager steps
    out = engine.generate(PROMPTS, specdec.SpecConfig(gamma=4, max_new_tokens=MAX_NEW))
    assert out.stats.accepted > 0 and len(seen) > 2
    for tokens, active, features in seen:
        for b, ids in enumerate(tokens):
            if not active[b]:
                continue  # finished rows keep their last feature
            cache = target.new_cache(1, len(ids))
            hidden = target(torch.tensor([ids], device=DEVICE), torch.arange(len(ids), device=DEVICE)[None], cache).hidden
            torch.testing.assert_close(features[b], hidden[0, len(ids) - 2], atol=1e-4, rtol=1e-4)


def test_medusa_sampling_matches_plain_sampling(tmp_path):
    target = tiny_pair(tmp_path, "llama", seed=0, logit_scale=4.0, vocab_size=VOCAB)[0]
    config = lambda seed: specdec.SpecConfig(gamma=3, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=seed))  # noqa: E731
    plain_tokens = tokens_of(specdec.SpecEngine(target, "none").generate([PROMPT] * ROWS, config(1)))
    drafter = MedusaDrafter(target, random_heads(target, num_heads=3), MedusaTree.of(SMALL_TREE, 3))
    out = specdec.SpecEngine(target, drafter).generate([PROMPT] * ROWS, config(2))
    assert 0 < out.stats.accepted < out.stats.drafted
    pvalues = distribution_pvalues(tokens_of(out), plain_tokens)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues


def test_tree_is_validated_and_sorted_breadth_first():
    tree = MedusaTree.of([(0,), (0, 0), (1,), (0, 0, 0), (0, 1)], num_heads=3)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert tree.parents() == [-1, -1, 0, 0, 2]
    with pytest.raises(UserError, match="parent"):
        MedusaTree.of([(0,), (1, 0)], num_heads=2)
    with pytest.raises(UserError, match="deeper"):
        MedusaTree.of([(0,), (0, 0)], num_heads=1)


def test_sparse_tree_takes_the_most_likely_paths():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.05]]
    # scores: (0) .6, (1) .2, (2) .1, (0,0) .3, (0,1) .18, (1,0) .1, (0,2) .03
    assert sparse_tree(accuracy, 4) == [(0,), (0, 0), (1,), (0, 1)]
    paths = sparse_tree(accuracy, 6)
    assert all(p[:-1] in paths for p in paths if len(p) > 1)


def test_saved_heads_load_and_propose_the_same(models, tmp_path):  # noqa: F811
    target, _, _ = models
    heads = random_heads(target, draft_vocab=32, seed=3)
    save_medusa_heads(heads, tmp_path / "heads", extra={"medusa_tree": [list(p) for p in SMALL_TREE]})
    loaded = load_medusa_heads(tmp_path / "heads")
    assert torch.equal(loaded.d2t, heads.d2t)
    for name, a in heads.state_dict().items():
        if name.startswith("medusa_head."):
            assert torch.equal(loaded.state_dict()[name], a.half().float()), name
    size = sum(f.stat().st_size for f in (tmp_path / "heads").iterdir())
    assert size < 4 * 4 * (64 * 64 + 64) * 2 + 32 * 8 + 4096  # float16 blocks and d2t only: no LM head
    assert tree_for(None, loaded, read_config(tmp_path / "heads", "a Medusa heads folder")).paths == MedusaTree.of(SMALL_TREE, 4).paths  # the stored tree
    options = DrafterOptions(extra={"medusa_path": str(tmp_path / "heads")})
    engine = specdec.SpecEngine(target, "medusa", options)
    on_cpu = next(target.parameters()).device.type == "cpu"
    tree = MedusaTree.of(CPU_CHAIN if on_cpu else SMALL_TREE, 4)  # on the CPU a chain, whatever the heads stored
    assert engine.drafter.tree.paths == tree.paths
    a = engine.generate(PROMPTS, specdec.SpecConfig(max_new_tokens=12))
    b = specdec.SpecEngine(target, MedusaDrafter(target, loaded, tree)).generate(PROMPTS, specdec.SpecConfig(max_new_tokens=12))
    assert a.stats.accepted_per_position == b.stats.accepted_per_position


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_exports_round_trip(models, tmp_path, layout):  # noqa: F811
    target, _, _ = models
    heads = random_heads(target, draft_vocab=None if layout == "medusa" else 32, seed=4)
    heads.load_state_dict({k: v.half().float() for k, v in heads.state_dict().items() if k != "d2t"}, strict=False)
    heads.attach(target)  # blocks rounded to float16 first: the exports store float16
    folder = export_medusa(heads, target, tmp_path / layout, layout)
    config = json.loads((folder / "config.json").read_text())
    if layout == "medusa":
        from safetensors.torch import load_file

        state = load_file(str(folder / "medusa_lm_head.safetensors"))
        assert config["medusa_num_heads"] == 4 and config["medusa_num_layers"] == 1
        assert set(state) == {f"{k}.0.linear.{w}" for k in range(4) for w in ("weight", "bias")} | {f"{k}.1.weight" for k in range(4)}
        assert torch.equal(state["3.1.weight"], target.lm_head.weight.half().cpu())
    else:
        assert config["num_heads"] == 4 and config["truncated_vocab_size"] == 32
    loaded = load_medusa_heads(folder).attach(target)
    assert torch.equal(loaded.d2t, heads.d2t)
    x = torch.randn(5, target.config.hidden_size, device=DEVICE)
    torch.testing.assert_close(loaded(x), heads(x), atol=1e-5, rtol=1e-5)


def test_bad_heads_folder_is_a_user_error(models, tmp_path):  # noqa: F811
    target, _, _ = models
    with pytest.raises(UserError):
        specdec.SpecEngine(target, "medusa")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not a Medusa"):
        specdec.SpecEngine(target, "medusa", DrafterOptions(extra={"medusa_path": str(tmp_path)}))


# ---- training -------------------------------------------------------------------------------------


def train_args(target, features_file, out, steps: int, *extra: str) -> list[str]:
    return ["train", "medusa", "--model", target.name, "--features", str(features_file), "--dtype", "float32",
            "--device", DEVICE, "--threads", "1", "--steps", str(steps), "--batch-tokens", "256", "--heads", "3",
            "--draft-vocab", "64", "--lr", "1e-2", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):  # noqa: F811
    """(target, features file, out folder) after 80 steps on the tiny target's own continuations."""
    target, features, _ = setup
    tmp = tmp_path_factory.mktemp("medusa-train")
    features.save(tmp / "features.safetensors")
    assert main(train_args(target, tmp / "features.safetensors", tmp / "out", 80)) == 0
    return target, tmp / "features.safetensors", tmp / "out"


def test_training_lowers_the_loss_and_raises_agreement(trained):
    _, _, out = trained
    report = json.loads((out / "report.json").read_text())
    before, after = report["held_out_before"], report["held_out_after"]
    assert after["positions"] > 50
    assert all(a < 0.97 * b for a, b in zip(after["loss"], before["loss"])), (before["loss"], after["loss"])
    assert after["top1"][0] > before["top1"][0] + 0.1, (before["top1"], after["top1"])
    assert after["chain_top1"] == sorted(after["chain_top1"], reverse=True) and after["chain_tau"] > 1
    first, last = report["train_loss"]["first_steps"], report["train_loss"]["last_steps"]
    assert all(a < b for a, b in zip(last, first))
    config = json.loads((out / "config.json").read_text())
    assert config["num_heads"] == 3 and config["draft_vocab_size"] == 64
    assert MedusaTree.of(config["medusa_tree"], 3).paths  # a valid stored tree
    assert len(config["medusa_tree"]) == len(DEFAULT_TREE) and report["estimated_tau"] > 1


def test_trained_heads_draft_better_and_stay_lossless(trained):
    target, _, out = trained
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.config.vocab_size, (6,), generator=g).tolist() for _ in range(3)]  # unseen
    config = specdec.SpecConfig(gamma=4, max_new_tokens=24)
    expected = [r.token_ids for r in specdec.SpecEngine(target, "none").generate(prompts, config).rows]
    trained_heads = load_medusa_heads(out)
    untrained = MedusaHeads(trained_heads.config)  # zero blocks: every head repeats the target's next guess
    untrained.d2t = trained_heads.d2t
    accepted = {}
    for name, heads in (("untrained", untrained), ("trained", trained_heads)):
        drafter = MedusaDrafter(target, heads, MedusaTree.of(SMALL_TREE, 3))
        result = specdec.SpecEngine(target, drafter).generate(prompts, config)
        assert [r.token_ids for r in result.rows] == expected, name
        accepted[name] = result.stats.accepted
    assert accepted["trained"] > 2 * accepted["untrained"] + 5, accepted


def test_resume_gives_the_uninterrupted_result(trained, tmp_path, monkeypatch):
    target, features_file, _ = trained
    monkeypatch.setattr(train_medusa, "CHECKPOINT_EVERY", 10)
    assert main(train_args(target, features_file, tmp_path / "whole", 30)) == 0
    real_step, calls = train_medusa.train_step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 25:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_medusa, "train_step", interrupted_step)
    assert main(train_args(target, features_file, tmp_path / "cut", 30)) == 130  # interrupted
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 20
    monkeypatch.setattr(train_medusa, "train_step", real_step)
    assert main(train_args(target, features_file, tmp_path / "cut", 30, "--resume")) == 0
    whole, resumed = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    reports = [json.loads((tmp_path / f / "report.json").read_text()) for f in ("whole", "cut")]
    assert reports[0]["held_out_after"] == reports[1]["held_out_after"]


@pytest.mark.parametrize("extra,message", [(["--heads", "0"], "--heads must be >= 1"), (["--resume"], "no checkpoint")])
def test_bad_train_input_is_one_line(trained, tmp_path, capsys, extra, message):
    target, features_file, _ = trained
    code = main(train_args(target, features_file, tmp_path / "none", 2, *extra))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specdec: error: ") and message in err and err.count("\n") == 1


def test_cli_and_bench_run_medusa_heads_and_a_shared_draft(tmp_path, capsys):
    """`--medusa-heads` (generate, bench) and a `specdec train draft` folder as bench's --draft-model."""
    from specdec.bench.runner import BenchConfig, run_bench
    from specdec.models import load_model
    from specdec.train.draft import init_draft, save_draft

    folder = tiny_folder_with_tokenizer(tmp_path)
    target = load_model(str(folder), dtype="float32", device=DEVICE)
    save_medusa_heads(random_heads(target, draft_vocab=48), tmp_path / "heads")
    save_draft(init_draft(target, 1, None, torch.arange(0, 96, 2)), tmp_path / "draft")
    assert main(["generate", "the cat sat on the mat", "--model", str(folder), "--raw", "--drafter", "medusa",
                 "--medusa-heads", str(tmp_path / "heads"), "--max-new-tokens", "12", "--check-lossless", "--json",
                 "--threads", "1", "--device", DEVICE]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lossless"] and report["stats"]["draft_nodes"] > 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["the cat sat on the mat . the cat sat on"]}\n{"turns": ["1 + 2 = 3 . 4 + 5 ="]}\n')
    results = run_bench(BenchConfig(task=str(prompts), limit=None, model=str(folder), drafters=("medusa", "draft_model"),
                                    gammas=(3,), peers=(), max_new_tokens=12, draft_model=str(tmp_path / "draft"),
                                    drafter_extra={"medusa_path": str(tmp_path / "heads")}, device=DEVICE, chat=False), progress=False)
    methods = {m["name"]: m for m in results["methods"]}
    assert methods["specdec/medusa/3"]["lossless"] and methods["specdec/draft_model/3"]["lossless"]
    assert methods["specdec/medusa/3"]["drafted_per_step"] > 0
    with pytest.raises(UserError, match="hf-assisted"):
        BenchConfig(model=str(folder), peers=("hf-assisted",), draft_model=str(tmp_path / "draft"))
    assert main(["generate", "x", "--model", str(folder), "--drafter", "medusa"]) == 2
    assert "--medusa-heads" in capsys.readouterr().err

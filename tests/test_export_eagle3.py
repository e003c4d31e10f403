"""`specdec export eagle3`: an EAGLE-3 head in the layouts vLLM (speculators format) and SGLang
(SafeAILab EAGLE-3 names) load validates against the schema written from their loaders
(specdec.interop.schema), imports back to a head whose drafts are bit for bit the original's in float32,
computes the same as the references' layer read from the exported files, and a broken folder fails
validation with a message naming what is wrong. Nothing is downloaded; vLLM and SGLang are not run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import specdec
from conftest import DEVICE, build_hf, save_hf
from specdec.cli import main
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.errors import UserError
from specdec.interop.eagle3 import export_eagle3, import_eagle3
from specdec.interop.schema import MANIFEST, detect, validate
from specdec.models import load_model
from specdec.models.eagle import save_eagle_head
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3_head
from specdec.train.eagle import init_head

LAYERS, VOCAB, DRAFT_VOCAB, D = 6, 96, 40, 64  # the tiny target (conftest.TINY, 6 layers)
TAPS = (1, 3, 4)  # three distinct layers >= 1 (the default for 6 layers, (2, 3, 3), repeats one)
LAYOUTS = ("vllm", "sglang", "speculators")
PROMPTS = [[5, 17, 3, 9, 44, 2, 71], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 30, 31]]
TREE = EagleTreeConfig(depth=3, branch=2, frontier=2, total_tokens=6)


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    return save_hf(build_hf("llama", seed=0, logit_scale=4.0, num_hidden_layers=LAYERS), tmp_path_factory.mktemp("e3") / "t")


@pytest.fixture(scope="module")
def target(target_folder):
    return load_model(str(target_folder), dtype="float32", device=DEVICE)


def head3(target, taps=TAPS, seed: int = 1) -> Eagle3Head:
    """A head with random float16-representable weights (exports are float16: then they are exact) and a
    draft vocabulary in no particular order."""
    head = Eagle3Head(Eagle3Config.for_target(target.config, DRAFT_VOCAB, feature_layers=taps))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_((1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise).half().float())
    head.d2t = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]
    return head


def aux_of(target, taps, seed: int = 0, T: int = 7):
    """(aux [2, T, 3D] the target's tapped layers in `taps` order, tokens [2, T], positions [2, T])."""
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    positions = torch.arange(T, device=DEVICE).expand(2, T)
    return target(tokens, positions, target.new_cache(2, T), aux_layers=taps).aux, tokens, positions


def draft_logits(head, aux, tokens, positions):
    with torch.no_grad():
        return head.logits(head.features(head.project(aux), tokens, positions, None))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_validates_imports_and_drafts_the_same(target, tmp_path, layout):
    head = head3(target)
    export_eagle3(head, tmp_path, layout, target_name="tiny-target")
    result = validate(tmp_path, "eagle3", layout)
    assert result.ok, result.problems
    assert result.tensors_checked >= 16 and result.keys_checked >= 20
    assert detect(tmp_path) == ("eagle3", "sglang" if layout == "sglang" else "speculators")

    back = import_eagle3(tmp_path, LAYERS)
    assert back.config == head.config
    for name, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    head.attach(target), back.attach(target)  # the exact kernels, as drafting runs
    aux, tokens, positions = aux_of(target, TAPS)
    assert torch.equal(draft_logits(back, aux, tokens, positions), draft_logits(head, aux, tokens, positions))
    config = specdec.SpecConfig(gamma=3, max_new_tokens=16)
    ours = specdec.SpecEngine(target, EagleDrafter(target, head, TREE)).generate(PROMPTS, config)
    theirs = specdec.SpecEngine(target, EagleDrafter(target, back, TREE)).generate(PROMPTS, config)
    assert [r.token_ids for r in ours.rows] == [r.token_ids for r in theirs.rows]
    assert ours.stats.accepted_per_position == theirs.stats.accepted_per_position and ours.stats.drafted > 0


def test_layouts_carry_the_reference_conventions(target, tmp_path):
    head = head3(target)
    for layout in ("speculators", "sglang"):
        export_eagle3(head, tmp_path / layout, layout)
    spec = load_file(str(tmp_path / "speculators" / "model.safetensors"))
    sgl = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in spec and "midlayer.hidden_norm.weight" in sgl  # SGLang skips layers.0.*
    assert not any(k.startswith(("layers.", "embed_tokens")) for k in sgl) and "fc.bias" not in spec
    for weights in (spec, sgl):
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert torch.equal(weights["d2t"] + torch.arange(DRAFT_VOCAB), head.d2t)  # offsets: target id = i + d2t[i]
        assert weights["t2d"].sum() == DRAFT_VOCAB and bool(weights["t2d"][head.d2t].all())
        assert weights["fc.weight"].shape == (D, 3 * D) and weights["lm_head.weight"].shape == (DRAFT_VOCAB, D)
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TAPS)  # vLLM taps these layers' inputs, as specdec
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["transformer_layer_config"]["vocab_size"] == VOCAB
    sglang = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"] and sglang["tie_word_embeddings"] is False
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in TAPS]  # SGLang taps id + 1


def test_default_taps_write_no_sglang_ids(tmp_path):
    """With the default taps [2, L // 2, L - 3] the sglang layout leaves them out: SGLang's and vLLM's defaults
    are those layers' inputs, while the nested ids mean outputs to SGLang and inputs to some vLLM versions."""
    target = load_model(str(save_hf(build_hf("llama", seed=0, num_hidden_layers=8), tmp_path / "t8")), dtype="float32",
                        device=DEVICE)
    head = head3(target, taps=None)
    assert head.config.feature_layers == (2, 4, 5)
    export_eagle3(head, tmp_path / "o", "sglang")
    assert "eagle_config" not in json.loads((tmp_path / "o" / "config.json").read_text())
    assert import_eagle3(tmp_path / "o", 8).config == head.config


@pytest.mark.parametrize("layout", ["speculators", "sglang"])
def test_exported_files_compute_what_the_reference_layer_computes(target, tmp_path, layout):
    """An independent reading of the exported files as SafeAILab's cnets.py / vLLM's and SGLang's
    llama_eagle3.py compute: taps concatenated in layer order -> fc; q/k/v over cat(input_layernorm(embed),
    hidden_norm(h)); residual h; transformers' attention, MLP and norms; logits scattered to i + d2t[i].
    The head's taps are out of order: the export permutes fc's blocks (equal to rounding)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    head = head3(target, taps=(4, 1, 3), seed=5).attach(target, kernels=False)
    export_eagle3(head, tmp_path, layout)
    config = json.loads((tmp_path / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    p = "layers.0." if layout == "speculators" else "midlayer."
    written = config["eagle_aux_hidden_state_layer_ids"] if layout == "speculators" else \
        [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert written == [1, 3, 4]
    c = LlamaConfig(**(config["transformer_layer_config"] if layout == "speculators" else config))
    c._attn_implementation = "eager"
    attn, mlp = LlamaAttention(c, layer_idx=0), LlamaMLP(c)
    for name in "qkv":
        setattr(attn, f"{name}_proj", torch.nn.Linear(2 * D, w[f"{p}self_attn.{name}_proj.weight"].shape[0], bias=False))
    attn.load_state_dict({k.removeprefix(f"{p}self_attn."): v for k, v in w.items() if k.startswith(f"{p}self_attn.")})
    mlp.load_state_dict({k.removeprefix(f"{p}mlp."): v for k, v in w.items() if k.startswith(f"{p}mlp.")})
    norms = {}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        norms[name] = LlamaRMSNorm(D, c.rms_norm_eps)
        norms[name].weight.data = w[f"{p}{name}.weight"]
    final = LlamaRMSNorm(D, c.rms_norm_eps)
    final.weight.data = w["norm.weight"]

    aux, tokens, positions = aux_of(target, (1, 3, 4), seed=2)  # what vLLM / SGLang hand the head: layer order
    T = tokens.shape[1]
    with torch.no_grad():
        aux, tokens, positions = aux.cpu(), tokens.cpu(), positions.cpu()
        h = torch.nn.functional.linear(aux, w["fc.weight"])
        embeds = target.embed_tokens.weight.cpu()[tokens]
        x = torch.cat([norms["input_layernorm"](embeds), norms["hidden_norm"](h)], dim=-1)
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
        h = h + attn(x, LlamaRotaryEmbedding(c)(x, positions), causal)[0]
        h = h + mlp(norms["post_attention_layernorm"](h))
        draft = torch.nn.functional.linear(final(h), w["lm_head.weight"])  # [2, T, Vd]
        theirs = torch.full((2, T, VOCAB), float("-inf"))
        theirs[..., torch.arange(DRAFT_VOCAB) + w["d2t"].long()] = draft  # vLLM compute_logits
        ours_aux, _, _ = aux_of(target, (4, 1, 3), seed=2)
        ours = draft_logits(head, ours_aux, tokens.to(DEVICE), positions.to(DEVICE)).cpu()
    torch.testing.assert_close(theirs[..., head.d2t.cpu()], ours, atol=1e-4, rtol=1e-4)
    assert (ours - ours.mean()).abs().max() > 0.1  # not vacuous


# ---- broken folders fail validation with a message -----------------------------------------------


def corrupt_tensors(folder, change):
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"))


def corrupt_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def rename_layer(weights, old, new):
    for name in [k for k in weights if k.startswith(old)]:
        weights[new + name.removeprefix(old)] = weights.pop(name)


CORRUPTIONS = {
    "missing tensor": ("speculators", lambda f: corrupt_tensors(f, lambda w: w.pop("layers.0.hidden_norm.weight")),
                       "missing layers.0.hidden_norm.weight"),
    "missing d2t": ("sglang", lambda f: corrupt_tensors(f, lambda w: w.pop("d2t")), "missing d2t"),
    "q/k/v one D wide": ("speculators", lambda f: corrupt_tensors(
        f, lambda w: w.update({"layers.0.self_attn.q_proj.weight": torch.zeros(D, D).half()})),
        "layers.0.self_attn.q_proj.weight has shape [64, 64], expected [64, 128]"),
    "fc over two layers": ("sglang", lambda f: corrupt_tensors(f, lambda w: w.update({"fc.weight": torch.zeros(D, 2 * D).half()})),
                           "fc.weight has shape [64, 128], expected [64, 192]"),
    "float d2t": ("speculators", lambda f: corrupt_tensors(f, lambda w: w.update({"d2t": w["d2t"].float()})),
                  "d2t is F32, expected one of I64"),
    "absolute d2t": ("speculators", lambda f: corrupt_tensors(f, lambda w: w.update({"d2t": w["d2t"] + torch.arange(DRAFT_VOCAB)})),
                     "d2t offsets give target ids outside"),
    "t2d off": ("sglang", lambda f: corrupt_tensors(f, lambda w: w["t2d"].logical_not_()), "t2d does not mark"),
    "layers.0 names for SGLang": ("sglang", lambda f: corrupt_tensors(f, lambda w: rename_layer(w, "midlayer.", "layers.0.")),
                                  "no parameter for: layers.0."),
    "fc bias": ("speculators", lambda f: corrupt_tensors(f, lambda w: w.update({"fc.bias": torch.zeros(D).half()})),
                "no parameter for: fc.bias"),
    "model type": ("speculators", lambda f: corrupt_config(f, lambda c: c.update(speculators_model_type="eagle")),
                   "speculators_model_type is 'eagle', expected 'eagle3'"),
    "norm_before_residual left to vLLM": ("speculators", lambda f: corrupt_config(f, lambda c: c.pop("norm_before_residual")),
                                          "missing norm_before_residual"),
    "no draft vocabulary": ("sglang", lambda f: corrupt_config(f, lambda c: c.pop("draft_vocab_size")), "missing draft_vocab_size"),
    "architecture": ("sglang", lambda f: corrupt_config(f, lambda c: c.update(architectures=["LlamaForCausalLMEagle"])),
                     "architectures is ['LlamaForCausalLMEagle'], expected ['LlamaForCausalLMEagle3']"),
    "tied head": ("sglang", lambda f: corrupt_config(f, lambda c: c.update(tie_word_embeddings=True)), "tie_word_embeddings is True"),
    "taps out of order": ("speculators", lambda f: corrupt_config(f, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[4, 1, 3])),
                          "must increase"),
    "two taps": ("sglang", lambda f: corrupt_config(f, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2])),
                 "must be a list of 3 layer ids"),
    "bad verifier": ("speculators", lambda f: corrupt_config(f, lambda c: c["speculators_config"].pop("verifier")),
                     "missing speculators_config.verifier"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_broken_export_fails_validation_with_a_message(target, tmp_path, case):
    layout, corrupt, message = CORRUPTIONS[case]
    export_eagle3(head3(target), tmp_path, layout)
    corrupt(tmp_path)
    problems = validate(tmp_path, "eagle3", layout).problems
    assert any(message in p for p in problems), problems


def test_import_refuses_an_invalid_folder_in_one_line(target, tmp_path):
    export_eagle3(head3(target), tmp_path, "sglang")
    corrupt_tensors(tmp_path, lambda w: w.pop("norm.weight"))
    with pytest.raises(UserError, match="not a valid sglang EAGLE-3 folder: model.safetensors: missing norm.weight"):
        import_eagle3(tmp_path, LAYERS)


@pytest.mark.parametrize("taps,message", [((2, 3, 3), "three distinct"), ((0, 2, 4), "target layer 0"),
                                          ((1, 2), "three distinct")])
def test_heads_vllm_and_sglang_cannot_tap_are_refused(target, tmp_path, taps, message):
    with pytest.raises(UserError, match=message):
        export_eagle3(head3(target, taps=taps), tmp_path, "vllm")
    assert not (tmp_path / "model.safetensors").exists()


# ---- the command ---------------------------------------------------------------------------------


def run(*args: str) -> list[str]:
    return ["export", *args, "--threads", "1", "--device", DEVICE, "--dtype", "float32"]


def test_cli_exports_a_trained_head_and_checks_it(target, tmp_path, capsys, monkeypatch):
    def no_target(*args, **kwargs):
        raise AssertionError("an EAGLE-3 export needs no target")

    save_eagle3_head(head3(target), tmp_path / "head", dtype=torch.float16)
    monkeypatch.setattr("specdec.models.load_model", no_target)
    out = tmp_path / "out"
    assert main(run("eagle3", "--drafter-path", str(tmp_path / "head"), "--layout", "vllm", "--out", str(out),
                    "--target-name", "org/tiny", "--json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["validation"]["valid"] and summary["kind"] == "eagle3" and summary["layout"] == "vllm"
    assert {f["name"] for f in summary["files"]} == {"config.json", "model.safetensors", MANIFEST}
    assert '"method": "eagle3"' in summary["usage_not_run_here"][0]
    assert main(run("--check", str(out))) == 0
    assert "valid" in capsys.readouterr().out
    assert main(run("eagle3", "--drafter-path", str(tmp_path / "head"), "--layout", "sglang", "--out", str(tmp_path / "s"))) == 0
    assert "--speculative-algorithm EAGLE3" in capsys.readouterr().out
    assert import_eagle3(tmp_path / "s", LAYERS).config == import_eagle3(out, LAYERS).config


@pytest.fixture
def folders(target, tmp_path):
    save_eagle_head(init_head(target, torch.arange(DRAFT_VOCAB), None), tmp_path / "eagle2", dtype=torch.float16)
    save_eagle3_head(head3(target, taps=(2, 3, 3)), tmp_path / "repeats", dtype=torch.float16)
    return tmp_path


@pytest.mark.parametrize("args,message", [
    (["eagle3", "--layout", "vllm", "--drafter-path", "{tmp}/eagle2"], "holds a eagle drafter, not eagle3"),
    (["eagle3", "--layout", "vllm", "--drafter-path", "{tmp}/repeats"], "vLLM and SGLang tap three distinct layers"),
    (["eagle3", "--layout", "reference", "--drafter-path", "{tmp}/repeats"], "does not take eagle3 drafters"),
    (["eagle3", "--layout", "sglang"], "no shipped eagle3 drafter"),
    (["eagle", "--layout", "vllm", "--drafter-path", "{tmp}/repeats"], "holds a eagle3 drafter, not eagle"),
    (["eagle3", "--layout", "sglang", "--drafter-path", "{tmp}/nowhere"], "no such folder"),
])
def test_bad_eagle3_export_input_is_one_line(folders, capsys, args, message):
    argv = [a.replace("{tmp}", str(folders)) for a in args] + ["--out", str(folders / "out")]
    assert main(run(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: ") and message in err and err.count("\n") == 1, err

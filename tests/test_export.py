"""`specdec export`: every drafter layout validates against the schema written from its runtime's loader
(specdec.interop.schema), round-trips (export -> import: the same head weights, the same draft logits on
a tiny random target), reads the same through transformers' Llama layer (what vLLM, SGLang and
speculators build), and bad input is one line. Nothing is downloaded; vLLM and SGLang are not run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import DEVICE, build_hf, save_hf
from specdec.cli import main
from specdec.errors import UserError
from specdec.interop.eagle import export_eagle, import_eagle
from specdec.interop.schema import D2T_FILE, MANIFEST, SCHEMAS, detect, read_d2t, schema_for, validate
from specdec.models import load_model
from specdec.models.eagle import save_eagle_head
from specdec.models.medusa import MedusaConfig, MedusaHeads, export_medusa, load_medusa_heads, save_medusa_heads
from specdec.train.eagle import export_reference, init_head

VOCAB, DRAFT_VOCAB = 96, 40  # conftest.TINY's vocabulary; a reduced draft vocabulary
EAGLE_LAYOUTS = ("vllm", "sglang", "speculators", "reference")


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    """A tiny random Llama whose weights are float16 values (exports are float16: then they are exact)."""
    hf = build_hf("llama", seed=0, logit_scale=8.0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.half().float())
    return save_hf(hf, tmp_path_factory.mktemp("export") / "target")


@pytest.fixture(scope="module")
def target(target_folder):
    return load_model(str(target_folder), dtype="float32", device=DEVICE)


def d2t_subset(seed: int = 0) -> torch.Tensor:
    """A reduced draft vocabulary in no particular order (an export must keep the order)."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]


def eagle_head(target, bias: bool, seed: int = 1):
    """An attached head (float32, no CPU kernels) with random float16-representable weights."""
    head = init_head(target, d2t_subset(), None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc.", "layers.")):
                p.copy_((torch.randn(p.shape, generator=g) * 0.2).half().float())
        if not bias:
            head.fc.bias.zero_()
    return head


def export(head, folder, layout):
    if layout == "reference":
        export_reference(head, folder)
    else:
        export_eagle(head, folder, layout, target_name="tiny-target")
    return folder


def inputs(seed: int = 0, B: int = 2, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, 64, generator=g).to(DEVICE)
    tokens = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    return hidden, tokens, torch.arange(T, device=DEVICE).expand(B, T)


def draft_logits(head, hidden, tokens, positions):
    with torch.no_grad():
        return head.logits(head.features(hidden, tokens, positions, None))


# ---- EAGLE ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", EAGLE_LAYOUTS)
def test_eagle_export_validates_and_round_trips(target, tmp_path, layout):
    bias = layout != "vllm"  # vLLM's EAGLE fc has no bias; the others carry a trained one
    head = eagle_head(target, bias)
    folder = export(head, tmp_path / layout, layout)
    result = validate(folder, "eagle", layout)
    assert result.ok, result.problems
    assert result.tensors_checked >= 9 and result.keys_checked >= 14
    assert detect(folder) == ("eagle", layout)

    back = import_eagle(folder)
    for name, value in head.state_dict().items():
        if name.startswith(("fc.", "layers.", "d2t")):
            assert torch.equal(back.state_dict()[name].cpu(), value.cpu()), name
    back.attach(target, kernels=False)
    hidden, tokens, positions = inputs()
    assert torch.equal(draft_logits(back, hidden, tokens, positions), draft_logits(head, hidden, tokens, positions))


def test_eagle_layouts_name_what_each_loader_reads(target, tmp_path):
    head = eagle_head(target, bias=True)
    head.fc.bias.data.zero_()
    names = {layout: set(load_file(str(export(head, tmp_path / layout, layout) / "model.safetensors")))
             for layout in ("vllm", "sglang", "speculators")}
    layer = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")} \
        | {"post_attention_layernorm.weight"}
    assert names["vllm"] == {"fc.weight"} | {f"layers.0.{n}" for n in layer}  # no bias, embeddings or LM head
    assert names["sglang"] == {"fc.weight", "fc.bias"} | {f"layers.0.{n}" for n in layer}  # SGLang's fc has a bias
    assert names["speculators"] == {"fusion_fc.weight"} | {f"transformer.{n}" for n in layer}
    vllm = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert vllm["model_type"] == "eagle" and vllm["model"]["architectures"] == ["LlamaForCausalLM"]
    assert vllm["model"]["num_hidden_layers"] == 1 and vllm["model"]["vocab_size"] == VOCAB
    sglang = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle"] and sglang["tie_word_embeddings"] is False
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle" and spec["fusion_bias"] is False
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    for layout in ("vllm", "sglang", "speculators"):  # the draft vocabulary, in order, as SGLang's token map
        assert torch.load(tmp_path / layout / D2T_FILE, weights_only=True) == head.d2t.cpu().tolist()


@pytest.mark.parametrize("layout", ["vllm", "sglang", "speculators"])
def test_exported_head_computes_the_same_in_transformers_llama_layer(target, tmp_path, layout):
    """An independent reading: transformers' LlamaDecoderLayer (no input norm) after fc, built from the
    exported config and weights, then the target's LM head rows at the token map (SGLang's read-out)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    head = eagle_head(target, bias=layout != "vllm", seed=3)
    folder = export(head, tmp_path, layout)
    config = json.loads((folder / "config.json").read_text())
    llama = {"vllm": config.get("model"), "sglang": config, "speculators": config.get("transformer_layer_config")}[layout]
    prefix, fc_name = ("transformer.", "fusion_fc") if layout == "speculators" else ("layers.0.", "fc")
    weights = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    hf_config = LlamaConfig(**llama)
    hf_config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf_config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)})
    D = hf_config.hidden_size
    fc = torch.nn.Linear(2 * D, D, bias=f"{fc_name}.bias" in weights)
    fc.load_state_dict({k.removeprefix(f"{fc_name}."): v for k, v in weights.items() if k.startswith(f"{fc_name}.")})
    hidden, tokens, positions = inputs(seed=2, T=7)
    hidden, tokens, positions = hidden.cpu(), tokens.cpu(), positions.cpu()
    T = tokens.shape[1]
    with torch.no_grad():
        x = fc(torch.cat([target.embed_tokens.weight.cpu()[tokens], hidden], -1))
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
        out = layer(x, attention_mask=causal, position_ids=positions,
                    position_embeddings=LlamaRotaryEmbedding(hf_config)(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        hot = read_d2t(folder / D2T_FILE)
        theirs = torch.nn.functional.linear(out, target.lm_head.weight.cpu()[hot])
        ours = draft_logits(head, hidden.to(DEVICE), tokens.to(DEVICE), positions.to(DEVICE)).cpu()
    assert (ours - theirs).abs().max() < 1e-3 * max(1.0, ours.abs().max().item())
    assert (out - x).abs().max() > 0.1  # the layer does something: the match is not vacuous


def test_vllm_refuses_a_head_with_fc_bias(target, tmp_path):
    with pytest.raises(UserError, match="nonzero fc.bias"):
        export_eagle(eagle_head(target, bias=True), tmp_path, "vllm")


def test_full_vocabulary_head_writes_no_token_map(target, tmp_path):
    head = init_head(target, torch.arange(VOCAB), None)
    export_eagle(head, tmp_path, "sglang")
    assert not (tmp_path / D2T_FILE).exists() and validate(tmp_path, "eagle", "sglang").ok
    assert torch.equal(import_eagle(tmp_path).d2t, torch.arange(VOCAB))


# ---- the validator catches what a loader would trip on --------------------------------------------


def corrupt_tensors(folder, change):
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    change(weights)
    save_file(weights, str(path))


def corrupt_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


CORRUPTIONS = {
    "missing tensor": ("vllm", lambda f: corrupt_tensors(f, lambda w: w.pop("layers.0.mlp.up_proj.weight")),
                       "missing layers.0.mlp.up_proj.weight"),
    "wrong shape": ("sglang", lambda f: corrupt_tensors(f, lambda w: w.update({"fc.bias": torch.zeros(3).half()})),
                    "fc.bias has shape [3], expected [64]"),
    "embeddings for vLLM": ("vllm", lambda f: corrupt_tensors(
        f, lambda w: w.update({"embed_tokens.weight": torch.zeros(VOCAB, 64).half()})), "no parameter for: embed_tokens.weight"),
    "bias for vLLM": ("vllm", lambda f: corrupt_tensors(f, lambda w: w.update({"fc.bias": torch.zeros(64).half()})),
                      "no parameter for: fc.bias"),
    "model type": ("vllm", lambda f: corrupt_config(f, lambda c: c.update(model_type="llama")),
                   "model_type is 'llama', expected 'eagle'"),
    "architecture": ("vllm", lambda f: corrupt_config(f, lambda c: c["model"].update(architectures=["MistralForCausalLM"])),
                     "model.architectures"),
    "shadowing key": ("vllm", lambda f: corrupt_config(f, lambda c: c.update(vocab_size=7)), "would overwrite model.*"),
    "int as bool": ("sglang", lambda f: corrupt_config(f, lambda c: c.update(tie_word_embeddings=0)),
                    "tie_word_embeddings is int 0, expected bool"),
    "two layers": ("sglang", lambda f: corrupt_config(f, lambda c: c.update(num_hidden_layers=2)),
                   "num_hidden_layers is 2, expected 1"),
    "stray safetensors": ("sglang", lambda f: save_file({"d2t": torch.arange(3)}, str(f / "draft_vocab.safetensors")),
                          "reads every *.safetensors"),
    "repeated ids": ("sglang", lambda f: torch.save([1, 1, 2], f / D2T_FILE), "repeated ids"),
    "ids out of range": ("vllm", lambda f: torch.save([0, VOCAB], f / D2T_FILE), "ids outside"),
    "no proposal": ("speculators", lambda f: corrupt_config(f, lambda c: c["speculators_config"].update(proposal_methods=[])),
                    "proposal_methods is empty"),
    "no verifier": ("speculators", lambda f: corrupt_config(f, lambda c: c["speculators_config"].pop("verifier")),
                    "missing speculators_config.verifier"),
    "bad tokens": ("speculators", lambda f: corrupt_config(
        f, lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0)), "speculative_tokens must be"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_validator_reports_what_the_loader_would_trip_on(target, tmp_path, case):
    layout, corrupt, message = CORRUPTIONS[case]
    folder = export(eagle_head(target, bias=False), tmp_path, layout)
    corrupt(folder)
    problems = validate(folder, "eagle", layout).problems
    assert any(message in p for p in problems), problems


def test_every_schema_cites_its_sources():
    for (kind, layout), schema in SCHEMAS.items():
        assert schema.sources and schema.runtime and schema.weights, (kind, layout)
    with pytest.raises(UserError, match="does not take medusa"):
        schema_for("medusa", "sglang")
    with pytest.raises(UserError, match="does not take eagle"):
        schema_for("eagle", "medusa")


# ---- Medusa --------------------------------------------------------------------------------------


def medusa_heads(target, draft_vocab: int | None = DRAFT_VOCAB, seed: int = 0) -> MedusaHeads:
    c = target.config
    heads = MedusaHeads(MedusaConfig(c.hidden_size, c.vocab_size, 3, draft_vocab or c.vocab_size))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if name.startswith("medusa_head."):
                p.copy_((torch.randn(p.shape, generator=g) * 0.3).half().float())
    if draft_vocab:
        heads.d2t = d2t_subset(seed).sort().values
    return heads


@pytest.mark.parametrize("layout", ["vllm", "medusa"])
def test_medusa_exports_validate_and_round_trip(target, tmp_path, layout):
    heads = medusa_heads(target, draft_vocab=None if layout == "medusa" else DRAFT_VOCAB)
    export_medusa(heads, target, tmp_path, layout)
    result = validate(tmp_path, "medusa", layout)
    assert result.ok, result.problems
    assert detect(tmp_path) == ("medusa", layout)
    back = load_medusa_heads(tmp_path).attach(target, kernels=False)
    heads.attach(target, kernels=False)
    x = torch.randn(5, target.config.hidden_size, device=DEVICE)
    assert torch.equal(back.d2t.cpu(), heads.d2t.cpu())
    torch.testing.assert_close(back(x), heads(x), atol=1e-5, rtol=1e-5)


def test_medusa_validator_wants_the_token_map(target, tmp_path):
    export_medusa(medusa_heads(target), target, tmp_path, "vllm")
    corrupt_tensors(tmp_path, lambda w: w.pop("token_map"))
    assert any("missing token_map" in p for p in validate(tmp_path, "medusa", "vllm").problems)


# ---- the command ---------------------------------------------------------------------------------


def run(*args: str) -> list[str]:
    return ["export", *args, "--threads", "1", "--device", DEVICE, "--dtype", "float32"]


def test_cli_exports_a_trained_eagle_head_and_checks_it(target, tmp_path, capsys):
    save_eagle_head(eagle_head(target, bias=False), tmp_path / "head", dtype=torch.float16)
    out = tmp_path / "out"
    assert main(run("eagle", "--drafter-path", str(tmp_path / "head"), "--layout", "vllm", "--out", str(out),
                    "--target-name", "org/tiny", "--json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["validation"]["valid"] and summary["layout"] == "vllm" and summary["d2t_file"] == D2T_FILE
    assert {f["name"] for f in summary["files"]} == {"config.json", "model.safetensors", D2T_FILE, MANIFEST}
    assert all(f["bytes"] > 0 for f in summary["files"])
    assert "vllm serve org/tiny" in summary["usage_not_run_here"][0]
    assert json.loads((out / MANIFEST).read_text())["kind"] == "eagle"
    assert main(run("--check", str(out))) == 0
    assert "valid" in capsys.readouterr().out
    (out / "model.safetensors").unlink()
    assert main(run("--check", str(out), "--json")) == 1
    assert json.loads(capsys.readouterr().out)["problems"] == [f"{out}: no model.safetensors"]


def test_cli_exports_the_shipped_eagle_head_without_loading_the_target(tmp_path, capsys, monkeypatch):
    from specdec.drafters.shipped import SHIPPED

    def no_target(*args, **kwargs):
        raise AssertionError("the sglang layout needs no target")

    monkeypatch.setattr("specdec.models.load_model", no_target)
    assert main(run("eagle", "--layout", "sglang", "--out", str(tmp_path))) == 0
    text = capsys.readouterr().out
    assert "valid" in text and "--speculative-token-map" in text and "HuggingFaceTB/SmolLM2-135M-Instruct" in text
    assert validate(tmp_path, "eagle", "sglang").ok
    shipped = json.loads((SHIPPED / "eagle" / "config.json").read_text())
    assert len(read_d2t(tmp_path / D2T_FILE)) == shipped["draft_vocab_size"]


@pytest.mark.parametrize("layout", ["vllm", "medusa"])
def test_cli_exports_medusa_heads_with_the_target(target, target_folder, tmp_path, capsys, layout):
    save_medusa_heads(medusa_heads(target), tmp_path / "heads")
    assert main(run("medusa", "--drafter-path", str(tmp_path / "heads"), "--layout", layout, "--out", str(tmp_path / "o"),
                    "--model", str(target_folder), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["validation"]["valid"]
    if layout == "medusa":  # the reference loads its base model by this name
        assert json.loads((tmp_path / "o" / "config.json").read_text())["base_model_name_or_path"] == str(target_folder)


def test_cli_exports_eagle_reference_with_embeddings(target, target_folder, tmp_path, capsys):
    save_eagle_head(eagle_head(target, bias=True), tmp_path / "head", dtype=torch.float16)
    assert main(run("eagle", "--drafter-path", str(tmp_path / "head"), "--layout", "reference", "--out", str(tmp_path / "o"),
                    "--model", str(target_folder), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["validation"]["valid"]
    weights = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"].float(), target.embed_tokens.weight.cpu())


def test_cli_exports_a_draft_model_as_a_plain_hf_folder(target, target_folder, tmp_path, capsys):
    """The exported folder is an ordinary Llama: loaded by transformers and by specdec it gives the shared
    draft's logits on the draft vocabulary (and reads out over all of it)."""
    from transformers import AutoModelForCausalLM

    from specdec.drafters.draft_model import load_shared_draft
    from specdec.train.draft import init_draft, save_draft

    d2t = d2t_subset(5).sort().values
    save_draft(init_draft(target, 1, None, d2t), tmp_path / "draft")
    out = tmp_path / "hf"
    assert main(run("draft_model", "--drafter-path", str(tmp_path / "draft"), "--layout", "hf", "--out", str(out),
                    "--model", str(target_folder), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["validation"]["valid"]
    config = json.loads((out / "config.json").read_text())
    assert not any(k.startswith("specdec_") for k in config) and "target_probe" not in config
    shared = load_shared_draft(tmp_path / "draft", target)
    plain = load_model(str(out), dtype="float32", device=DEVICE)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        ours = shared(tokens.to(DEVICE), positions.to(DEVICE), shared.new_cache(2, 5)).logits[..., d2t.to(DEVICE)].cpu()
        theirs = hf(tokens).logits[..., d2t]
        native = plain(tokens.to(DEVICE), positions.to(DEVICE), plain.new_cache(2, 5)).logits[..., d2t.to(DEVICE)].cpu()
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(native, ours, atol=1e-4, rtol=1e-4)
    assert read_d2t(out / D2T_FILE).tolist() == d2t.tolist()


@pytest.fixture
def folders(target, tmp_path):
    save_eagle_head(eagle_head(target, bias=True), tmp_path / "eagle", dtype=torch.float16)
    save_medusa_heads(medusa_heads(target), tmp_path / "medusa")
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    return tmp_path


@pytest.mark.parametrize("args,message", [
    (["wizard", "--layout", "vllm"], "unknown drafter 'wizard'"),
    (["eagle", "--layout", "onnx"], "unknown layout 'onnx'"),
    (["eagle"], "--layout is required"),
    ([], "name the drafter"),
    (["medusa", "--layout", "sglang"], "does not take medusa drafters"),
    (["draft_model", "--layout", "speculators"], "does not take draft_model drafters"),
    (["eagle", "--layout", "vllm", "--drafter-path", "{tmp}/medusa"], "holds a medusa drafter, not eagle"),
    (["eagle", "--layout", "vllm", "--drafter-path", "{tmp}/nowhere"], "no such folder"),
    (["eagle", "--layout", "vllm", "--drafter-path", "{tmp}/empty"], "no config.json"),
    (["draft_model", "--layout", "hf", "--drafter-path", "{tmp}/full"], "full model folder already"),
    (["eagle", "--layout", "vllm", "--drafter-path", "{tmp}/eagle"], "nonzero fc.bias"),
    (["eagle", "--layout", "vllm", "--model", "{tmp}/full"], "fits only the default model"),
    (["eagle", "--layout", "sglang", "--drafter-path", "{tmp}/eagle", "--out", "{tmp}/busy"], "is not empty"),
    (["eagle", "--layout", "sglang", "--drafter-path", "{tmp}/eagle", "--speculative-tokens", "0"], "--speculative-tokens"),
    (["--check", "{tmp}/nowhere"], "no such folder"),
    (["--check", "{tmp}/empty"], "no config.json"),
])
def test_bad_export_input_is_one_line(folders, capsys, args, message):
    argv = [a.replace("{tmp}", str(folders)) for a in args]
    if "--out" not in argv and "--check" not in argv:
        argv += ["--out", str(folders / "out")]
    assert main(run(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: ") and message in err and err.count("\n") == 1, err


def test_force_replaces_an_earlier_export(target, folders, capsys):
    common = ("eagle", "--layout", "sglang", "--drafter-path", str(folders / "eagle"), "--out", str(folders / "busy"))
    assert main(run(*common, "--force")) == 0
    assert (folders / "busy" / "notes.txt").exists() and validate(folders / "busy", "eagle", "sglang").ok

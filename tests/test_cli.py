"""The command line: a user mistake gets one clear line and exit status 2, never a traceback;
`generate --json --check-lossless` reports the documented fields."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE, build_hf, save_hf, tiny_pair
from specdec import cli
from specdec.cli import first_difference, main

# The default model on the test device, in float32 (on CUDA `--dtype auto` would pick bfloat16, whose
# kernels may round differently per block size; the lossless check below is the float32 guarantee).
ON_DEVICE = ("--device", DEVICE, "--dtype", "float32")
QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


BAD_INPUTS = [
    (["generate", ""], "prompt is empty"),
    (["generate", "   "], "prompt is empty"),
    (["generate", "hi", "--gamma", "0"], "gamma must be >= 1"),
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--drafter", "nope"], "unknown drafter 'nope'"),
    (["generate", "hi", "--model", "/no/such/model"], "model not found"),
    (["generate", "hi", "--drafter", "layer_skip", "--layers", "1", "--layer-skip-config", "x.json"], "not both"),
    (["generate", "hi", "--dtype", "int3"], "unknown dtype"),
    (["generate", "hi", "--temperature", "0.7", "--check-lossless"], "--check-lossless compares greedy"),
    (["generate", "hi", "--drafter", "ngram", "--suffix-options", "ahead=1"], "--suffix-options is an option of the suffix drafter"),
    (["generate", "hi", "--drafter", "eagle", "--tree-depth", "0"], "--tree-depth must be >= 1, got 0"),
    (["generate", "hi", "--drafter", "eagle", "--tree-frontier", "-2"], "--tree-frontier must be >= 1, got -2"),
    (["generate", "hi", "--drafter", "eagle", "--tree-branch", "0"], "--tree-branch must be >= 1, got 0"),
    (["generate", "hi", "--drafter", "eagle", "--tree-lookup", "-1"], "--tree-lookup must be >= 0, got -1"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_is_one_clear_line(capsys, args, message):
    """Each mistake is caught before any model is loaded (no model is cached in CI at this point)."""
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    assert err.startswith("specdec: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("text, message", [("foo=1", "KEY one of max_tokens"), ("tree_nodes", "KEY=VALUE"),
                                           ("max_spec_factor=x", "max_spec_factor must be a number")])
def test_bad_suffix_options_are_one_line(capsys, text, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--drafters", "suffix", "--suffix-options", text])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


def test_suffix_options_reach_the_drafter():
    args = cli.build_parser().parse_args(["bench", "--drafters", "ngram,suffix", "--suffix-options", "tree_nodes=8,max_spec_factor=2.5"])
    extra = cli.drafter_extra(args)
    assert extra["tree_nodes"] == 8 and extra["max_spec_factor"] == 2.5
    from specdec.drafters import DrafterOptions, build_drafter

    assert build_drafter("suffix", None, DrafterOptions(extra=extra)).config.tree_nodes == 8


def test_one_drafters_options_never_set_anothers():
    """DrafterOptions.extra is one namespace for every drafter of a run: the configs read from it (suffix's,
    EAGLE's tree, lookahead's) must not share a key, or one drafter's flag would set another's too (EAGLE's
    --tree-lookup and suffix's `lookup` did)."""
    from specdec.drafters import DrafterOptions, build_drafter
    from specdec.drafters.eagle import EagleTreeConfig, tree_config
    from specdec.drafters.lookahead import LookaheadConfig
    from specdec.drafters.suffix import SuffixConfig

    keys = [set(config.__dataclass_fields__) for config in (SuffixConfig, EagleTreeConfig, LookaheadConfig)]
    assert all(not a & b for i, a in enumerate(keys) for b in keys[i + 1 :]), keys
    args = cli.build_parser().parse_args(["bench", "--drafters", "eagle,suffix", "--tree-lookup", "0",
                                          "--suffix-options", "lookup_tokens=2"])
    extra = cli.drafter_extra(args)
    assert build_drafter("suffix", None, DrafterOptions(extra=extra)).config.lookup_tokens == 2
    cpu = torch.nn.Linear(1, 1)
    assert tree_config(cpu, DrafterOptions(extra=extra)).lookup == 0


def test_eagles_default_tree_is_the_devices_and_yields_to_the_flags():
    """A GPU: GPU_TOTAL_TOKENS nodes and a GPU_LOOKUP-token graft; the CPU, whatever the weights' format: a chain with
    a grafted lookup (CPU_TREE). The flags override either (--tree-lookup 0: no graft)."""
    from specdec.drafters import DrafterOptions
    from specdec.drafters.eagle import CPU_TREE, GPU_LOOKUP, GPU_TOTAL_TOKENS, EagleTreeConfig, tree_config

    cpu = torch.nn.Linear(1, 1)
    assert tree_config(cpu, DrafterOptions()) == EagleTreeConfig(frontier=1, branch=1, lookup=CPU_TREE["lookup"])
    assert CPU_TREE["lookup"] > 0
    given = cli.drafter_extra(cli.build_parser().parse_args(["bench", "--drafters", "eagle", "--tree-lookup", "0", "--tree-frontier", "4"]))
    assert tree_config(cpu, DrafterOptions(extra=given)) == EagleTreeConfig(frontier=4, branch=1, lookup=0)
    if torch.cuda.is_available():
        gpu = tree_config(torch.nn.Linear(1, 1, device="cuda"), DrafterOptions())
        assert gpu == EagleTreeConfig(total_tokens=GPU_TOTAL_TOKENS, lookup=GPU_LOOKUP)


def test_tree_shape_options_reach_the_eagle_tree():
    from specdec.drafters.eagle import EagleTreeConfig, tree_config
    from specdec.drafters import DrafterOptions

    args = cli.build_parser().parse_args(["bench", "--drafters", "eagle", "--tree-nodes", "64", "--tree-depth", "7",
                                          "--tree-frontier", "8", "--tree-branch", "3", "--tree-lookup", "4"])
    target = torch.nn.Linear(1, 1)  # tree_config reads only the device of the target's parameters
    assert tree_config(target, DrafterOptions(extra=cli.drafter_extra(args))) == EagleTreeConfig(depth=7, frontier=8, branch=3, total_tokens=64, lookup=4)
    from specdec.server.cli import drafter_argv

    serve = cli.build_parser().parse_args(["bench-serve", "--drafter", "eagle", "--tree-depth", "7", "--tree-frontier", "8",
                                           "--tree-branch", "3", "--tree-lookup", "4"])
    argv = drafter_argv(serve)  # what bench-serve starts `serve` with
    assert argv[argv.index("--tree-depth") :][:8] == ["--tree-depth", "7", "--tree-frontier", "8", "--tree-branch", "3", "--tree-lookup", "4"]


def broken_checkpoint(tmp_path, kind: str):
    """A tiny HF folder with one tensor dropped, or cut to the wrong width; or a GGUF file that is not one."""
    from safetensors.torch import load_file, save_file

    if kind == "not-gguf":
        path = tmp_path / "model.gguf"
        path.write_bytes(b"not a GGUF file at all" * 10)
        return path
    folder = save_hf(build_hf(), tmp_path / "broken")
    if kind.startswith("config"):
        config = json.loads((folder / "config.json").read_text())
        del config["num_attention_heads"]
        (folder / "config.json").write_text("{not json" if kind == "config-not-json" else json.dumps(config))
        return folder
    weights = next(folder.glob("*.safetensors"))
    state = load_file(str(weights))
    name = "model.layers.0.mlp.down_proj.weight"
    if kind == "missing":
        del state[name]
    elif kind == "misshapen":
        state[name] = state[name][:, :3].contiguous()
    else:  # "corrupt": a header that promises more bytes than the file has
        weights.write_bytes(weights.read_bytes()[:1000])
        return folder
    save_file(state, str(weights))
    return folder


@pytest.mark.parametrize("kind, message", [
    ("missing", "is missing from the checkpoint"),
    ("misshapen", "layers.0.mlp.down_proj.weight is [64, 3], the config implies [64, 128]"),
    ("corrupt", "is not a readable safetensors file"),
    ("not-gguf", "is not a readable GGUF model"),
    ("config-not-json", "config.json is not readable JSON (JSONDecodeError"),
    ("config-lacks-a-key", "broken/config.json lacks num_attention_heads"),
])
def test_a_broken_checkpoint_is_one_clear_line(capsys, tmp_path, kind, message):
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(broken_checkpoint(tmp_path, kind)), "--device", "cpu")
    assert code == 2 and message in err, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("specdec: error: ")


@pytest.mark.parametrize("error, where", [(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "GPU"),
                                          (MemoryError(), "host")])
def test_running_out_of_memory_is_one_clear_line(capsys, monkeypatch, error, where):
    def fail(args):
        raise error

    monkeypatch.setattr(cli, "run_generate", fail)
    code, _, err = run_cli(capsys, "generate", "hi")
    assert code == 3 and f"out of {where} memory" in err and err.count("\n") == 1


@pytest.mark.slow
def test_prompt_longer_than_context(capsys, default_model):
    code, _, err = run_cli(capsys, "generate", "word " * 9000, "--raw", *ON_DEVICE)
    assert code == 2 and "does not fit the model's context" in err


@pytest.mark.slow
def test_draft_model_with_another_vocabulary(capsys, default_model, tmp_path):
    _, hf = tiny_pair(tmp_path, "llama", seed=3)
    folder = tmp_path / "llama-3"
    code, _, err = run_cli(capsys, "generate", "hi", "--drafter", "draft_model", "--draft-model", str(folder), *ON_DEVICE)
    assert code == 2 and "vocabular" in err


def test_subprocess_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "hi", "--gamma", "-3"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "specdec: error: gamma must be >= 1, got -3"


@pytest.mark.slow
def test_generate_json_check_lossless(capsys, default_model):
    code, out, _ = run_cli(
        capsys, "generate", QUESTION, "--drafter", "ngram", "--check-lossless", "--json", "--max-new-tokens", "48", *ON_DEVICE
    )
    assert code == 0
    report = json.loads(out)
    assert report["device"].split(":")[0] == DEVICE.split(":")[0] and report["dtype"] == "float32"
    assert report["lossless"] is True and report["first_difference"] is None
    stats = report["stats"]
    for key in ("steps", "drafted", "accepted", "acceptance_rate", "acceptance_per_position", "mean_accepted_length", "tokens_per_s", "wall_s"):
        assert key in stats
    assert stats["accepted"] > 0
    assert len(report["token_ids"]) == stats["emitted"] and report["text"]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2

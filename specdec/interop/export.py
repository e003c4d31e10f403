"""`specdec export`: a trained drafter (shipped for the default model, or any `specdec train` folder) in
the layout another runtime loads, validated against that runtime's schema (specdec.interop.schema).

    drafter       layouts                                   needs the target?
    eagle         vllm, sglang, speculators                 no (embeddings and LM head stay the target's)
                  reference (SafeAILab/EAGLE)               yes (the head carries a copy of the embeddings)
    eagle3        vllm (= speculators), sglang              no (embeddings stay the target's; the LM head is its own)
    medusa        vllm, medusa (FasterDecoding/Medusa)      yes (the LM head rows are written with the heads)
    draft_model   hf (= vllm = sglang: one plain HF folder)  yes (the embeddings and LM head are the target's)

The shipped drafters fit only the default model (their target probe is checked when the target is
loaded); `--drafter-path` takes a folder `specdec train eagle|medusa|draft` wrote (what generate reads
with --eagle-head / --eagle3-head / --medusa-heads / --draft-model; no EAGLE-3 head is shipped). `--check DIR` validates an existing folder.
Besides the layout's files, the folder gets specdec_export.json (what was written, from what, and the
commands to use it; no runtime reads it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.errors import UserError
from specdec.models.checkpoint import read_config, read_weights
from specdec.interop.schema import (
    D2T_FILE,
    KINDS,
    LAYOUTS,
    MANIFEST,
    REFERENCE_D2T,
    Validation,
    detect,
    schema_for,
    validate,
)

# The hub model the embedded default GGUF (SmolLM2-135M-Instruct.Q4_1) was converted from: what a runtime
# serving the default model loads.
DEFAULT_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALIASES = {"draft": "draft_model"}
TRAIN_NAME = {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa", "draft_model": "draft"}  # specdec train <x>, data/drafters/<x>
OUR_FILES = ("config.json", "model.safetensors", D2T_FILE, REFERENCE_D2T, "medusa_lm_head.safetensors", MANIFEST)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}


def run_export(args: argparse.Namespace) -> int:
    if args.check is not None:
        return run_check(args)
    kind, layout = resolve_names(args.drafter, args.layout)
    schema_for(kind, layout)  # unknown combination: one line, before anything is loaded
    if args.speculative_tokens < 1:
        raise UserError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    source, shipped = source_folder(kind, args.drafter_path, args.model)
    out = Path(args.out or f"runs/export/{kind}-{layout}").expanduser()
    check_out(out, source, args.force)  # before the seconds a target takes to load
    target_name = args.target_name or (DEFAULT_VERIFIER if args.model == "default" else args.model)
    target = load_target(args, kind, source, shipped) if needs_target(kind, layout) else None
    clear_out(out)
    files = write(kind, layout, source, out, target, target_name, args.speculative_tokens)
    result = validate(out, kind, layout)
    summary = make_summary(kind, layout, source, out, files, result, target_name, args.speculative_tokens)
    (out / MANIFEST).write_text(json.dumps({k: v for k, v in summary.items() if k != "validation"}, indent=2) + "\n")
    summary["files"].append(file_entry(out / MANIFEST))
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0 if result.ok else 1


def resolve_names(drafter: str | None, layout: str | None) -> tuple[str, str]:
    if drafter is None:
        raise UserError(f"name the drafter to export: {', '.join(KINDS)} (or pass --check DIR)")
    kind = ALIASES.get(drafter, drafter)
    if kind not in KINDS:
        raise UserError(f"unknown drafter {drafter!r}; export takes {', '.join(KINDS)}")
    if layout is None:
        raise UserError(f"--layout is required: {', '.join(LAYOUTS[kind])} for {kind}")
    known = sorted({lay for lays in LAYOUTS.values() for lay in lays})
    if layout not in known:
        raise UserError(f"unknown layout {layout!r}; choose {', '.join(known)}")
    return kind, layout


def kind_of_folder(folder: Path) -> str | None:
    """What `specdec train` wrote into `folder` (eagle, eagle3, medusa, draft_model), None if none of them."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("specdec_drafter") in ("eagle", "eagle3", "medusa"):
        return config["specdec_drafter"]
    return "draft_model" if config.get("specdec_shared_embeddings") else None


def source_folder(kind: str, path: str | None, model: str) -> tuple[Path, bool]:
    """The drafter folder to export and whether it is the shipped one."""
    from specdec.drafters.shipped import SHIPPED

    if path is None:
        folder = SHIPPED / TRAIN_NAME[kind]
        if model != "default":
            raise UserError(f"the shipped {kind} drafter fits only the default model; for --model {model} pass "
                            f"--drafter-path (a folder written by `specdec train {TRAIN_NAME[kind]}`)")
        if not (folder / "config.json").is_file():
            raise UserError(f"no shipped {kind} drafter in {folder}; pass --drafter-path")
        return folder, True
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"--drafter-path {path}: no such folder")
    if not (folder / "config.json").is_file():
        raise UserError(f"--drafter-path {path}: no config.json (not a folder written by `specdec train`)")
    found = kind_of_folder(folder)
    if found is None:
        hint = (": it is a full model folder already, which vLLM and SGLang load as it is" if kind == "draft_model"
                else f" (`specdec train {TRAIN_NAME[kind]}` writes one)")
        raise UserError(f"--drafter-path {path} is not a {kind} drafter folder{hint}")
    if found != kind:
        raise UserError(f"--drafter-path {path} holds a {found} drafter, not {kind}: "
                        f"run `specdec export {found} --drafter-path {path} ...`")
    if not (folder / "model.safetensors").is_file():
        raise UserError(f"--drafter-path {path}: no model.safetensors")
    return folder, False


def check_out(out: Path, source: Path, force: bool) -> None:
    if out.resolve() == source.resolve():
        raise UserError(f"--out {out} is the drafter's own folder; pick another")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} is not empty (--force overwrites the files an export writes)")


def clear_out(out: Path) -> None:
    """Create `out`, or remove an earlier export's files from it (other files stay, and the validation
    reports any *.safetensors among them that a runtime would read)."""
    for name in OUR_FILES:
        (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def needs_target(kind: str, layout: str) -> bool:
    return kind not in ("eagle", "eagle3") or layout == "reference"


def load_target(args: argparse.Namespace, kind: str, source: Path, shipped: bool):
    from specdec.drafters.shipped import shipped_folder
    from specdec.models import load_model

    target = load_model(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf)
    config = read_config(source, "a trained drafter folder")
    want = (config.get("vocab_size"), config.get("hidden_size"))
    have = (target.config.vocab_size, target.config.hidden_size)
    if want != have:
        raise UserError(f"{source} was trained for another target (vocabulary, width {want}; {args.model} has {have})")
    if shipped and shipped_folder(TRAIN_NAME[kind], target) is None:
        raise UserError(f"the shipped {kind} drafter was trained for the default model, and {args.model} is not it")
    return target


def write(kind: str, layout: str, source: Path, out: Path, target, target_name: str, tokens: int) -> list[str]:
    if kind == "eagle":
        from specdec.models.eagle import load_eagle_head

        head = load_eagle_head(source)
        if layout == "reference":
            from specdec.train.eagle import export_reference

            export_reference(head.attach(target, kernels=False), out)
            return ["config.json", "model.safetensors", REFERENCE_D2T]
        from specdec.interop.eagle import export_eagle

        model_type = target.config.model_type if target is not None else "llama"
        archs = (HF_ARCHITECTURES.get(model_type, "LlamaForCausalLM"),)
        return export_eagle(head, out, layout, target_name, tokens, archs)
    if kind == "eagle3":
        from specdec.interop.eagle3 import export_eagle3
        from specdec.models.eagle3 import load_eagle3_head

        return export_eagle3(load_eagle3_head(source), out, layout, target_name, tokens)
    if kind == "medusa":
        from specdec.models.medusa import export_medusa, load_medusa_heads

        heads = load_medusa_heads(source)
        export_medusa(heads, target, out, layout)
        if layout == "medusa":  # the reference loads its base model from here: the runtime's name, not our cache path
            config = json.loads((out / "config.json").read_text())
            config["base_model_name_or_path"] = target_name
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            return ["config.json", "medusa_lm_head.safetensors"]
        return ["config.json", "model.safetensors"]
    return export_draft_hf(source, target, out)


def export_draft_hf(source: Path, target, out: Path) -> list[str]:
    """A shared-embedding draft (`specdec train draft`) as a plain Hugging Face Llama folder: its layers and
    norm, plus the target's embeddings (and LM head unless the target ties them), float16."""
    from specdec.interop.eagle import half
    from specdec.models.linear import float_weight

    config = read_config(source, "a draft model folder")
    state = read_weights(source / "model.safetensors")
    d2t = state.pop("d2t", None)
    tied = bool(target.config.tie_word_embeddings)
    hf = {k: v for k, v in config.items() if not k.startswith("specdec_") and k != "target_probe"}
    hf.update(architectures=["LlamaForCausalLM"], vocab_size=target.config.vocab_size, tie_word_embeddings=tied,
              torch_dtype="float16")
    weights = {name: half(w) for name, w in state.items()}
    weights["model.embed_tokens.weight"] = half(target.embed_tokens.weight)
    if not tied:
        weights["lm_head.weight"] = half(float_weight(target.lm_head))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    files = ["config.json", "model.safetensors"]
    if d2t is not None:
        torch.save(d2t.long().tolist(), out / D2T_FILE)
        files.append(D2T_FILE)
    return files


# ---- reporting -----------------------------------------------------------------------------------


def usage(kind: str, layout: str, out: Path, target: str, tokens: int, d2t: bool) -> list[str]:
    """How each runtime is pointed at the folder (from their documentation; not run here)."""
    spec = lambda method: json.dumps({**({"method": method} if method else {}), "model": str(out),  # noqa: E731
                                      "num_speculative_tokens": tokens})
    def sglang(algorithm: str, extra: str = "") -> str:
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
                f"--speculative-draft-model-path {out}{extra} --speculative-num-steps {tokens} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {tokens + 1}")

    if kind == "eagle":
        if layout == "vllm":
            return [f"vllm serve {target} --speculative-config '{spec('eagle')}'"]
        if layout == "sglang":
            return [sglang("EAGLE", f" --speculative-token-map {out / D2T_FILE}" if d2t else "")]
        if layout == "speculators":
            return [f"EagleSpeculator.from_pretrained('{out}', verifier='{target}') (speculators 0.3.0 .. 0.6.0.1)"]
        return [f"EaModel.from_pretrained(base_model_path='{target}', ea_model_path='{out}', use_eagle3=False) "
                "(SafeAILab/EAGLE)"]
    if kind == "eagle3":
        vllm = f"vllm serve {target} --speculative-config '{spec('eagle3')}'"
        if layout == "sglang":
            return [sglang("EAGLE3"), vllm + " (vLLM loads this layout too; for non-default taps use --layout vllm)"]
        return [vllm, f"Eagle3Speculator.from_pretrained('{out}', verifier='{target}') (speculators)"]
    if kind == "medusa":
        if layout == "vllm":
            return [f"vllm serve {target} --speculative-config '{spec('medusa')}'"]
        return [f"python -m medusa.inference.cli --model {out} (FasterDecoding/Medusa; base model from config.json)"]
    return [f"vllm serve {target} --speculative-config '{spec('draft_model')}' (vLLM versions whose engine takes "
            "a draft model)", sglang("STANDALONE")]


def file_entry(path: Path) -> dict:
    return {"name": path.name, "bytes": path.stat().st_size}


def make_summary(kind: str, layout: str, source: Path, out: Path, files: list[str], result: Validation,
                 target_name: str, tokens: int) -> dict:
    schema = result.schema
    d2t = (out / D2T_FILE).exists() or (out / REFERENCE_D2T).exists()
    return {
        "kind": kind, "layout": layout, "out": str(out), "source": str(source), "target": target_name,
        "files": [file_entry(out / name) for name in files],
        "d2t_file": next((n for n in (D2T_FILE, REFERENCE_D2T) if (out / n).exists()), None),
        "runtime": schema.runtime, "schema_sources": list(schema.sources), "notes": list(schema.notes),
        "usage_not_run_here": usage(kind, layout, out, target_name, tokens, d2t),
        "validation": result.to_dict(),
    }


def size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_summary(s: dict) -> str:
    v = s["validation"]
    width = max(len(f["name"]) for f in s["files"])
    lines = [f"exported {s['source']} ({s['kind']}) -> {s['out']} ({s['layout']} layout)"]
    lines += [f"  {f['name']:<{width}}  {size(f['bytes']):>9}" for f in s["files"]]
    lines.append(f"for: {s['runtime']}")
    lines += format_validation(v)
    lines += [f"note: {n}" for n in s["notes"]]
    lines += [f"use (not run here): {u}" for u in s["usage_not_run_here"]]
    return "\n".join(lines)


def format_validation(v: dict) -> list[str]:
    verdict = "valid" if v["valid"] else f"INVALID ({len(v['problems'])} problem{'s' if len(v['problems']) > 1 else ''})"
    lines = [f"schema ({v['kind']}/{v['layout']}, from {'; '.join(v['sources'])}): {verdict}: "
             f"{v['keys_checked']} config keys, {v['tensors_checked']} tensors checked"]
    return lines + [f"  problem: {p}" for p in v["problems"]]


def run_check(args: argparse.Namespace) -> int:
    folder = Path(args.check).expanduser()
    if not folder.is_dir():
        raise UserError(f"--check {args.check}: no such folder")
    kind = ALIASES.get(args.drafter, args.drafter) if args.drafter is not None else None
    if kind is not None and kind not in KINDS:
        raise UserError(f"unknown drafter {args.drafter!r}; export takes {', '.join(KINDS)}")
    layout = args.layout
    if kind is None or layout is None:
        found_kind, found_layout = detect(folder)
        kind, layout = kind or found_kind, layout or found_layout
    result = validate(folder, kind, layout)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print("\n".join([f"{folder}: {result.schema.runtime}"] + format_validation(result.to_dict())
                        + [f"note: {n}" for n in result.schema.notes]))
    return 0 if result.ok else 1

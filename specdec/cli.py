"""Command line: `specdec generate | bench | analyze | train | tune | demo`. Argument parsing lives here and nowhere else.

A user mistake prints one line (`specdec: error: ...`) and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdec.errors import UserError, first_line


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct), a folder, a .gguf file or a hub id")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kernels", default="auto", choices=("auto", "exact", "library"),
                   help="exact: block- and batch-invariant kernels (greedy speculation equals plain decoding bit for "
                        "bit); library: cuBLAS/MKL + SDPA; auto (default): exact where available")
    p.add_argument("--gguf", default="auto", choices=("auto", "native", "dequantize"),
                   help="a GGUF model (the default one included): native runs its Q4_0/Q4_1/Q8_0 tensors as they are "
                        "through specdec's CPU kernels (activations float32); dequantize turns them into --dtype floats; "
                        "auto (default): native on the CPU")


DRAFTER_HELP = ("none, ngram, draft_model, eagle, medusa (trained; shipped for the default model), "
                "eagle3 (trained: --eagle3-head), lookahead, layer_skip, quantized, suffix (training-free)")


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default="ngram", help=DRAFTER_HELP)
    add_drafter_options(p)


def add_drafter_options(p: argparse.ArgumentParser) -> None:
    """What each drafter reads; the trained ones default to the heads shipped for the default model."""
    p.add_argument("--draft-model", default=None, help="draft_model: a model (same forms as --model) or a `specdec train draft` folder")
    p.add_argument("--eagle-head", default=None, help="eagle: a head folder from `specdec train eagle`")
    p.add_argument("--eagle3-head", default=None, help="eagle3: a head folder from `specdec train eagle3`")
    p.add_argument("--medusa-heads", default=None, help="medusa: a heads folder from `specdec train medusa`")
    p.add_argument("--tree-nodes", type=int, default=None, help="eagle, eagle3: draft tree nodes verified per step (default 16 on a GPU; 10 on the CPU, "
                                                                       "whose default tree is a chain, see --tree-branch)")
    p.add_argument("--tree-depth", type=int, default=None,
                   help="eagle, eagle3: levels the draft tree grows (default 5; the step's gamma caps it, so give a gamma as large)")
    p.add_argument("--tree-frontier", type=int, default=None, help="eagle, eagle3: nodes expanded per level (default 4 on a GPU, 1 on the CPU)")
    p.add_argument("--tree-branch", type=int, default=None,
                   help="eagle, eagle3: children taken per expanded node (default 4 on a GPU; 1 on the CPU, where the "
                        "default tree is a chain: give 4 and --tree-frontier 4 for a tree)")
    p.add_argument("--tree-lookup", type=int, default=None,
                   help="eagle, eagle3: graft a prompt-lookup chain of this many tokens (at most the depth) onto the tree, "
                        "for text that copies its prompt or repeats itself (default 5 on a GPU, 3 on the CPU; "
                        "0: none)")
    p.add_argument("--ngram-max", type=int, default=3, help="ngram (and --tree-lookup): longest n-gram matched")
    p.add_argument("--ngram-min", type=int, default=1, help="ngram (and --tree-lookup): shortest n-gram matched")
    p.add_argument("--layers", type=csv(int), default=None, help="layer_skip: target layers the draft keeps, e.g. 0,1,2,29")
    p.add_argument("--layer-skip-config", default=None, help="layer_skip: the JSON written by `specdec tune layer-skip`")
    p.add_argument("--window", type=int, default=None, help="lookahead: Jacobi window W (default 4)")
    p.add_argument("--lookahead-ngram", type=int, default=None, help="lookahead: n-gram size N of the pool (default 4)")
    p.add_argument("--guesses", type=int, default=None, help="lookahead: pool continuations verified per step G (default 3)")
    p.add_argument("--suffix-options", type=suffix_options, default=None, metavar="KEY=VALUE,...",
                   help="suffix: any of " + ", ".join(suffix_option_names()) + " (e.g. tree_nodes=8,max_spec_factor=2; "
                        "ahead=0 reads the step in flight before drafting on a GPU); see specdec/drafters/suffix.py")
    p.add_argument("--quant-format", default=None, choices=("int8", "Q8_0", "Q4_1", "Q4_0", "Q4_1-A8", "Q4_0-A8"),
                   help="quantized: the draft's weight format (default int8 for a float target, Q4_0 for a Q8_0 one; "
                        "-A8: the 4-bit blocks times int8 activations, integer dot products)")


def suffix_option_names() -> tuple[str, ...]:
    from specdec.drafters.suffix import OPTION_NAMES

    return OPTION_NAMES


def suffix_options(text: str) -> dict[str, int | float]:
    """KEY=VALUE,... of the suffix drafter's options (drafters.suffix.parse_options)."""
    from specdec.drafters.suffix import parse_options

    try:
        return parse_options(text.split(","))
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def gamma_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from e


def add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gamma-policy", default="cost", help="with --gamma auto: heuristic, confidence or cost (default)")
    p.add_argument("--gamma-max", type=int, default=12, help="with --gamma auto: the most drafted per step")
    p.add_argument("--confidence-threshold", type=float, default=0.4, help="confidence policy: stop below this draft probability")


def spec_config(args: argparse.Namespace, sampling, **extra):
    """SpecConfig from --gamma (a number or 'auto') and the policy arguments."""
    from specdec.config import spec_config_for

    return spec_config_for(args.gamma, args.gamma_policy, gamma_max=args.gamma_max,
                           confidence_threshold=args.confidence_threshold, max_new_tokens=args.max_new_tokens,
                           sampling=sampling, **extra)


def add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: shard the target over N processes (one GPU "
                   "each on CUDA, gloo on the CPU), launched with torchrun for you (default 1)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same output)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding, measured and explained.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, speculatively")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt (read from stdin when omitted or '-')")
    add_model_args(g)
    add_drafter_args(g)
    g.add_argument("--gamma", type=gamma_arg, default="auto",
                   help="draft tokens proposed per step, or 'auto' (default: per row, by --gamma-policy, which drafts "
                        "less or not at all where drafting does not pay)")
    add_policy_args(g)
    add_sampling_args(g)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text and a table")
    g.add_argument("--check-lossless", action="store_true", help="also decode plainly and compare token ids (greedy only)")
    add_tp_arg(g)
    add_config_arg(g)

    b = sub.add_parser("bench", help="measure drafters x gammas against plain decoding and peers, side by side")
    add_bench_args(b)

    a = sub.add_parser("analyze", help="why drafts get rejected: rejection rates by token class, position, entropy")
    add_analyze_args(a)

    t = sub.add_parser("train", help="train a drafter on the target's own outputs: draft, eagle, eagle3 or medusa")
    kinds = t.add_subparsers(dest="kind", required=True)
    for kind, about in TRAINERS.items():
        add_train_args(kinds.add_parser(kind, help=about), kind)

    u = sub.add_parser("tune", help="tune a training-free drafter: `tune layer-skip` picks the layers the self-draft keeps")
    u.add_argument("what", choices=["layer-skip"], help="what to tune")
    add_model_args(u)
    u.add_argument("--task", default="gsm8k-train", help="calibration prompts (never tune on the eval set)")
    u.add_argument("--limit", type=int, default=4, help="calibration prompts")
    u.add_argument("--max-new-tokens", type=int, default=96, help="target continuation per calibration prompt")
    u.add_argument("--max-gamma", type=int, default=8, help="largest gamma the estimate considers")
    u.add_argument("--out", default="runs/tune/layer-skip.json", help="JSON for `--layer-skip-config`")

    v = sub.add_parser("advise", help="which drafter to use, if any: a measured matrix, decision tree, verdict and config")
    add_advise_args(v)

    d = sub.add_parser("demo", help="the main job: one GSM8K answer with its stats, then a short `advise` on the default model")
    add_model_args(d)
    d.add_argument("--limit", type=int, default=4, help="gsm8k-eval prompts advise measures")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--budget-s", type=float, default=120.0, help="advise's time budget in seconds")
    d.add_argument("--out", default="runs/demo", help="folder for advise's pages")

    x = sub.add_parser("export", help="write a trained drafter in the layouts vLLM, SGLang and speculators load, "
                                      "validated against their schemas")
    add_export_args(x)

    from specdec.server.cli import add_server_commands

    add_server_commands(sub)
    return parser


def csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from e

    return parse


def add_bench_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--task", default="gsm8k-eval", help="gsm8k-eval, gsm8k-train, mixed, heldout, general, or a .jsonl / .txt file")
    b.add_argument("--limit", type=int, default=20, help="first N prompts of the task set")
    add_model_args(b)
    b.add_argument("--drafters", type=csv(str), default=("ngram",),
                   help=f"comma-separated: {DRAFTER_HELP}; suffix:KEY=VALUE:... runs suffix with options of its own "
                        "beside the others (e.g. suffix,suffix:fill=0)")
    add_drafter_options(b)
    b.add_argument("--gammas", type=csv(int), default=(1, 2, 3, 4, 6, 8), help="comma-separated gammas")
    b.add_argument("--pld-gammas", type=csv(int), default=None, help="prompt-lookup sizes for the hf-pld peer (default: --gammas)")
    b.add_argument("--policies", type=csv(str), default=(), help="adaptive-gamma policies to add per drafter: heuristic, confidence, cost")
    b.add_argument("--gamma-max", type=int, default=None, help="the most an adaptive policy drafts (default: the largest of --gammas)")
    b.add_argument("--confidence-threshold", type=float, default=0.4, help="for the confidence policy")
    b.add_argument("--max-new-tokens", type=int, default=256)
    add_sampling_args(b)
    b.add_argument("--peers", type=csv(str), default=("hf", "hf-pld"), help="comma-separated: hf, hf-pld, hf-assisted, llamacpp, llamacpp-pld, llamacpp-draft, and "
                   "openai:URL[#MODEL] (any OpenAI-compatible server: vLLM, SGLang, llama-server, `specdec serve`; "
                   "OPENAI_API_KEY is sent when set) (empty for none)")
    b.add_argument("--draft-gguf", default=None, help="llamacpp-draft: the draft model as a GGUF file (benchmarks/draft_gguf.py writes one)")
    b.add_argument("--repeats", type=int, default=1, help="times each method runs each prompt (median taken)")
    add_tp_arg(b)
    b.add_argument("--raw", action="store_true", help="do not apply the chat template")
    b.add_argument("--out", default="runs/bench", help="folder for results.json, report.md and plots")
    b.add_argument("--json", action="store_true", help="print the results document instead of the table")


TRAINERS = {
    "draft": "distil a small draft model (shares the target's embeddings and LM head)",
    "eagle": "an EAGLE head: one decoder layer over the target's features",
    "eagle3": "an EAGLE-3 head: one decoder layer over the target's low, mid and high layers, with training-time test",
    "medusa": "Medusa heads: K residual blocks predicting tokens t+2..t+K+1",
}


def add_train_args(p: argparse.ArgumentParser, kind: str) -> None:
    add_model_args(p)
    p.add_argument("--data", default="text", choices=["text", "self"],
                   help="text: the prompts' answers, teacher-forced (gsm8k-train's solutions); self: the target's own "
                        "greedy continuations of the prompts, generated in batches (train on your own traffic)")
    p.add_argument("--prompts", default=None, metavar="FILE[:WEIGHT],...",
                   help="prompt files in any format `bench --task` reads (.jsonl with question or turns, and answer "
                        "for --data text; .txt one prompt per line; or a built-in set), comma-separated, each "
                        "optionally weighted: its share of the collected tokens (e.g. chat.jsonl:2,qa.txt:1, or "
                        "gsm8k-train,general for the built-in general mix); default gsm8k-train")
    p.add_argument("--features", default=None, help="a features file from an earlier run (skips collecting)")
    p.add_argument("--limit", type=int, default=None, help="prompts read from each file (default: as many as --max-tokens needs)")
    p.add_argument("--max-tokens", type=int, default=200_000, help="training tokens to collect (prompt + response)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="--data self: the longest continuation generated per prompt")
    p.add_argument("--steps", type=int, default=2000, help="optimiser steps")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimiser step")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the trainer's)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft read-out vocabulary (most frequent target tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--out", default=f"runs/train-{kind}", help="folder for the trained drafter and its checkpoint")
    if kind in ("eagle", "eagle3"):
        p.add_argument("--intermediate-size", type=int, default=None, help="MLP width of the head (default: the target's)")
    if kind == "eagle3":
        p.add_argument("--ttt-steps", type=int, default=7, help="training-time test: steps the head runs on its own outputs")
        p.add_argument("--feature-layers", type=csv(int), default=None,
                       help="target layers whose inputs the head reads (default: 2, L/2, L-3, as the reference)")
        p.add_argument("--compare-eagle", default=None,
                       help="an EAGLE head folder (`specdec train eagle`) measured on the same held-out examples")
    if kind == "medusa":
        p.add_argument("--heads", type=int, default=4, help="Medusa heads (tokens predicted beyond the next)")
    if kind == "draft":
        p.add_argument("--layers", type=int, default=2, help="decoder layers of the draft model")
        p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")


def add_advise_args(v: argparse.ArgumentParser) -> None:
    v.add_argument("--task", default="gsm8k-eval", help="your prompts (.jsonl / .txt) or a built-in set: gsm8k-eval, mixed, heldout")
    v.add_argument("--limit", type=int, default=10, help="the most prompts measured (the budget may stop sooner)")
    add_model_args(v)
    v.add_argument("--drafters", type=csv(str), default=None, help="drafters to compare (default: every one that runs for this target)")
    v.add_argument("--peers", type=csv(str), default=(), help="peers measured alongside, on your budget: hf, llamacpp (default none)")
    v.add_argument("--concurrency", type=csv(int), default=(1, 8, 32), help="concurrent requests to advise for (batch sizes measured)")
    v.add_argument("--budget-s", type=float, default=None, help="seconds to spend measuring (default 300 on a CPU, 60 on a GPU)")
    v.add_argument("--threshold-ms", type=float, default=100.0, help="decode time per answer below which speculation is not worth it")
    v.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(v)
    v.add_argument("--raw", action="store_true", help="do not apply the chat template")
    v.add_argument("--out", default="runs/advise", help="folder for summary.md, decision-tree.md/png, verdict.md, config.json")
    v.add_argument("--json", action="store_true", help="print the measurements and config as JSON instead of the tables")


CONFIG_KEYS = ("drafter", "gamma", "spec_policy", "spec_threshold", "tree_nodes", "tree_depth", "tree_frontier", "tree_branch", "tree_lookup", "ngram_max",
               "ngram_min", "window", "lookahead_ngram", "guesses", "gamma_policy", "gamma_max", "confidence_threshold",
               "draft_model", "eagle_head", "eagle3_head", "medusa_heads", "layers")


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="a JSON of flags, e.g. the config.json `specdec advise` writes; flags on the command line win")


def apply_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> argparse.Namespace:
    """Parse again with --config's settings as the command's defaults, so explicit flags still win.
    Keys the command does not take (serve's spec_policy for generate) are left to the commands that do."""
    path = getattr(args, "config", None)
    if path is None:
        return args
    try:
        settings = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise UserError(f"--config {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--config {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(settings, dict):
        raise UserError(f"--config {path}: expected a JSON object of flags")
    unknown = sorted(set(settings) - set(CONFIG_KEYS) - {"schema", "advised"})
    if unknown:
        raise UserError(f"--config {path}: unknown key(s) {unknown}; known: {', '.join(CONFIG_KEYS)}")
    command = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
    sub = command.choices[args.command]
    dests = {a.dest for a in sub._actions}
    sub.set_defaults(**{k: v for k, v in settings.items() if k in dests})
    return parser.parse_args(argv)


def add_analyze_args(a: argparse.ArgumentParser) -> None:
    a.add_argument("--task", default="gsm8k-eval", help="gsm8k-eval, gsm8k-train, mixed, heldout, general, or a .jsonl / .txt file")
    a.add_argument("--limit", type=int, default=20, help="first N prompts of the task set")
    add_model_args(a)
    add_drafter_args(a)
    a.add_argument("--gamma", type=gamma_arg, default=4, help="draft tokens proposed per step, or 'auto' (see --gamma-policy)")
    add_policy_args(a)
    add_sampling_args(a)
    a.add_argument("--max-new-tokens", type=int, default=256)
    a.add_argument("--raw", action="store_true", help="do not apply the chat template")
    a.add_argument("--out", default="runs/analyze", help="folder for analysis.json, analysis.md, records.jsonl and plots")
    a.add_argument("--json", action="store_true", help="print the analysis JSON instead of the summary")


def add_export_args(x: argparse.ArgumentParser) -> None:
    x.add_argument("drafter", nargs="?", default=None, help="eagle, eagle3, medusa or draft_model (the shipped one for the "
                   "default model unless --drafter-path; eagle3 has none shipped)")
    x.add_argument("--layout", default=None, help="eagle: vllm, sglang, speculators, reference; eagle3: vllm (= speculators: "
                   "speculators_model_type eagle3), sglang (SafeAILab EAGLE-3 names, LlamaForCausalLMEagle3); medusa: vllm, "
                   "medusa; draft_model: hf (vllm, sglang: the same plain HF folder)")
    x.add_argument("--out", default=None, help="folder to write (default runs/export/<drafter>-<layout>)")
    x.add_argument("--drafter-path", default=None, help="a folder written by `specdec train eagle|eagle3|medusa|draft`")
    x.add_argument("--target-name", default=None, help="the target as the runtime names it (hub id or path) for the "
                   "config and the printed commands (default: --model; the default model's hub id)")
    x.add_argument("--speculative-tokens", type=int, default=3, help="draft tokens per step written into speculators' "
                   "config and the printed commands")
    x.add_argument("--check", default=None, metavar="DIR", help="validate DIR against its layout's schema (detected, or "
                   "--layout) and exit: 0 valid, 1 not")
    x.add_argument("--force", action="store_true", help="write into a non-empty --out (replacing an export's files)")
    x.add_argument("--json", action="store_true", help="print one JSON summary")
    add_model_args(x)


def run_export_cmd(args: argparse.Namespace) -> int:
    from specdec.interop.export import run_export

    return run_export(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = apply_config(parser, args, argv)
        tp = getattr(args, "tp", 1)
        if tp < 1:
            raise UserError(f"--tp must be >= 1, got {tp}")
        if tp > 1 and args.command in RANKED and "WORLD_SIZE" not in os.environ:
            return launch_ranks(tp, sys.argv[1:] if argv is None else argv, args)
        if tp > 1 and args.command in RANKED:
            return run_rank(args)
        set_threads(args.threads)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "bench":
            return run_bench_cmd(args)
        if args.command == "train":
            import importlib

            return importlib.import_module(f"specdec.train.{args.kind}").run(args)
        if args.command == "analyze":
            from specdec.analysis.analyze import run_analyze

            return run_analyze(args)
        if args.command == "tune":
            from specdec.tune import run_tune

            return run_tune(args)
        if args.command == "advise":
            from specdec.advise import run_advise

            return run_advise(args)
        if args.command == "demo":
            return run_demo(args)
        if args.command == "export":
            return run_export_cmd(args)
        if args.command in ("serve", "bench-serve"):
            from specdec.server.cli import run_bench_serve, run_serve

            return run_serve(args) if args.command == "serve" else run_bench_serve(args)
    except UserError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        import torch

        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)):
            raise
        where = "host" if isinstance(e, MemoryError) else "GPU"
        print(f"specdec: error: out of {where} memory ({first_line(e) or type(e).__name__}); try a smaller model, "
              "batch, --max-new-tokens or dtype", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    return 0


RANKED = ("generate", "bench", "serve")  # commands that run as one process per tensor-parallel rank


class Stopped(Exception):
    """The launcher was told to stop (SIGTERM)."""


def raise_stopped(signum, frame) -> None:
    raise Stopped


def launch_ranks(tp: int, argv: list[str], args: argparse.Namespace) -> int:
    """Run this same command in `tp` processes, one per rank, with the environment torchrun would give them
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 speaks, another rank's error is shown
    by its last line. The first rank to fail stops the others; stopping the launcher stops them all."""
    import signal
    import socket
    import subprocess
    import tempfile

    if args.command == "generate" and args.prompt in (None, "-"):
        raise UserError("with --tp give the prompt as an argument (stdin reaches only one process)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    logs = [None] + [tempfile.TemporaryFile("w+") for _ in range(1, tp)]
    ranks = [subprocess.Popen([sys.executable, "-m", "specdec.cli", *argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=None if r == 0 else subprocess.DEVNULL, stderr=logs[r]) for r in range(tp)]
    signal.signal(signal.SIGTERM, raise_stopped)
    ended: list[int | None] = [None] * tp
    try:
        wait_ranks(ranks)
    except Stopped:
        pass
    finally:
        ended = [p.poll() for p in ranks]  # before stop_ranks ends the others
        stop_ranks(ranks)
    said = ranks[0].returncode == 2  # rank 0 met a user error (exit 2) and said it; every rank meets those
    for r in range(1, tp):
        if ended[r] not in (None, 0) and not said:
            logs[r].seek(0)
            lines = [line for line in logs[r].read().splitlines() if line.strip()]
            print(f"specdec: error: rank {r} of {tp} failed: {lines[-1] if lines else f'exit code {ended[r]}'}",
                  file=sys.stderr)
    failed = next((r for r, code in enumerate(ended) if code not in (None, 0)), 0)
    return exit_code(ranks[failed])


def exit_code(process) -> int:
    """A process's exit status as a shell reports it (128 + N for a signal N)."""
    return 128 - process.returncode if process.returncode < 0 else process.returncode


RANK0_GRACE_S = 3  # how long rank 0 may take to end after another rank failed
USER_ERROR_GRACE_S = 30  # ... after another rank met a user error (exit 2), which rank 0 meets too, maybe later (load)


def wait_ranks(ranks: list) -> None:
    """Wait until every rank succeeded or one failed (then a while longer for rank 0, which usually meets
    the same error and says it itself)."""
    import subprocess
    import time

    while True:
        codes = [p.poll() for p in ranks]
        if all(c == 0 for c in codes):
            return
        if any(c not in (None, 0) for c in codes):
            try:
                ranks[0].wait(timeout=USER_ERROR_GRACE_S if 2 in codes else RANK0_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            return
        time.sleep(0.05)


def stop_ranks(ranks: list) -> None:
    """Stop the ranks still running, rank 0 first: a server drains and releases its followers, which then end."""
    import subprocess

    for group in (ranks[:1], ranks[1:]):
        for p in group:
            if p.poll() is None:
                p.terminate()
        for p in group:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_rank(args: argparse.Namespace) -> int:
    """One rank of a tensor-parallel `generate`, `bench` or `serve` (launched by launch_ranks or torchrun)."""
    from specdec.models.tensor_parallel import finish_ranks, join_group

    shard = join_group(args.tp, args.device)
    if shard.rank > 0:  # every rank computes the same tokens: rank 0 speaks for them (errors still go to stderr)
        sys.stdout = open(os.devnull, "w")
    set_threads(args.threads)
    if args.command == "serve":
        from specdec.server.cli import run_serve

        code = run_serve(args)
    else:
        code = run_generate(args) if args.command == "generate" else run_bench_cmd(args)
    finish_ranks(shard, code, wait=args.command != "serve")  # a server's ranks end when rank 0 releases them
    return code  # a single rank


def set_threads(threads: int | None) -> None:
    import torch

    if threads is not None and threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads or os.cpu_count() or 1)


def check_drafter_args(args: argparse.Namespace) -> None:
    """Fail on drafter and dtype mistakes before spending seconds loading a model."""
    from specdec.drafters import DRAFTERS
    from specdec.models.loading import DTYPES

    if args.drafter not in DRAFTERS:
        raise UserError(f"unknown drafter {args.drafter!r}; choose one of: {', '.join(sorted(DRAFTERS))}")
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise UserError(f"unknown dtype {args.dtype!r}; choose auto, {', '.join(DTYPES)}")


def drafter_extra(args: argparse.Namespace) -> dict:
    """DrafterOptions.extra from the drafter options given (paths of trained heads, layer_skip, lookahead)."""
    layers = args.layers
    if args.layer_skip_config is not None:
        if layers is not None:
            raise UserError("give --layers or --layer-skip-config, not both")
        layers = read_layer_skip_config(args.layer_skip_config)
    extra = {"eagle_path": args.eagle_head, "eagle3_path": args.eagle3_head, "medusa_path": args.medusa_heads, "layers": layers,
             "window": args.window, "ngram": args.lookahead_ngram, "guesses": args.guesses,
             "total_tokens": args.tree_nodes, "depth": args.tree_depth, "frontier": args.tree_frontier, "branch": args.tree_branch,
             "lookup": args.tree_lookup, "quant_format": args.quant_format}
    flags = {"window": "--window", "ngram": "--lookahead-ngram", "guesses": "--guesses", "total_tokens": "--tree-nodes",
             "depth": "--tree-depth", "frontier": "--tree-frontier", "branch": "--tree-branch"}
    for name, flag in flags.items():
        if extra[name] is not None and extra[name] < 1:
            raise UserError(f"{flag} must be >= 1, got {extra[name]}")
    if extra["lookup"] is not None and extra["lookup"] < 0:
        raise UserError(f"--tree-lookup must be >= 0, got {extra['lookup']}")
    drafters = args.drafters if "drafters" in vars(args) else [args.drafter]  # bench takes several; advise None: all
    drafters = drafters and [d.partition(":")[0] for d in drafters]  # bench's variants: suffix:KEY=VALUE
    for flag, owner, given in (("--quant-format", "quantized", args.quant_format), ("--suffix-options", "suffix", args.suffix_options)):
        if given is not None and drafters is not None and owner not in drafters:
            raise UserError(f"{flag} is an option of the {owner} drafter, not of {', '.join(drafters) or 'no drafter'}")
    return {k: v for k, v in extra.items() if v is not None} | (args.suffix_options or {})


def read_layer_skip_config(path: str) -> list[int]:
    try:
        layers = json.loads(open(path).read())["layers"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--layer-skip-config {path}: not a `specdec tune layer-skip` file ({type(e).__name__})") from None
    return [int(i) for i in layers]


def read_prompt(prompt: str | None) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            raise UserError("no prompt given (pass it as an argument or on stdin)")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UserError("the prompt is empty")
    return prompt


def run_generate(args: argparse.Namespace) -> int:
    from specdec.api import encode_prompt
    from specdec.config import SamplingParams
    from specdec.drafters import DrafterOptions
    from specdec.engine import SpecEngine
    from specdec.models import load_model
    from specdec.models.kernels import draft_kernel_path, kernel_path

    prompt = read_prompt(args.prompt)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)
    config = spec_config(args, sampling, stop=tuple(args.stop))
    if args.check_lossless and not sampling.greedy:
        raise UserError("--check-lossless compares greedy outputs: use --temperature 0")
    check_drafter_args(args)
    extra = drafter_extra(args)
    from specdec.models.tensor_parallel import join_group

    shard = join_group(getattr(args, "tp", 1), args.device)
    target = load_model(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf, shard=shard)
    if target.tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer files: the CLI needs one to encode the prompt")
    options = DrafterOptions(draft_model=args.draft_model, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                             extra=extra)
    engine = SpecEngine(target, args.drafter, options)
    ids = encode_prompt(target.tokenizer, prompt, chat=not args.raw)
    row = engine.generate([ids], config).rows[0]

    report = {
        "model": args.model,
        "drafter": args.drafter,
        "gamma": args.gamma,
        "device": str(engine.device),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "kernels": kernel_path(target).to_dict(),
        "draft_kernels": draft.to_dict() if (draft := draft_kernel_path(engine.drafter)) else None,
        "tp": shard.world,
        "text": row.text,
        "token_ids": row.token_ids,
        "finish_reason": row.finish_reason,
        "stats": row.stats.to_dict(),
    }
    if args.check_lossless:
        plain = SpecEngine(target, "none").generate([ids], config).rows[0]
        report["lossless"] = plain.token_ids == row.token_ids
        report["first_difference"] = first_difference(plain.token_ids, row.token_ids)
        report["plain_tokens_per_s"] = plain.stats.tokens_per_s
    if args.json:
        print(json.dumps(report))
    else:
        print(row.text)
        print()
        print(format_stats(report))
    return 0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def format_stats(report: dict) -> str:
    s = report["stats"]
    per_pos = " ".join("-" if a is None else f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"
    rows = [
        ("drafter / gamma", f"{report['drafter']} / {report['gamma']}"),
        ("device / dtype", f"{report['device']} / {report['dtype']}"),
        ("kernels", f"{report['kernels']['name']} ({'' if report['kernels']['exact'] else 'not '}block/batch-invariant)"
                    + (f", tensor-parallel over {report['tp']} ranks" if report.get("tp", 1) > 1 else "")),
        ("weights", report["kernels"]["weights"]),
        ("tokens emitted", s["emitted"]),
        ("target steps", s["steps"]),
        ("drafted / accepted", f"{s['drafted']} / {s['accepted']}"),
        ("acceptance rate", fmt(s["acceptance_rate"])),
        ("acceptance per position", per_pos),
        ("mean accepted length (tau)", fmt(s["mean_accepted_length"])),
        ("tokens/s", fmt(s["tokens_per_s"], 1)),
        ("wall s", fmt(s["wall_s"], 2)),
    ]
    if "lossless" in report:
        rows.append(("plain decoding tokens/s", fmt(report["plain_tokens_per_s"], 1)))
        rows.append(("lossless (== plain greedy)", f"{report['lossless']} (first difference: {report['first_difference']})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def run_bench_cmd(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.bench.report import format_table, write_outputs
    from specdec.bench.runner import BenchConfig, run_bench
    from specdec.config import SamplingParams

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    config = BenchConfig(
        task=args.task, limit=args.limit, model=args.model, drafters=args.drafters, gammas=args.gammas,
        peers=args.peers, pld_gammas=args.pld_gammas, draft_gguf=args.draft_gguf, max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed),
        repeats=args.repeats, draft_model=args.draft_model, drafter_extra=drafter_extra(args),
        dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf, chat=not args.raw, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        policies=args.policies, gamma_max=args.gamma_max or max(args.gammas, default=0), confidence_threshold=args.confidence_threshold,
        tp=args.tp,
    )
    speaks = os.environ.get("RANK", "0") == "0"  # under --tp every rank runs the bench; rank 0 speaks for them
    results = run_bench(config, progress=not args.json and speaks)
    if not speaks:  # two ranks writing one results.json raced: a shorter write left the longer one's tail
        return 0
    files = write_outputs(results, Path(args.out))
    if args.json:
        print(json.dumps(results))
    else:
        print(format_table(results))
        print(f"\nwrote {', '.join(str(f) for f in files[:2])} and {len(files) - 2} plots")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """The README's main job: one GSM8K answer with its stats, then a short `advise` on a few held-out
    GSM8K prompts: the matrix, the verdict and the best drafter on this machine."""
    from specdec.bench.tasks import load_tasks
    from specdec.drafters.shipped import SHIPPED

    task = load_tasks("gsm8k-eval", limit=1)[0]
    drafter = "eagle" if args.model == "default" and (SHIPPED / "eagle").is_dir() else "ngram"
    print(f"GSM8K question: {task.prompt}\n", flush=True)
    code = main(["generate", task.prompt, "--model", args.model, "--dtype", args.dtype, "--device", args.device,
                 "--kernels", args.kernels, "--gguf", args.gguf, "--drafter", drafter, "--gamma", "3",
                 "--max-new-tokens", str(args.max_new_tokens), "--check-lossless"])
    if code:
        return code
    print(f"\nWhich drafter, if any? `specdec advise` on {args.limit} held-out GSM8K prompts, "
          f"{args.budget_s:.0f} s budget\n", flush=True)
    return main(["advise", "--task", "gsm8k-eval", "--limit", str(args.limit), "--model", args.model, "--dtype", args.dtype,
                 "--kernels", args.kernels, "--gguf", args.gguf, "--device", args.device, "--concurrency", "1,8",
                 "--budget-s", str(args.budget_s), "--max-new-tokens", str(args.max_new_tokens), "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())

"""Arguments and entry points of `specdec serve` and `specdec bench-serve` (wired into specdec/cli.py)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator

from specdec.errors import UserError

SERVE_EXTRA = "pip install 'specdec[serve]'"
# default --prefill-chunk: vLLM's API server reads 8192 tokens per step on GPUs of 70 GiB or more, 2048 on smaller ones
PREFILL_CHUNK = {"large-gpu": 8192, "cuda": 2048, "cpu": 512}
LARGE_GPU_BYTES = 70 << 30
DEFAULT_GAMMA = 4  # --gamma when not given, but for a tree drafter on a GPU (default_gamma)
SWITCH_INTERVAL_S = 0.0005  # the GIL hand-over interval while serving (CPython default 0.005; see run_serve)


def default_gamma(name: str, drafter, device) -> int:
    """--gamma when not given. On a GPU an EAGLE tree drafts its whole depth: a level more costs the verify
    forward little there (H200, bf16, default pair, gsm8k-eval 10 x 128, trees of 16-48 nodes: depth 5
    2.04-2.08x plain, depth 4 1.98-2.00x, one run). On a CPU its chain pays best shallow (eagle.py)."""
    if name in ("eagle", "eagle3") and device.type == "cuda":
        return drafter.tree.depth
    return DEFAULT_GAMMA


def default_prefill_chunk(device) -> int:
    """Prompt tokens read between two decode steps: a large GPU reads a burst of prompts in one forward (the
    time a step waits for it is a few milliseconds), a smaller GPU or a CPU in several."""
    if device.type != "cuda":
        return PREFILL_CHUNK["cpu"]
    import torch

    large = torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES
    return PREFILL_CHUNK["large-gpu" if large else "cuda"]


def token_range(text: str) -> tuple[int, int]:
    """--max-tokens: N, or LOW-HIGH with 1 <= LOW <= HIGH; (low, high)."""
    try:
        low, _, high = text.partition("-")
        bounds = (int(low), int(high or low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise UserError(f"--max-tokens: expected N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def add_server_commands(sub) -> None:
    from specdec.cli import add_config_arg, add_model_args, add_tp_arg, csv

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching and load-aware speculation")
    add_model_args(s)
    add_speculation_args(s)
    add_config_arg(s)
    s.add_argument("--spec-policy", default="cost", help="off, on, batch-threshold or cost (default)")
    s.add_argument("--max-batch", type=int, default=32, help="most requests decoded together")
    s.add_argument("--max-queue", type=int, default=256, help="most requests waiting for the batch; beyond: HTTP 429")
    s.add_argument("--context", type=int, default=None, help="tokens per request, prompt + max_tokens (default: the model's, at most 2048)")
    s.add_argument("--prefill-chunk", type=int, default=None,
                   help="most prompt tokens read between two decode steps (new requests do not stall running ones); "
                        f"default {PREFILL_CHUNK['large-gpu']} on a GPU of 70 GiB or more (a burst of requests is "
                        f"read at once), {PREFILL_CHUNK['cuda']} on a smaller one, {PREFILL_CHUNK['cpu']} on a CPU")
    s.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a request that gives none")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECDEC_API_KEY; none: open)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get HTTP 413")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on shutdown")
    s.add_argument("--frontend", default="auto", choices=("auto", "process", "thread"),
                   help="where HTTP is served: a process of its own (the default on CUDA: it leaves the decode loop the "
                        "GIL) or a thread of the engine's process (the default on the CPU)")
    s.add_argument("--frontends", type=int, default=1,
                   help="HTTP frontend processes sharing the port (the process frontend); more than one pays only "
                        "where one nears a whole core, which bench-serve reports per level (default 1)")
    s.add_argument("--enable-admin", action="store_true", help="POST /admin/spec-policy switches the policy (measures costs at start)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="log level of uvicorn and of specdec's server notes (graph captures, errors)")
    add_tp_arg(s)

    b = sub.add_parser("bench-serve", help="load-test the server: throughput and latency per policy and concurrency")
    add_model_args(b)
    add_speculation_args(b)
    b.add_argument("--url", default=None, help="bench a running server (started with --enable-admin) instead of starting one")
    b.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"), help="for --url (default: $SPECDEC_API_KEY)")
    b.add_argument("--task", default="gsm8k-eval", help="short, gsm8k-eval, gsm8k-train, mixed, or a .jsonl / .txt file")
    b.add_argument("--limit", type=int, default=100, help="first N prompts of the task set")
    b.add_argument("--concurrency", type=csv(int), default=(1, 2, 4, 8, 16, 32, 64), help="comma-separated client counts")
    b.add_argument("--policies", type=csv(str), default=("off", "on", "batch-threshold", "cost"), help="comma-separated policies")
    b.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: max(32, REQUESTS_PER_CLIENT x concurrency))")
    b.add_argument("--requests-per-client", type=int, default=8,
                   help="requests per client of a level when --requests is not given (default 8: a level of 16 clients "
                        "on an H200 then lasts about a second; more gives steadier figures)")
    b.add_argument("--max-tokens", default="128",
                   help="max_tokens of every request, or LOW-HIGH: spread evenly over that range (the same lengths for "
                        "every policy), so closed-loop clients do not stay in lockstep")
    b.add_argument("--temperature", type=float, default=None, help="of every request (default 0: greedy)")
    b.add_argument("--sampling-mix", action="store_true",
                   help="requests take fixed sampling sets in turn (greedy, top_p, top_k, seeded) instead of --temperature")
    b.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="this fraction of each level's requests (evenly spread) close their stream after a few chunks")
    b.add_argument("--max-batch", type=int, default=None, help="server batch size (default: the largest concurrency)")
    b.add_argument("--context", type=int, default=1024, help="server tokens per request, prompt + max_tokens")
    b.add_argument("--prefill-chunk", type=int, default=None,
                   help="server: most prompt tokens read between two decode steps (default: the server's)")
    b.add_argument("--repeats", type=int, default=1,
                   help="passes over every policy and concurrency, interleaved; targets use the medians; the report is "
                        "written after each pass (default 1)")
    b.add_argument("--switchback", type=float, default=None, metavar="SECONDS",
                   help="compare the policies in turns of SECONDS within one continuous load per concurrency (--repeats "
                        "rounds, the order reversed every other round) instead of in levels one after another: drift "
                        "in the machine's speed cancels in the ratios, which come with a 95 %% bootstrap interval; "
                        "measures throughput only (no TTFT)")
    b.add_argument("--control", action="store_true",
                   help="with --switchback: each round runs `off` once more, as `off-control`, an A/A comparison with "
                        "`off` that shows how far the harness alone moves a ratio (the cost/off target's line quotes it)")
    b.add_argument("--no-warmup", action="store_true", help="time each level cold (no untimed wave first, so graph captures count)")
    b.add_argument("--client-processes", type=int, default=None,
                   help="processes sharing each level's streams (default: for a GPU server one per 8 streams, at most one "
                        "per CPU this command may use; for a CPU server one): one Python process parses about 10k "
                        "chunks/s, less than a fast GPU server sends")
    b.add_argument("--frontends", type=int, default=1, help="the server's HTTP frontend processes (`serve --frontends`)")
    b.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the server to come up")
    b.add_argument("--out", default="runs/bench-serve", help="folder for results.json, report.md, throughput.png, server.log")
    b.add_argument("--json", action="store_true", help="print the results document instead of the table")
    add_tp_arg(b)


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    from specdec.cli import add_drafter_args

    add_drafter_args(p)
    p.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per step (`on`, `batch-threshold`); the most `cost` tries (default: on a GPU, "
                        f"EAGLE's whole tree depth; else {DEFAULT_GAMMA})")
    p.add_argument("--spec-threshold", type=int, default=4, help="batch-threshold: speculate while running requests <= N")


def require_serve_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"the server needs {', '.join(missing)}: {SERVE_EXTRA}")


def check_serve_args(args: argparse.Namespace) -> None:
    from specdec.cli import check_drafter_args
    from specdec.server.policy import check_policy

    check_drafter_args(args)
    check_policy(args.spec_policy, DEFAULT_GAMMA if args.gamma is None else args.gamma, args.spec_threshold)
    for name in ("max_batch", "default_max_tokens", "max_body_bytes", "prefill_chunk"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    check_frontends(args.frontends, args.frontend)


def check_frontends(n: int, frontend: str) -> None:
    if n < 1:
        raise UserError(f"--frontends must be >= 1, got {n}")
    if n > 1 and frontend == "thread":
        raise UserError("--frontends N > 1 starts frontend processes: leave out --frontend thread")


def run_serve(args: argparse.Namespace) -> int:
    require_serve_extra()
    check_serve_args(args)

    from specdec.cli import drafter_extra
    from specdec.drafters import DrafterOptions, build_drafter
    from specdec.models import load_model
    from specdec.models.llama import LlamaModel
    from specdec.server.app import AppSettings, create_app
    from specdec.server.frontend import ServerOptions, http_server, log_to_stderr, serve_with_frontend
    from specdec.adaptive import verify_widths
    from specdec.server.policy import SpecPolicy, cost_grid, measure_batch_costs
    from specdec.models.tensor_parallel import join_group
    from specdec.server.mirror import MirroredOps, follow
    from specdec.server.scheduler import BatchOps, Codec, Scheduler, SchedulerConfig

    shard = join_group(args.tp, args.device)
    target = load_model(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, gguf=args.gguf, shard=shard)
    if not isinstance(target, LlamaModel):
        raise UserError(f"{args.model}: the server batches the native Llama-family implementation only")
    if target.tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer files: the server needs one")
    context = args.context or min(target.max_context, 2048)
    if not 1 < context <= target.max_context:
        raise UserError(f"--context must be in 2..{target.max_context} (the model's), got {context}")
    options = DrafterOptions(draft_model=args.draft_model, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                             extra=drafter_extra(args))
    drafter = build_drafter(args.drafter, target, options)
    gamma = default_gamma(args.drafter, drafter, target.norm.weight.device) if args.gamma is None else args.gamma
    widths = verify_widths(drafter, gamma)
    costs = None
    if args.spec_policy == "cost" or args.enable_admin:
        print("specdec: measuring target forward times per batch size and draft length (once) ...", file=sys.stderr, flush=True)
        costs = measure_batch_costs(target, *cost_grid(args.max_batch, widths))
    policy = SpecPolicy(args.spec_policy, gamma, args.spec_threshold, costs, widths=widths)
    config = SchedulerConfig(max_batch=args.max_batch, max_queue=args.max_queue, context=context,
                             prefill_chunk=args.prefill_chunk or default_prefill_chunk(target.norm.weight.device),
                             freeze_heap=True)
    ops = partial(MirroredOps, shard) if shard.parallel else BatchOps  # under TP, rank 0 decides, the others follow
    scheduler = Scheduler(target, drafter, Codec(target.tokenizer), policy, config, ops=ops)
    if shard.rank > 0:
        follow(scheduler.ops, shard)
        return 0
    device = describe_device(target)
    settings = AppSettings(model_name=args.served_model_name or args.model, device=device, api_key=args.api_key,
                           max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                           admin=args.enable_admin)
    on_cuda = target.norm.weight.device.type == "cuda"
    frontend = args.frontend if args.frontend != "auto" else "process" if on_cuda or args.frontends > 1 else "thread"
    print(f"specdec: serving {settings.model_name} on http://{args.host}:{args.port}/v1 ({device}; drafter {args.drafter}, "
          f"gamma {gamma}, policy {args.spec_policy}, max batch {args.max_batch}, context {context}, frontend {frontend}"
          f"{f' x {args.frontends}' if args.frontends > 1 else ''}"
          f"{f', tensor-parallel over {shard.world} ranks' if shard.parallel else ''}"
          f"{', API key required' if args.api_key else ''})", file=sys.stderr, flush=True)
    log_to_stderr(args.log_level)
    # Two busy threads share the GIL: the decode loop and the event loop writing every stream's tokens.
    # CPython hands the GIL over every 5 ms by default; at 32 clients on an H200 (plain decoding of the
    # default model) a 0.5 ms interval gave 9.7-10.4k tok/s and a TTFT p50 of 24-26 ms, against 8.0-8.7k
    # and 32-33 ms at 5 ms (two runs each, one machine).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    options = ServerOptions(args.host, args.port, args.log_level, args.shutdown_timeout, args.frontends)
    if frontend == "process":
        return serve_with_frontend(scheduler, target.tokenizer, settings, options)
    http_server(create_app(scheduler, settings), options).run()  # its shutdown stops the scheduler, which releases the followers
    return 0


def drafter_argv(args: argparse.Namespace) -> list[str]:
    """The drafter options given to bench-serve, as `specdec serve` arguments."""
    argv = ["--drafter", args.drafter]
    for name in ("draft_model", "eagle_head", "eagle3_head", "medusa_heads", "tree_nodes", "tree_depth", "tree_frontier", "tree_branch", "tree_lookup", "ngram_max",
                 "ngram_min", "layers",
                 "layer_skip_config", "window", "lookahead_ngram", "guesses", "quant_format"):
        value = getattr(args, name)
        if value is not None:
            value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            argv += [f"--{name.replace('_', '-')}", value]
    return argv


def describe_device(target) -> str:
    import torch

    p = next(target.parameters())
    name = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    return f"{p.device} ({name}), {str(p.dtype).removeprefix('torch.')}"


def run_bench_serve(args: argparse.Namespace) -> int:
    require_serve_extra()
    from dataclasses import asdict

    from specdec.server.bench import (SAMPLING_MIX, LoadPlan, check_targets, fixed_sampling, format_checks, format_medians,
                                      format_table, hardware, prompts_for, run_load, short_level_note, write_report)
    from specdec.server.policy import check_policy

    if not args.concurrency or min(args.concurrency) < 1:
        raise UserError("--concurrency needs positive client counts, e.g. 1,2,4")
    if not args.policies:
        raise UserError("--policies needs at least one of off, on, batch-threshold, cost")
    for policy in args.policies:
        check_policy(policy, DEFAULT_GAMMA if args.gamma is None else args.gamma, args.spec_threshold)
    if args.requests is not None and args.requests < 1 or args.requests_per_client < 1:
        raise UserError("--requests and --requests-per-client must be >= 1")
    if args.sampling_mix and args.temperature is not None:
        raise UserError("--sampling-mix sets each request's temperature: leave out --temperature")
    if args.temperature is not None and args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 <= args.disconnect_fraction < 1:
        raise UserError(f"--disconnect-fraction must be in [0, 1), got {args.disconnect_fraction}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    if args.switchback is not None and not args.switchback > 0:
        raise UserError(f"--switchback must be a positive number of seconds, got {args.switchback}")
    if args.switchback is not None and args.disconnect_fraction:
        raise UserError("--switchback measures throughput only: leave out --disconnect-fraction")
    if args.control and args.switchback is None:
        raise UserError("--control is an A/A turn of --switchback: add --switchback SECONDS")
    if args.control and "off" not in args.policies:
        raise UserError("--control compares `off` with itself: add off to --policies")
    if args.client_processes is not None and args.client_processes < 1:
        raise UserError(f"--client-processes must be >= 1, got {args.client_processes}")
    check_frontends(args.frontends, "auto")
    if args.frontends > 1 and args.url:
        raise UserError("--frontends is for the server bench-serve starts: leave it out with --url")
    prompts = prompts_for(args.task, args.limit)
    sampling = SAMPLING_MIX if args.sampling_mix else fixed_sampling(args.temperature or 0.0)
    low, high = token_range(args.max_tokens)
    plan = LoadPlan(tuple(args.concurrency), tuple(args.policies), args.requests, high, sampling,
                    args.spec_threshold, args.disconnect_fraction, warmup=not args.no_warmup,
                    client_processes=args.client_processes, repeats=args.repeats, max_tokens_low=low if low < high else None,
                    per_client=args.requests_per_client)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def config_of(health: dict) -> dict:
        return {"model": health.get("model"), "url": args.url, "drafter": health.get("drafter"),
                "gamma": health.get("gamma"), "threshold": args.spec_threshold, "task": args.task, "prompts": len(prompts),
                "max_tokens": high if low == high else f"{low}-{high}", "sampling": [asdict(s) for s in sampling],
                "disconnect_fraction": args.disconnect_fraction, "concurrency": list(args.concurrency),
                "policies": list(args.policies), "requests_per_level": [plan.requests_at(c) for c in args.concurrency],
                "repeats": args.repeats, "frontends": None if args.url else args.frontends}

    def save_pass(health: dict, levels: list) -> None:  # a run stopped later keeps the passes it finished
        write_report(out, config_of(health), hardware(health), levels)

    if args.switchback is not None:
        return run_switchback_load(args, plan, prompts, config_of)
    with benched_server(args, out) as (url, key):
        health, levels = run_load(url, key, prompts, plan, after_pass=save_pass)
    files = write_report(out, config_of(health), hardware(health), levels)
    lost = sum(lv.lost for lv in levels)
    if args.json:
        print(files[0].read_text())
    else:
        print(format_table(levels))
        if args.repeats > 1:
            print("\nMedians over passes:", format_medians(levels), sep="\n")
        print("\nTargets (issue 13, medians over passes):", *format_checks(check_targets(levels)), sep="\n")
        if note := short_level_note(levels):
            print(note)
        print(f"\n{sum(lv.requests for lv in levels)} requests: {sum(lv.ok for lv in levels)} ok, "
              f"{sum(lv.disconnected for lv in levels)} disconnected, {lost} lost or malformed; "
              f"wrote {', '.join(map(str, files))}")
    return 1 if lost or not all(lv.rows_freed for lv in levels) else 0


@contextmanager
def benched_server(args: argparse.Namespace, out: Path) -> Iterator[tuple[str, str | None]]:
    """(url, API key) of the server bench-serve measures: --url's, or one it starts here (log: out/server.log),
    stopped on leaving."""
    if args.url:
        yield args.url.rstrip("/"), args.api_key
        return
    from specdec.server.bench import local_server

    print(f"specdec: starting the server (log: {out / 'server.log'}) ...", file=sys.stderr, flush=True)
    with local_server(local_server_args(args), out / "server.log", args.startup_timeout) as (url, key):
        yield url, key


def local_server_args(args: argparse.Namespace) -> list[str]:
    """`specdec serve`'s arguments for the server bench-serve starts itself."""
    server_args = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--kernels", args.kernels,
                   "--gguf", args.gguf, *drafter_argv(args), *(["--gamma", str(args.gamma)] if args.gamma is not None else []),
                   "--spec-policy", args.policies[0], "--spec-threshold", str(args.spec_threshold),
                   "--max-batch", str(args.max_batch or max(args.concurrency)), "--context", str(args.context),
                   "--max-queue", str(max(256, 2 * max(args.concurrency))), "--log-level", "info", "--tp", str(args.tp)]
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    if args.prefill_chunk:
        server_args += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.frontends > 1:
        server_args += ["--frontends", str(args.frontends)]
    return server_args


def run_switchback_load(args: argparse.Namespace, plan, prompts: list[str], config_of) -> int:
    """bench-serve --switchback: the policies in turns within one load per concurrency (server/switchback.py)."""
    from specdec.server.bench import format_checks, hardware
    from specdec.server.switchback import (check_switchbacks, format_comparisons, request_line, run_switchbacks,
                                           write_switchback_report)

    out = Path(args.out)
    with benched_server(args, out) as (url, key):
        health, loads = run_switchbacks(url, key, prompts, plan, args.switchback, args.control)
    files = write_switchback_report(out, config_of(health), hardware(health), loads, args.switchback)
    if args.json:
        print(files[0].read_text())
    else:
        print(format_comparisons(loads))
        print("\nTargets (issue 13, over every round):", *format_checks(check_switchbacks(loads)), sep="\n")
        print(f"\n{request_line(loads)}; wrote {', '.join(map(str, files))}")
    return 1 if any(load.lost or not load.rows_freed for load in loads) else 0

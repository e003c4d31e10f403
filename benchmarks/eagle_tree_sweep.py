"""EAGLE tokens/s against the tree's shape (nodes verified per step, depth, frontier), beside plain
decoding, on the default model; prompts interleaved (plain, then every shape, prompt by prompt).

    python benchmarks/eagle_tree_sweep.py [--device cuda --dtype bfloat16] [--gguf dequantize] [--nodes 10,16,24,32] [--depths 5]
        [--frontiers 4] [--branches 4] [--lookups 0,5] [--lookup-min-ngrams 1,2] [--eagle-head shipped,DIR,...] [--eagle3-head DIR]
        [--task gsm8k-eval] [--limit 6] [--max-new-tokens 256] [--out DIR]

Several EAGLE heads (`shipped` names the one in the package) are swept side by side, prompt by prompt. Every
row also counts the prompts whose greedy output equals plain decoding's (lossless k/n).

--lookups sweeps the prompt-lookup chain grafted onto each tree (--tree-lookup; 0: none). Where the prompts
have categories (`mixed`), x plain is also given per category.

On a 2-core CPU (float32, 3 prompts, 128 tokens) 10 nodes was best (1.69x plain; 15 gave 1.52x): a verify
forward there costs more per node. On a GPU the exact kernels verify 16 tokens for about the price of one.
"""

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec  # noqa: E402
from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.drafters import DrafterOptions  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gguf", default="auto", help="how the default model's GGUF file runs (native, dequantize; load_model's)")
    ap.add_argument("--nodes", type=ints, default=[4, 6, 8, 10, 15])
    ap.add_argument("--depths", type=ints, default=[5])
    ap.add_argument("--frontiers", type=ints, default=[4])
    ap.add_argument("--branches", type=ints, default=[None], help="children per expanded node (default: the device's, "
                                                                 "EagleTreeConfig's; 1 with frontier 1 is a chain)")
    ap.add_argument("--lookups", type=ints, default=[0], help="prompt-lookup tokens grafted onto the trees (0: none)")
    ap.add_argument("--lookup-min-ngrams", type=ints, default=[1], help="the shortest n-gram a grafted lookup matches")
    ap.add_argument("--eagle-head", default="shipped", help="`specdec train eagle` folders, comma-separated, swept side "
                                                            "by side (`shipped`: the head in the package; the default)")
    ap.add_argument("--eagle3-head", default=None, help="a `specdec train eagle3` folder: its trees are swept too, "
                                                        "beside EAGLE's (the same shapes, prompt by prompt)")
    ap.add_argument("--task", default="gsm8k-eval", help="a built-in task set or a prompts file (bench's --task)")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write sweep.json here")
    args = ap.parse_args()
    model = specdec.load_model("default", dtype=args.dtype, device=args.device, gguf=args.gguf)
    tasks = load_tasks(args.task, args.limit + 1)
    prompts = [encode_prompt(model.tokenizer, t.prompt) for t in tasks]
    engines = {"plain": specdec.SpecEngine(model, "none")}
    folders = args.eagle_head.split(",")
    heads = {"eagle" if len(folders) == 1 else f"eagle[{Path(f).name}]": {"eagle_path": None if f == "shipped" else f}
             for f in folders}
    if args.eagle3_head:
        heads["eagle3"] = {"eagle3_path": args.eagle3_head}
    for depth, frontier, branch, nodes, lookup, min_ngram in itertools.product(args.depths, args.frontiers, args.branches,
                                                                                args.nodes, args.lookups, args.lookup_min_ngrams):
        if min_ngram != args.lookup_min_ngrams[0] and not lookup:
            continue  # no lookup: the n-gram size changes nothing
        shape = {"total_tokens": nodes, "depth": depth, "frontier": frontier, "lookup": lookup}
        shape |= {"branch": branch} if branch else {}
        for label, head in heads.items():
            drafter = label.split("[")[0]
            name = f"{label} n{nodes} d{depth} f{frontier}" + (f" b{branch}" if branch else "")
            name += f" l{lookup}" if args.lookups != [0] else ""
            name += f" m{min_ngram}" if len(args.lookup_min_ngrams) > 1 and lookup else ""
            options = DrafterOptions(extra=shape | head, ngram_max=max(3, min_ngram), ngram_min=min_ngram)
            engines[name] = specdec.SpecEngine(model, drafter, options)
    config = specdec.SpecConfig(gamma=max(args.depths), max_new_tokens=args.max_new_tokens)
    for engine in engines.values():  # warm up (captures, compiles) on a prompt not measured
        engine.generate(prompts[-1:], config)
    rates = {k: [] for k in engines}
    taus = {k: [] for k in engines}
    lossless = {k: 0 for k in engines}
    for prompt in prompts[:-1]:
        for name, engine in engines.items():
            out = engine.generate([prompt], config)
            rates[name].append(out.stats.tokens_per_s)
            taus[name].append(out.stats.mean_accepted_length)
            if name == "plain":
                plain_tokens = out.rows[0].token_ids
            lossless[name] += out.rows[0].token_ids == plain_tokens
    categories = sorted({t.category for t in tasks[:-1] if t.category})
    rows = {}
    for name in engines:
        speedups = [a / b for a, b in zip(rates[name], rates["plain"])]
        rows[name] = {"tokens_per_s": statistics.median(rates[name]), "tau": statistics.median(taus[name]),
                      "x_plain": statistics.median(speedups), "lossless": lossless[name], "prompts": len(speedups)}
        by_category = {c: (statistics.median(x for x, t in zip(speedups, tasks) if t.category == c),
                           statistics.median(x for x, t in zip(taus[name], tasks) if t.category == c)) for c in categories}
        if len(categories) > 1:
            rows[name]["by_category"] = {c: {"x_plain": x, "tau": tau} for c, (x, tau) in by_category.items()}
        print(f"{name:28} {rows[name]['tokens_per_s']:8.1f} tok/s  tau {rows[name]['tau']:.2f}  x plain {rows[name]['x_plain']:.2f}"
              f"  lossless {lossless[name]}/{len(speedups)}"
              + "".join(f"  {c} {x:.2f}x tau {tau:.2f}" for c, (x, tau) in by_category.items() if len(categories) > 1), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sweep.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

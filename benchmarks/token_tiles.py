"""Graphed forward times of the exact path by GEMM token tile (16, 32, 64 tokens), and whether a tile's
width changes any bit: the measurement behind triton_ops.TILE_32_FROM / TILE_64_FROM.

    python benchmarks/token_tiles.py [--model default] [--out FILE]

For each shape (rows x tokens): verify-like blocks after a 200-token prefix (a static cache, the forward
captured in a CUDA graph) and whole-prompt prefills (graphs.PrefillGraphs), each replayed 20 times per
width (median of CUDA-event times). Then the logits and hidden states of every shape are compared across
the widths bit for bit; the inputs are seeded per shape, so every width reads the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.graphs import PrefillGraphs  # noqa: E402
from specdec.models.loading import load_model  # noqa: E402

WIDTHS = (16, 32, 64)
VERIFY = [(1, 5), (1, 25), (4, 25), (8, 25), (16, 25), (32, 25), (64, 25), (32, 5), (64, 5), (64, 1)]
PREFILL = [(1, 128), (1, 512), (1, 2048), (4, 128), (8, 128), (16, 128), (8, 256), (32, 128), (64, 128)]
PREFIX = 200  # committed tokens before a verify block


def seeded_tokens(rows: int, tokens: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(seed)).cuda()


def replay_ms(run, repeats: int = 20, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def captured_verify(model, rows: int, tokens: int, block: torch.Tensor):
    """A graph of one forward over block [rows, tokens] after PREFIX cached slots, and its output."""
    cache = model.new_cache(rows, PREFIX + tokens, static=True)
    positions = (PREFIX + torch.arange(tokens, device="cuda")).expand(rows, tokens).contiguous()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and pick kernels before capturing
            cache.lengths.fill_(PREFIX)
            model(block, positions, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.lengths.fill_(PREFIX)
        out = model(block, positions, cache)
    return graph, out


def sweep(model) -> tuple[dict, dict]:
    """ms[shape][width] and the outputs (logits, hidden) of each shape at each width."""
    from specdec.models import triton_ops  # imports triton: only where a GPU is
    vocab = model.config.vocab_size
    ms: dict[str, dict[int, float]] = {}
    outputs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    default = triton_ops.token_tile
    try:
        for width in WIDTHS:
            triton_ops.token_tile = lambda M, width=width: width
            prefills = PrefillGraphs(model, max_tokens=max(r * s for r, s in PREFILL))
            for rows, tokens in PREFILL:
                name = f"prefill {rows}x{tokens}"
                block = seeded_tokens(rows, tokens, vocab, rows * 10000 + tokens)
                last = torch.full((rows,), tokens - 1, device="cuda")
                prefills.capture((rows, tokens))
                out = prefills.forward((rows, tokens), block, last)
                outputs.setdefault(name, []).append((out.logits.clone(), out.hidden.clone()))
                ms.setdefault(name, {})[width] = replay_ms(lambda: prefills.forward((rows, tokens), block, last))
            for rows, tokens in VERIFY:
                name = f"verify {rows}x{tokens}"
                graph, out = captured_verify(model, rows, tokens, seeded_tokens(rows, tokens, vocab, rows * 10000 + tokens + 7))
                graph.replay()
                torch.cuda.synchronize()
                outputs.setdefault(name, []).append((out.logits.clone(), out.hidden.clone()))
                ms.setdefault(name, {})[width] = replay_ms(graph.replay)
            print(f"{width}-token tiles measured", file=sys.stderr)
    finally:
        triton_ops.token_tile = default
    return ms, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("token_tiles.py needs a CUDA GPU (the exact path's Triton kernels)")
    torch.set_grad_enabled(False)  # the exact kernels run only without autograd
    model = load_model(args.model, device="cuda")
    ms, outputs = sweep(model)
    print(f"{'shape':>16} {'M':>6} " + " ".join(f"{str(w) + '-tile ms':>11}" for w in WIDTHS))
    for name, by_width in ms.items():
        rows, tokens = (int(x) for x in name.split()[1].split("x"))
        print(f"{name:>16} {rows * tokens:>6} " + " ".join(f"{by_width[w]:11.3f}" for w in WIDTHS))
    equal = {name: all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs[1:])
             for name, outs in outputs.items()}
    differing = [name for name, same in equal.items() if not same]
    print("logits and hidden states bitwise equal across widths:", "every shape" if not differing else f"NO: {differing}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "ms": ms, "equal": equal}, indent=1))


if __name__ == "__main__":
    main()

"""A quantized drafter's products on the CPU: 4-bit blocks with int8 activations (int_dot.c, the `-A8`
formats) against the same blocks dequantised into float32 FMAs (skinny_gemm.c) and float32 weights.

    python benchmarks/int_dot.py [--threads 2] [--rows 1,2,4] [--repeats 41] [--forward]

Median ms per product on the default model's shapes (K, N), random weights, each call on the next of
enough copies of the weight to overflow a 32 MiB L3 (as in decoding, where weights come from memory),
the formats alternating call by call. With --forward instead: median ms of one decode forward (1 and 2
new tokens after a 200-token context) of the default model in float32 (`--gguf dequantize`: the target)
and of its quantized copies (the drafts), alternating forward by forward, and each one's ratio to the
target's (T = 1): the bench's cost coefficient c is about that ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.models import cpu_gemm, cpu_quant  # noqa: E402
from specdec.models.cpu_gemm import SHAPES  # noqa: E402

FORMATS = ("float32", "Q4_1", "Q4_1-A8", "Q4_0", "Q4_0-A8")


def packs_of(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, str | None]:
    """Panels of weight [N, K] in fmt, and the qtype gemm takes."""
    if fmt == "float32":
        return cpu_gemm.pack(weight), None
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weight.numpy(), GGMLQuantizationType[cpu_quant.FORMATS[fmt].gguf])
    return cpu_quant.pack_blocks(torch.from_numpy(raw), fmt), fmt


def measure(K: int, N: int, M: int, repeats: int) -> dict[str, float]:
    """Median ms per product of each format for x [M, K] and weights [N, K]."""
    copies = -(-64 * 2**20 // (N * K * 5 // 8))  # enough Q4_1 copies to overflow L3 (float32 copies then far more)
    weights = [torch.randn(N, K) for _ in range(copies)]
    packs = {fmt: [packs_of(w, fmt) for w in weights] for fmt in FORMATS}
    x = torch.randn(M, K)
    times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for i in range(repeats + 1):  # the first round warms up
        for fmt in FORMATS:
            packed, qtype = packs[fmt][i % copies]
            start = time.perf_counter()
            cpu_gemm.gemm(x, packed, None, N, qtype=qtype)
            times[fmt].append(time.perf_counter() - start)
    return {fmt: statistics.median(t[1:]) * 1e3 for fmt, t in times.items()}


def forward_ms(formats: tuple[str, ...], repeats: int, context: int = 200) -> None:
    """Print the median ms of decode forwards of the default model and its quantized copies."""
    from specdec.models import load_model
    from specdec.models.views import quantized_copy

    target = load_model("default", dtype="float32", gguf="dequantize")
    models = {"target": target} | {fmt: quantized_copy(target, fmt) for fmt in formats}
    ids = torch.randint(0, target.config.vocab_size, (1, context + 2), generator=torch.Generator().manual_seed(0))
    caches = {name: m.new_cache(1, context + 2) for name, m in models.items()}
    with cpu_gemm.kernels_own_threads():
        for name, m in models.items():
            m(ids[:, :context], torch.arange(context)[None], caches[name])
        medians: dict[int, dict[str, float]] = {}
        for T in (1, 2):
            times: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(repeats + 1):
                for name, m in models.items():
                    start = time.perf_counter()
                    m(ids[:, context:context + T], torch.arange(context, context + T)[None], caches[name], logits_at=torch.tensor([T - 1]))
                    times[name].append(time.perf_counter() - start)
                    caches[name].trim(torch.tensor([context]))
            medians[T] = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
            print(f"T={T}: " + ", ".join(f"{name} {ms:.2f} ms ({ms / medians[1]['target']:.2f})" for name, ms in medians[T].items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--forward", action="store_true", help="time decode forwards of the default model and its copies")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_gemm.build_status(), f"threads={args.threads}")
    if args.forward:
        forward_ms(("int8", "Q4_1", "Q4_1-A8", "Q4_0-A8"), args.repeats)
        return
    print(f"{'K x N':<12} {'M':>2} " + " ".join(f"{fmt:>8}" for fmt in FORMATS) + "   (median ms per product)")
    for K, N in SHAPES:
        for M in map(int, args.rows.split(",")):
            ms = measure(K, N, M, args.repeats)
            print(f"{K:>4} x {N:<5} {M:>2} " + " ".join(f"{ms[fmt]:8.3f}" for fmt in FORMATS))


if __name__ == "__main__":
    main()

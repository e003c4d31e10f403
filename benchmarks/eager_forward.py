"""Where an eager (ungraphed) forward of the default model's shape spends its time on a GPU: prefill and
the first pass of a new step shape run eagerly, so this is what they cost.

    python benchmarks/eager_forward.py [--out FILE]

Random weights of SmolLM2-135M's shape (30 layers, hidden 576), bf16, the exact Triton path; for each
(rows, tokens): wall_ms (launch to synchronised end, median of 10), host_ms (until the forward returns,
without waiting for the GPU) and gpu_ms (the kernels' summed device time, torch profiler, per forward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.models.kernels import kernel_path  # noqa: E402
from specdec.models.llama import ModelConfig, random_llama  # noqa: E402

SMOLLM2_135M = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                           rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True)
SHAPES = ((1, 1), (1, 100), (8, 100), (32, 1), (4, 512))  # (rows, tokens per row)


def forward_fn(model, B: int, T: int):
    cache = model.new_cache(B, 1024)
    tokens = torch.randint(0, SMOLLM2_135M.vocab_size, (B, T), device="cuda")  # [B, T]
    positions = torch.arange(T, device="cuda").expand(B, T)  # [B, T]
    last = torch.full((B,), T - 1, device="cuda")  # [B]

    def forward():
        cache.lengths.zero_()
        model(tokens, positions, cache, logits_at=last)

    return forward


def measure(model, B: int, T: int) -> dict:
    forward = forward_fn(model, B, T)
    forward()
    torch.cuda.synchronize()
    wall, host = [], []
    for _ in range(10):
        t = time.perf_counter()
        forward()
        host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            forward()
        torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages())
    return {"rows": B, "tokens": T, "wall_ms": statistics.median(wall), "host_ms": statistics.median(host), "gpu_ms": gpu_us / 3 / 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    model = random_llama(SMOLLM2_135M, "cuda", torch.bfloat16, seed=0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel_path": kernel_path(model).name,
               "shapes": [measure(model, B, T) for B, T in SHAPES]}
    for r in results["shapes"]:
        print(f"rows {r['rows']:>2} x tokens {r['tokens']:>3}: wall {r['wall_ms']:6.2f} ms, host {r['host_ms']:6.2f} ms, "
              f"GPU {r['gpu_ms']:5.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

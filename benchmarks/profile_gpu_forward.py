"""Where one decode forward of the 8B-shaped model spends its time on the GPU: kernel time by kind,
the number of kernels, and the sum against the wall time of a CUDA-graph replay.

    python benchmarks/profile_gpu_forward.py [--tokens 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu import LLAMA3_8B  # noqa: E402
from specdec.models.llama import random_llama  # noqa: E402
from specdec.graphs import GraphedModel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    args = ap.parse_args()
    device = torch.device("cuda")
    model = random_llama(LLAMA3_8B, device)
    cache = model.new_cache(1, 1024, static=True)
    ids = torch.randint(0, 1000, (1, 512), device=device)
    model(ids, torch.arange(512, device=device)[None], cache)
    graphed = GraphedModel(model, cache)
    block = ids[:, : args.tokens]
    positions = cache.lengths[:, None] + torch.arange(args.tokens, device=device)
    for _ in range(3):
        cache.lengths.fill_(512)
        graphed(block, positions, cache)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        cache.lengths.fill_(512)
        graphed(block, positions, cache)
    torch.cuda.synchronize()
    print(f"graph replay: {(time.perf_counter() - t) / 20 * 1e3:.2f} ms per forward of {args.tokens} token(s)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cache.lengths.fill_(512)
        model(block, positions, cache)
        torch.cuda.synchronize()
    by_kind: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[e.name[:60]].append(e.device_time)
    total = sum(sum(v) for v in by_kind.values())
    print(f"eager forward: {sum(len(v) for v in by_kind.values())} kernels, {total / 1e3:.2f} ms of kernel time")
    for name, times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"{sum(times) / 1e3:8.3f} ms  {len(times):5d}x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

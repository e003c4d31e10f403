"""Where a speculative step spends its device time: kernel time by kernel name, kernels per step, and
their sum against the step's wall time (default model, batch 1, graphs as the engine runs them).

    python benchmarks/profile_step.py [--drafters none,eagle] [--gamma 5] [--tokens 128] [--top 25]

The profiler (CUPTI) sees the kernels inside CUDA-graph replays, so this is the step as it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models import load_model  # noqa: E402


def profile(engine: SpecEngine, prompt: list[int], config: SpecConfig, top: int) -> None:
    engine.generate([prompt], config)  # capture the graphs, warm every cache
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = engine.generate([prompt], config)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:90]].append(e.device_time)  # us
    steps = max(out.times.steps, 1)
    total_ms = sum(map(sum, by_name.values())) / 1e3
    count = sum(map(len, by_name.values()))
    wall_ms = out.stats.wall_s * 1e3
    print(f"\n== {engine.drafter.name} gamma {config.gamma}: {steps} steps, {out.stats.emitted} tokens, "
          f"wall {wall_ms / steps:.3f} ms/step (profiled), kernel time {total_ms / steps:.3f} ms/step, "
          f"{count / steps:.0f} kernels/step")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(times) / 1e3 / steps * 1e3:9.1f} us/step {len(times) / steps:6.1f}x  {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="none,eagle")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_step.py needs a CUDA device", file=sys.stderr)
        return 2
    model = load_model("default", dtype=args.dtype, device="cuda")
    prompt = encode_prompt(model.tokenizer, load_tasks("gsm8k-eval", 1)[0].prompt)
    config = SpecConfig(gamma=args.gamma, max_new_tokens=args.tokens, stop_at_eos=False)
    for drafter in args.drafters.split(","):
        profile(SpecEngine(model, drafter), prompt, config, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How long a joining prompt takes to its first token on the host, with the device idle and beside a step
of a full batch in flight: what a server's first token waits for on the device (docs/design.md, "Where
a first token waits").

    python benchmarks/read_beside_step.py [--rows 32] [--gamma 5] [--drafter eagle] [--repeats 40]

A batch of `rows` running rows (gsm8k-eval prompts) and one free slot. Each repeat, in turn:
- idle: the joining prompt is read (Stepper.prefill) with no step in flight;
- beside: a step over the running rows is launched, then the prompt is read (on the prefill stream,
  as the server reads it), timed until its first token is on the host; then the step is read;
- step: a step alone, launch to read.
The joining row leaves after each read; a running row that finishes (at EOS, or half the context) is
replaced. Prints the
median and p90 ms of each, on the default model (CUDA, bf16).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specdec.api import encode_prompt  # noqa: E402
from specdec.batch import Request, eos_ids  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.drafters import build_drafter  # noqa: E402
from specdec.models.loading import load_model  # noqa: E402
from specdec.step import new_stepper  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("read_beside_step.py measures the prefill stream beside a step: it needs a CUDA device")

    target = load_model("default", device="cuda")
    tasks = load_tasks("gsm8k-eval", args.rows + args.repeats)
    prompts = [encode_prompt(target.tokenizer, t.prompt) for t in tasks]
    if max(map(len, prompts)) >= args.context // 2:
        sys.exit(f"--context {args.context} leaves a running row no room: its prompts reach {max(map(len, prompts))} tokens")
    stepper = new_stepper(target, build_drafter(args.drafter, target), args.rows + 1, args.context, list(eos_ids(target)))
    stepper.capture_prefills(args.rows + 1)
    batch, slot = stepper.batch, args.rows

    def refill() -> None:
        free = [s for s in range(args.rows) if s not in batch.rows]
        if free:
            stepper.prefill(free, [Request(prompts[s], args.context // 2 - len(prompts[s])) for s in free])
        batch.gamma.fill_(args.gamma)

    def step() -> None:
        stepper.read()
        for s, row in list(batch.rows.items()):
            if row.finished and s != slot:  # (the joining row leaves in its own time)
                batch.release(s)

    def join(prompt: list[int]) -> float:
        start = time.perf_counter()
        stepper.prefill([slot], [Request(prompt, 1)])  # returns with the first token on the host
        return (time.perf_counter() - start) * 1e3

    times: dict[str, list[float]] = {"idle": [], "beside": [], "step": []}
    for i in range(args.repeats + 3):  # the first three warm up
        refill()
        idle = join(prompts[args.rows + i % args.repeats])
        batch.release(slot)
        stepper.launch(args.gamma)
        beside = join(prompts[args.rows + i % args.repeats])
        step()
        batch.release(slot)
        refill()
        start = time.perf_counter()
        stepper.launch(args.gamma)
        step()
        alone = (time.perf_counter() - start) * 1e3
        if i >= 3:
            for name, ms in (("idle", idle), ("beside", beside), ("step", alone)):
                times[name].append(ms)
    print(f"{args.drafter}, {args.rows} rows at gamma {args.gamma}, {args.repeats} repeats, {torch.cuda.get_device_name()}")
    for name, ms in times.items():
        ms = sorted(ms)
        print(f"{name:7s} median {statistics.median(ms):6.2f} ms  p90 {ms[round(0.9 * (len(ms) - 1))]:6.2f} ms")


if __name__ == "__main__":
    main()

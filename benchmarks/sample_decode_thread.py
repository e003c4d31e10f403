"""Where a server's decode thread spends its time under load: `specdec serve` with a stack sampler on
that thread (docs/design.md, "More client processes and a shorter GIL switch").

    python benchmarks/sample_decode_thread.py OUT serve --model default --drafter eagle --device cuda ...

Runs `specdec serve` with the arguments after OUT. Creating the file OUT.dump writes what was sampled
since the last dump to OUT-N.txt (N = 1, 2, ...) within about 0.1 s: drive the server with `bench-serve
--url` one level at a time and `touch OUT.dump` after each. (A signal would not do: the server's main
thread never ran a SIGUSR1 handler under load on an H200.)

Every SAMPLE_S the sampler reads the decode thread's Python stack and, where the thread is in a turn of
the decode loop (not idle, not capturing graphs), counts (a) the path of scheduler methods it is in,
marked `wait` where its innermost frame is a wait, and (b) its innermost specdec line. A blocking call
into torch shows as the Python line that made it. The sampler takes the GIL SAMPLE_S apart, which costs
the threads it samples a little of their time; and it samples where the decode thread lets go of the GIL
(a torch call, a wait), so its line counts favour lines that call torch.

On a GPU it also times, with CUDA events on the prefill stream, each section of work queued there
(`Stepper.reading_prompts`: a prompt read, or the scratch for one): how long the stream waited for the last
join (queued behind a step on the main stream) before the section could start, and how long the section
then ran. Both go into the same window's file.
"""

import collections
import contextlib
import itertools
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SAMPLE_S = 0.0005
WAITS = {"wait", "wait_for", "synchronize", "_wait_for_tstate_lock"}


class ReadTimer:
    """Events around each section of prefill-stream work: [(before the join wait, after it, end)]."""

    def __init__(self) -> None:
        self.pending: list = []
        self.join_wait_ms: list[float] = []
        self.run_ms: list[float] = []

    def install(self) -> None:
        import torch

        from specdec.models.kernels import counter_lane
        from specdec.graphs import PREFILL_LANE
        from specdec.step import Stepper

        timer = self

        @contextlib.contextmanager
        def reading_prompts(self):  # Stepper.reading_prompts, with three events on the prefill stream
            if self.prefill_stream is None:
                yield
                return
            stream = self.prefill_stream
            before, after, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            before.record(stream)
            if self.joined is not None:
                stream.wait_event(self.joined)
            after.record(stream)
            with torch.cuda.stream(stream), counter_lane(PREFILL_LANE):
                yield
            end.record(stream)
            timer.pending.append((before, after, end))

        Stepper.reading_prompts = reading_prompts

    def collect(self) -> None:
        """Move the sections whose events have all fired into the lists."""
        left = []
        for before, after, end in self.pending:
            if end.query():
                self.join_wait_ms.append(before.elapsed_time(after))
                self.run_ms.append(after.elapsed_time(end))
            else:
                left.append((before, after, end))
        self.pending = left

    def report(self) -> list[str]:
        self.collect()
        n = len(self.run_ms)
        if not n:
            return []
        waits, runs = sorted(self.join_wait_ms), sorted(self.run_ms)
        waited = [w for w in waits if w > 0.05]  # sorted
        text = [f"== prefill-stream sections: {n}",
                f"waited for the last join (> 0.05 ms): {len(waited)}, median of those "
                f"{waited[len(waited) // 2] if waited else 0:.3f} ms, total {sum(waits):.1f} ms",
                f"ran: median {runs[n // 2]:.3f} ms, p90 {runs[int(n * 0.9)]:.3f} ms, total {sum(runs):.1f} ms"]
        self.join_wait_ms.clear()
        self.run_ms.clear()
        return text


class Sampler:
    def __init__(self, out: str, reads: ReadTimer) -> None:
        self.out, self.windows, self.reads = out, 0, reads
        self.paths: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self.lock = threading.Lock()

    def run(self) -> None:
        for tick in itertools.count():
            time.sleep(SAMPLE_S)
            if tick % 200 == 0 and os.path.exists(self.out + ".dump"):
                os.unlink(self.out + ".dump")
                self.dump()
            thread = next((t for t in threading.enumerate() if t.name == "specdec-decode"), None)
            frame = sys._current_frames().get(thread.ident) if thread is not None else None
            if frame is not None:
                self.count(frame)

    def count(self, frame) -> None:
        stack = []  # (file, line, function), outermost first
        while frame is not None:
            stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        stack.reverse()
        methods = [name for file, _, name in stack if file.endswith("scheduler.py")]
        if "turn" not in methods:  # idle (wait_for_work), or capturing graphs (capture_steps)
            return
        inner = next((f for f in reversed(stack) if "specdec" in f[0]), stack[-1])
        path = ">".join(methods) + (" [wait]" if stack[-1][2] in WAITS else "")
        with self.lock:
            self.samples += 1
            self.paths[path] += 1
            self.lines[f"{inner[0].rsplit('specdec/', 1)[-1]}:{inner[1]} {inner[2]}"] += 1

    def dump(self) -> None:
        with self.lock:
            self.windows += 1
            n = max(self.samples, 1)
            text = [f"{self.samples} samples of the decode thread, {SAMPLE_S * 1e3:g} ms apart", "== scheduler path"]
            text += [f"{v / n:6.3f} {k}" for k, v in self.paths.most_common(40)]
            text += ["== innermost specdec line"] + [f"{v / n:6.3f} {k}" for k, v in self.lines.most_common(60)]
            text += self.reads.report()
            Path(f"{self.out}-{self.windows}.txt").write_text("\n".join(text) + "\n")
            self.samples = 0
            self.paths.clear()
            self.lines.clear()


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "serve":
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from specdec.cli import main as specdec_main

    reads = ReadTimer()
    reads.install()
    sampler = Sampler(sys.argv[1], reads)
    threading.Thread(target=sampler.run, name="sampler", daemon=True).start()
    return specdec_main(sys.argv[2:])


if __name__ == "__main__":  # the HTTP frontends are spawned processes, which import this file again
    sys.exit(main())

"""Where a server's decode thread spends its time under load: `specdec serve` with a stack sampler on
that thread (docs/design.md, "More client processes and a shorter GIL switch").

    python benchmarks/sample_decode_thread.py OUT serve --model default --drafter eagle --device cuda ...

Runs `specdec serve` with the arguments after OUT. SIGUSR1 writes what was sampled since the last one to
OUT-N.txt (N = 1, 2, ...): drive the server with `bench-serve --url` one level at a time and send SIGUSR1
after each. Every SAMPLE_S the sampler reads the decode thread's Python stack and, where the thread is in
a turn of the decode loop (not idle, not capturing graphs), counts (a) the path of scheduler methods it
is in, marked `wait` where its innermost frame is a wait, and (b) its innermost specdec line. A blocking
call into torch shows as the Python line that made it. The sampler takes the GIL SAMPLE_S apart, which
costs the threads it samples a little of their time.
"""

import collections
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SAMPLE_S = 0.0005
WAITS = {"wait", "wait_for", "synchronize", "_wait_for_tstate_lock"}


class Sampler:
    def __init__(self, out: str) -> None:
        self.out, self.windows = out, 0
        self.paths: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            time.sleep(SAMPLE_S)
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

    def dump(self, *_) -> None:
        with self.lock:
            self.windows += 1
            n = max(self.samples, 1)
            text = [f"{self.samples} samples of the decode thread, {SAMPLE_S * 1e3:g} ms apart", "== scheduler path"]
            text += [f"{v / n:6.3f} {k}" for k, v in self.paths.most_common(40)]
            text += ["== innermost specdec line"] + [f"{v / n:6.3f} {k}" for k, v in self.lines.most_common(60)]
            Path(f"{self.out}-{self.windows}.txt").write_text("\n".join(text) + "\n")
            self.samples = 0
            self.paths.clear()
            self.lines.clear()


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "serve":
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from specdec.cli import main as specdec_main

    sampler = Sampler(sys.argv[1])
    signal.signal(signal.SIGUSR1, sampler.dump)
    threading.Thread(target=sampler.run, name="sampler", daemon=True).start()
    return specdec_main(sys.argv[2:])


if __name__ == "__main__":  # the HTTP frontends are spawned processes, which import this file again
    sys.exit(main())

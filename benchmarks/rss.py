"""Resident memory of specdec and of llama.cpp decoding the same GGUF, each in a fresh process.

Each process loads the model, decodes `--tokens` tokens of one GSM8K prompt (specdec with `--drafter`),
and reports its resident set (VmRSS) after loading and after decoding, and its peak (ru_maxrss).

    python benchmarks/rss.py [--model default] [--drafter eagle] [--tokens 256] [--threads 2] [--json OUT]

llama.cpp needs llama-cpp-python (the optional `llamacpp` extra); it runs with the context the bench
gives it (4096).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SPECDEC = """
import json, os, resource, sys
import torch
import specdec
from specdec.bench.tasks import load_tasks
rss = lambda: int(open(f"/proc/{os.getpid()}/status").read().split("VmRSS:")[1].split()[0]) // 1024
model, drafter, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
m = specdec.load_model(model, device="cpu")
loaded = rss()
specdec.generate([load_tasks("gsm8k-eval", 1)[0].prompt], model=m, drafter=drafter, max_new_tokens=tokens)
print(json.dumps({"loaded_mib": loaded, "decoded_mib": rss(), "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""

LLAMA = """
import json, os, resource, sys
from llama_cpp import Llama
from specdec.bench.tasks import load_tasks
from specdec.models.loading import resolve_gguf
rss = lambda: int(open(f"/proc/{os.getpid()}/status").read().split("VmRSS:")[1].split()[0]) // 1024
model, tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=str(resolve_gguf(model)), n_ctx=4096, n_threads=threads, verbose=False)
loaded = rss()
llm.create_chat_completion([{"role": "user", "content": load_tasks("gsm8k-eval", 1)[0].prompt}], max_tokens=tokens, temperature=0)
print(json.dumps({"loaded_mib": loaded, "decoded_mib": rss(), "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def measure(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="eagle")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = {"specdec": measure(SPECDEC, args.model, args.drafter, str(args.tokens), str(args.threads))}
    try:
        result["llamacpp"] = measure(LLAMA, args.model, str(args.tokens), str(args.threads))
    except subprocess.CalledProcessError as e:
        print(f"llama.cpp not measured: {e.stderr.strip().splitlines()[-1]}", file=sys.stderr)
    for name, r in result.items():
        print(f"{name:9s} loaded {r['loaded_mib']} MiB, after decoding {r['decoded_mib']} MiB, peak {r['peak_mib']} MiB")
    if "llamacpp" in result:
        ratio = result["specdec"]["decoded_mib"] / result["llamacpp"]["decoded_mib"]
        print(f"specdec / llama.cpp resident after decoding: {ratio:.2f}x")
        result["ratio_after_decoding"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Split GSM8K's train.jsonl once into the package's held-out eval set and the drafter-training rest.

Usage (from the repository root):  python scripts/split_gsm8k.py ../shared/data/gsm8k/train.jsonl

Each problem is ranked by sha256(SALT + question); the EVAL_SIZE lowest go to gsm8k-eval.jsonl, the
others to gsm8k-train.jsonl. Both keep the source's order and its lines byte for byte, so the split
depends only on the questions, never on Python's random module, and re-running it reproduces the
shipped files exactly. The source's LICENSE is copied alongside as GSM8K-LICENSE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

SALT = "specdec-gsm8k-split-v1:"
EVAL_SIZE = 500
OUT_DIR = Path(__file__).resolve().parent.parent / "specdec" / "data"


def rank_key(line: bytes) -> str:
    return hashlib.sha256((SALT + json.loads(line)["question"]).encode()).hexdigest()


def split_lines(lines: list[bytes], eval_size: int) -> tuple[list[bytes], list[bytes]]:
    """(eval, train): the eval_size lines with the lowest rank key, and the rest, both in source order."""
    chosen = set(sorted(range(len(lines)), key=lambda i: rank_key(lines[i]))[:eval_size])
    return [lines[i] for i in sorted(chosen)], [line for i, line in enumerate(lines) if i not in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="GSM8K train.jsonl (7,473 problems)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    lines = [line for line in args.source.read_bytes().splitlines(keepends=True) if line.strip()]
    eval_lines, train_lines = split_lines(lines, EVAL_SIZE)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gsm8k-eval.jsonl").write_bytes(b"".join(eval_lines))
    (args.out / "gsm8k-train.jsonl").write_bytes(b"".join(train_lines))
    shutil.copyfile(args.source.parent / "LICENSE", args.out / "GSM8K-LICENSE")
    print(f"{len(lines)} problems -> {len(eval_lines)} eval, {len(train_lines)} train in {args.out}")


if __name__ == "__main__":
    main()

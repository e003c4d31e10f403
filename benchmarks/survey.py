"""The family matrix of several `specdec advise` runs side by side (docs/survey.md holds its output).

    python benchmarks/survey.py "CPU, 2 cores"=runs/advise-cpu "H200"=runs/advise-gpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec.advise.measurements import Measurements
from specdec.advise.render import side_by_side


def main(args: list[str]) -> int:
    runs = {}
    for arg in args:
        name, _, folder = arg.partition("=")
        runs[name] = Measurements.from_dict(json.loads((Path(folder) / "measurements.json").read_text()))
    print(side_by_side(runs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

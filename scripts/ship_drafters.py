"""Install trained drafters for the default model into the package (specdec/data/drafters/<kind>).

    python scripts/ship_drafters.py --eagle runs/train-eagle --medusa runs/train-medusa --draft runs/train-draft

Copies each folder's config.json and model.safetensors, records the default model's embedding probe
(see specdec/drafters/shipped.py) so the heads are used only for that target, and refuses files over
20 MB. The config keeps `trained_with`: the exact command that produced the drafter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.drafters.shipped import SHIPPED, target_probe  # noqa: E402
from specdec.models import load_model  # noqa: E402

MAX_BYTES = 20 * 1024 * 1024


def ship(kind: str, folder: Path, probe: dict) -> Path:
    weights, config = folder / "model.safetensors", folder / "config.json"
    if not (weights.exists() and config.exists()):
        sys.exit(f"{folder}: needs config.json and model.safetensors (a `specdec train {kind}` folder)")
    if weights.stat().st_size > MAX_BYTES:
        sys.exit(f"{weights}: {weights.stat().st_size / 2**20:.1f} MB, over the 20 MB a shipped drafter may take")
    dest = SHIPPED / kind
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(weights, dest / "model.safetensors")
    meta = json.loads(config.read_text()) | {"target_probe": probe}
    (dest / "config.json").write_text(json.dumps(meta, indent=2))
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for kind in ("eagle", "medusa", "draft"):
        ap.add_argument(f"--{kind}", type=Path, default=None, help=f"a `specdec train {kind}` output folder")
    args = ap.parse_args()
    probe = target_probe(load_model("default", dtype="float32", device="cpu"))
    for kind in ("eagle", "medusa", "draft"):
        folder = getattr(args, kind)
        if folder is not None:
            dest = ship(kind, folder, probe)
            print(f"{kind}: {folder} -> {dest} ({(dest / 'model.safetensors').stat().st_size / 2**20:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

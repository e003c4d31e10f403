"""Trained drafters shipped inside the package for the default model (specdec/data/drafters/<kind>).

Each folder is what `specdec train <kind>` wrote, plus `target_probe` in its config.json: a few of the
target's embedding values it was trained against. A shipped drafter is used only for a target whose
embeddings match the probe (the default model, in any dtype); any other target needs its own
trained drafter. scripts/ship_drafters.py installs a trained folder here and records the probe.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.errors import UserError

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafters"
PROBE_ROWS = (0, 1, 2, 17, 100, 1000, 4096, 12345)  # token ids whose embeddings identify the target
PROBE_DIMS = 4  # leading dimensions of each row


def target_probe(target) -> dict:
    """What identifies the target: its shape and a handful of embedding values."""
    embed = target.embed_tokens  # an nn.Embedding or a QuantizedEmbedding: looked up, never materialised
    rows = [r for r in PROBE_ROWS if r < embed.num_embeddings]
    with torch.no_grad():
        values = embed(torch.tensor(rows, device=target.norm.weight.device))[:, :PROBE_DIMS].float().cpu()
    return {"vocab_size": int(embed.num_embeddings), "hidden_size": int(embed.embedding_dim),
            "num_layers": int(target.config.num_layers), "rows": rows, "values": values.tolist()}


def matches_probe(target, probe: dict) -> bool:
    """Same shape and the same probed embeddings, to bfloat16 precision."""
    ours = target_probe(target)
    if any(ours[k] != probe.get(k) for k in ("vocab_size", "hidden_size", "num_layers", "rows")):
        return False
    return torch.allclose(torch.tensor(ours["values"]), torch.tensor(probe["values"]), rtol=1e-2, atol=1e-3)


def shipped_folder(kind: str, target) -> Path | None:
    """The shipped `kind` drafter folder if it was trained for this target, else None."""
    config = SHIPPED / kind / "config.json"
    if not config.exists() or not hasattr(target, "embed_tokens"):
        return None
    probe = json.loads(config.read_text()).get("target_probe")
    return config.parent if probe is not None and matches_probe(target, probe) else None


def trained_folder(kind: str, target, path: str | None, option: str) -> str:
    """`path` when given, else the shipped folder for this target; a clear error when there is neither."""
    if path is not None:
        return path
    folder = shipped_folder(kind, target)
    if folder is None:
        raise UserError(f"the {kind} drafter needs {option} PATH (a folder written by `specdec train {kind}`); "
                        "the shipped one fits only the default model")
    return str(folder)

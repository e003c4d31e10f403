"""Reading a model or drafter folder a user points at (config.json, safetensors weights): whatever is
wrong with it becomes one UserError naming the folder and the problem, never a traceback (the CLI prints
a UserError as one line)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from specdec.errors import UserError, first_line


def read_config(folder: Path, what: str) -> dict:
    """folder/config.json as a dict; `what` names what the folder should hold (for the error)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"{folder}: no config.json (not {what})")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not readable JSON ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object")
    return config


def require_keys(config: dict, keys, where: str) -> None:
    """A UserError naming the keys `config` lacks (where: the file they belong in)."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors (safetensors raises its own SafetensorError for a corrupt header or body)."""
    if not Path(path).is_file():
        raise UserError(f"{path}: no such weights file")
    try:
        return load_file(str(path))
    except Exception as e:
        raise UserError(f"{path} is not a readable safetensors file ({type(e).__name__}: {first_line(e)})") from None


def check_shapes(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str = "the checkpoint") -> None:
    """A UserError naming the tensors of `state` whose shapes differ from what the config implies (`expected`)."""
    wrong = [f"{k} is {list(state[k].shape)}, the config implies {list(v.shape)}"
             for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise UserError(f"{where} does not match its config.json: {'; '.join(wrong[:3])}{more}")


def load_weights(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> list[str]:
    """module.load_state_dict(state, strict=False), a tensor of the wrong shape a UserError (check_shapes);
    returns the module's keys `state` lacked (the caller says which may be missing)."""
    check_shapes(state, module.state_dict(), where)
    return module.load_state_dict(state, strict=False).missing_keys

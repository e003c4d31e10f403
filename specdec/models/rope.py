"""Rotary position embeddings, with the scaling variants found in Llama-3.x, Qwen and long-context configs.

Frequencies follow the "rotate half" layout used by Hugging Face checkpoints (GGUF weights are
un-permuted to it by the loader).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Rope:
    inv_freq: Tensor  # [Dh/2] float32, on the CPU (built before the model is placed)
    attention_factor: float = 1.0  # multiplies cos and sin (yarn)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, attention_factor: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T], inv_freq [Dh/2] -> cos, sin [B, 1, T, Dh] in `dtype`."""
    angles = positions[..., None].float() * inv_freq  # [B, T, Dh/2]
    emb = torch.cat((angles, angles), dim=-1)  # [B, T, Dh]
    cos = (emb.cos() * attention_factor).to(dtype)
    sin = (emb.sin() * attention_factor).to(dtype)
    return cos[:, None], sin[:, None]


def build_rope(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int) -> Rope:
    """Inverse frequencies for `scaling` (an HF `rope_scaling` / `rope_parameters` dict, or None)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)  # [Dh/2]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return Rope(inv_freq)
    if kind == "linear":
        return Rope(inv_freq / scaling["factor"])
    if kind == "llama3":
        return Rope(scale_llama3(inv_freq, scaling))
    if kind == "yarn":
        return scale_yarn(head_dim, theta, scaling, max_position_embeddings)
    raise UserError(f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def scale_llama3(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def scale_yarn(head_dim: int, theta: float, s: dict, max_position_embeddings: int) -> Rope:
    """YaRN (Peng et al. 2023): blend interpolated and extrapolated frequencies by a linear ramp."""
    old_len = s.get("original_max_position_embeddings") or max_position_embeddings
    factor = s.get("factor") or max_position_embeddings / old_len
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return Rope(inv_freq, float(attention_factor))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

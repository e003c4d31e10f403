"""The CPU matrix kernel for decoding: skinny_gemm.c, compiled on first use, called through ctypes.

Decode and verify steps multiply 1 to ~16 rows by every weight, so they are bound by reading the
weights. PyTorch's BLAS (MKL) reads a [out, in] weight at about 7 GB/s for one row and about 5 GB/s
for 2-16 rows on the 2-core AMD EPYC we measure on, against about 19 GB/s of read bandwidth. The
kernel reads weights packed into contiguous column panels once per call for all rows, and gives every
row the same summation order whatever the number of rows (see skinny_gemm.c).

If no C compiler is found or the build fails, `available()` is False and callers keep PyTorch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from specdec.paths import cache_root

NR = 16  # panel width, as in skinny_gemm.c
SOURCE = Path(__file__).with_name("skinny_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per source, compiler flags and machine into the specdec cache."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or sys.platform != "linux":
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + platform.processor().encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"skinny_gemm-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{id(target)}.tmp")
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
        except (subprocess.SubprocessError, OSError):
            return None
        tmp.rename(target)
    lib = ctypes.CDLL(str(target))
    lib.skinny_gemm.restype = None
    lib.skinny_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    lib.skinny_gemm_i8.restype = None
    lib.skinny_gemm_i8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    return lib


def available() -> bool:
    return library() is not None


def pack(weight: Tensor) -> Tensor:
    """weight [N, K] (an nn.Linear's) -> panels [ceil(N/NR), K, NR] float32, zero-padded columns."""
    N, K = weight.shape
    padded = torch.zeros(-(-N // NR) * NR, K, dtype=torch.float32)
    padded[:N] = weight.detach().float()
    return padded.view(-1, NR, K).transpose(1, 2).contiguous()


def pack_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (int8 panels [ceil(N/NR), K, NR], scales [ceil(N/NR)*NR] float32): symmetric
    per-output-channel quantisation, w ~ q * scale with q in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
    N, K = q.shape
    padded = torch.zeros(-(-N // NR) * NR, K, dtype=torch.int8)
    padded[:N] = q
    scales = torch.zeros(padded.shape[0], dtype=torch.float32)
    scales[:N] = scale
    return padded.view(-1, NR, K).transpose(1, 2).contiguous(), scales


def dequantize(packed: Tensor, scales: Tensor, out_features: int) -> Tensor:
    """The float weight [out_features, K] that int8 panels and scales stand for."""
    w = packed.transpose(1, 2).reshape(-1, packed.shape[1]).float() * scales[:, None]  # [N_padded, K]
    return w[:out_features]


def padded_bias(bias: Tensor | None, N: int) -> Tensor | None:
    if bias is None:
        return None
    return torch.nn.functional.pad(bias, (0, N - bias.shape[0])).float().contiguous()


def gemm(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int, scales: Tensor | None = None) -> Tensor:
    """x [M, K] float32 -> [M, out_features] = x @ W.T + bias, with W packed by `pack` (float32 panels)
    or by `pack_int8` (int8 panels, then `scales` is given)."""
    x = x.contiguous()
    M, K = x.shape
    N = packed.shape[0] * NR
    y = torch.empty(M, N, dtype=torch.float32)
    bias = padded_bias(bias, N)
    bias_ptr = None if bias is None else bias.data_ptr()
    if scales is None:
        library().skinny_gemm(x.data_ptr(), packed.data_ptr(), bias_ptr, y.data_ptr(), M, K, N)
    else:
        library().skinny_gemm_i8(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), bias_ptr, y.data_ptr(), M, K, N)
    return y if N == out_features else y[:, :out_features]

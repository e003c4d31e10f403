"""GGUF's block-quantised weights (Q4_0, Q4_1, Q8_0) in specdec's CPU kernels, without dequantising them.

A GGUF tensor [N, K] of these formats stores each row as K / 32 blocks: a float16 scale d (Q4_1: and a
float16 minimum m), then 32 quantised weights q (4-bit: element i in the low nibble of byte i and
element i + 16 in its high nibble; 8-bit: one signed byte each). The weight is Q4_0 d * (q - 8),
Q4_1 d * q + m, Q8_0 q * d (gguf.quants).

`pack_blocks` repacks a tensor's rows into skinny_gemm's panels of 16 output columns (the layout is in
skinny_gemm.c, "GGUF blocks"), in the same bytes per weight as the file. The kernel dequantises each
weight in registers exactly as gguf's reference does, then runs the float32 kernel's arithmetic, so:
- a product is bitwise the float32 kernel's on the dequantised weight, for any number of rows: greedy
  speculation stays exact with respect to the quantised target (the target whose output is preserved);
- activations stay float32 (or bfloat16); they are not quantised to 8 bits as llama.cpp's CPU path
  does, so logits differ from llama.cpp's by that rounding (bench/llamacpp_agreement.py measures it).

The `-A8` formats (Q4_0-A8, Q4_1-A8) hold the same GGUF blocks laid out for integer dot products with
the activations quantised to int8 per block (int_dot.c, where the layout is): faster, approximate, for
a quantized drafter only (views.quantized_copy); a GGUF file's tensors never load into them.

`QuantizedEmbedding` looks token rows up in the same panels (a tied LM head and the embedding share
one copy), dequantised by the C code row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdec.models import cpu_gemm

QK = 32  # weights per block along K


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGUF's name, or with "-A8": int8 activations (int_dot.c)
    gguf: str  # the GGUF type whose blocks it holds (gguf's quantiser makes them)
    gguf_bytes: int  # bytes of one block in the file
    scales: int  # float16 scale vectors per block: d (and m)
    bits: int  # per quantised weight
    int_dot: bool = False  # panels in int_dot.c's layout, products with int8 activations

    @property
    def panel_block_bytes(self) -> int:  # one block of 16 columns in a panel (skinny_gemm.c's Qx_BLOCK)
        return cpu_gemm.NR * (2 * self.scales + QK * self.bits // 8)


FORMATS = {f.name: f for f in (
    BlockFormat("Q4_0", "Q4_0", 18, 1, 4), BlockFormat("Q4_1", "Q4_1", 20, 2, 4), BlockFormat("Q8_0", "Q8_0", 34, 1, 8),
    BlockFormat("Q4_0-A8", "Q4_0", 18, 1, 4, int_dot=True), BlockFormat("Q4_1-A8", "Q4_1", 20, 2, 4, int_dot=True),
)}


def pack_blocks(raw: Tensor, qtype: str) -> Tensor:
    """raw uint8 [N, K / 32 * gguf_bytes] (a GGUF tensor's rows, in the file's layout) -> uint8 panels
    [ceil(N / 16), K / 32 * panel_block_bytes]; padded columns have scale 0 (weights 0)."""
    f = FORMATS[qtype]
    N = raw.shape[0]
    nb = raw.shape[1] // f.gguf_bytes
    P = -(-N // cpu_gemm.NR)
    blocks = torch.zeros(P * cpu_gemm.NR, nb, f.gguf_bytes, dtype=torch.uint8)
    blocks[:N] = raw.reshape(N, nb, f.gguf_bytes)
    blocks = blocks.view(P, cpu_gemm.NR, nb, f.gguf_bytes).transpose(1, 2)  # [P, nb, 16 columns, bytes]
    scales = blocks[..., : 2 * f.scales].reshape(P, nb, cpu_gemm.NR, f.scales, 2).transpose(2, 3)  # [P, nb, s, 16, 2]
    q = blocks[..., 2 * f.scales:]  # [P, nb, 16, 16 or 32]
    if f.int_dot:
        q = torch.cat([q & 15, q >> 4], dim=-1)  # [P, nb, 16 columns, 32 elements]
        q = q.view(P, nb, cpu_gemm.NR, QK // 4, 4).permute(0, 1, 3, 2, 4)  # [P, nb, 8 groups, 16 columns, 4]
        q = q[:, :, :, :8] | (q[:, :, :, 8:] << 4)  # [P, nb, 8, 8, 4]: column j low, j + 8 high
    elif f.bits == 4:
        q = torch.cat([q & 15, q >> 4], dim=-1)  # [P, nb, 16, 32]: element order
        q = q.transpose(2, 3)  # [P, nb, 32 rows, 16 columns]
        q = q[..., :8] | (q[..., 8:] << 4)  # [P, nb, 32, 8]: column j low, j + 8 high
    else:
        q = q.transpose(2, 3)  # [P, nb, 32 rows, 16 columns] int8 bytes
    panel = torch.cat([scales.reshape(P, nb, -1), q.reshape(P, nb, -1)], dim=-1)  # [P, nb, panel_block_bytes]
    return panel.reshape(P, -1).contiguous()


def unpack_blocks(packed: Tensor, qtype: str, N: int) -> Tensor:
    """The inverse of `pack_blocks`: panels -> the GGUF rows uint8 [N, K / 32 * gguf_bytes]."""
    f = FORMATS[qtype]
    P = packed.shape[0]
    panel = packed.view(P, -1, f.panel_block_bytes)  # [P, nb, panel_block_bytes]
    nb = panel.shape[1]
    scales = panel[..., : 2 * cpu_gemm.NR * f.scales].reshape(P, nb, f.scales, cpu_gemm.NR, 2).transpose(2, 3)  # [P, nb, 16, s, 2]
    q = panel[..., 2 * cpu_gemm.NR * f.scales:]
    if f.int_dot:
        q = q.reshape(P, nb, QK // 4, cpu_gemm.NR // 2, 4)  # [P, nb, 8 groups, 8, 4]
        q = torch.cat([q & 15, q >> 4], dim=3).permute(0, 1, 3, 2, 4).reshape(P, nb, cpu_gemm.NR, QK)  # [P, nb, 16, 32]
        q = q[..., :16] | (q[..., 16:] << 4)  # [P, nb, 16, 16]: element i low, i + 16 high
    elif f.bits == 4:
        q = q.reshape(P, nb, QK, cpu_gemm.NR // 2)
        q = torch.cat([q & 15, q >> 4], dim=-1).transpose(2, 3)  # [P, nb, 16 columns, 32 elements]
        q = q[..., :16] | (q[..., 16:] << 4)  # [P, nb, 16, 16]: element i low, i + 16 high
    else:
        q = q.reshape(P, nb, QK, cpu_gemm.NR).transpose(2, 3)  # [P, nb, 16, 32]
    blocks = torch.cat([scales.reshape(P, nb, cpu_gemm.NR, -1), q], dim=-1)  # [P, nb, 16, gguf_bytes]
    return blocks.transpose(1, 2).reshape(P * cpu_gemm.NR, -1)[:N].contiguous()


def take_rows(packed: Tensor, qtype: str, N: int, rows: Tensor) -> Tensor:
    """Panels of output rows `rows` [n] of a packed [N, K] weight (the same blocks: no requantisation)."""
    return pack_blocks(unpack_blocks(packed, qtype, N)[rows.cpu()], qtype)


def dequantize_rows(packed: Tensor, qtype: str, rows: Tensor, K: int) -> Tensor:
    """Rows `rows` [n] (output columns) of panels -> float32 [n, K], exactly as gguf dequantises them."""
    rows = rows.to("cpu", torch.int64).contiguous()
    out = torch.empty(rows.numel(), K, dtype=torch.float32)
    cpu_gemm.library().specdec_dequantize_rows(packed.data_ptr(), cpu_gemm.BLOCK_TYPES[qtype], rows.data_ptr(),
                                               rows.numel(), K, out.data_ptr())
    return out


def dequantize(packed: Tensor, qtype: str, N: int, K: int) -> Tensor:
    """The whole weight [N, K] of panels, float32."""
    return dequantize_rows(packed, qtype, torch.arange(N), K)


class QuantizedEmbedding(nn.Module):
    """An embedding table held as GGUF block panels: lookups dequantise their rows (in `dtype`)."""

    def __init__(self, packed: Tensor, qtype: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed, self.qtype, self.dtype = packed, qtype, dtype
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: Tensor) -> Tensor:  # [...] -> [..., D]
        rows = dequantize_rows(self.packed, self.qtype, ids.reshape(-1), self.embedding_dim)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        """The whole table [V, D] dequantised (a new 4 x V x D byte tensor: for drafters that copy rows at
        set-up, never per token)."""
        return dequantize(self.packed, self.qtype, self.num_embeddings, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype}"


def block_format(model: nn.Module) -> str | None:
    """The GGUF block format of a native model's layers ("Q4_1", ...), None for float weights."""
    layers = getattr(model, "layers", None)
    return getattr(layers[0].mlp.down_proj, "qtype", None) if layers else None


def packed_bytes(model: nn.Module) -> int:
    """Bytes of GGUF block panels in `model` (a tied embedding and LM head counted once)."""
    seen = {id(m.packed): m.packed for m in model.modules() if getattr(m, "qtype", None) is not None}
    return sum(t.numel() for t in seen.values())


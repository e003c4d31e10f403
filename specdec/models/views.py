"""Draft models made from the target itself, sharing its weights where they can.

- `layer_subset(target, layers)`: the target's embeddings, the chosen decoder layers (by index, in
  order), its final norm and LM head: a self-speculative draft (layer skipping, Draft & Verify /
  SWIFT) that costs no extra weight memory. Its KV cache holds only the chosen layers.
- `int8_copy(target)`: every linear layer of the target quantised to int8 with one scale per output
  channel (weight-only), embeddings and norms shared: "the quantised target as its own draft". It
  reads a quarter of the bytes through the CPU int8 kernel, and exists only there.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specdec.errors import UserError
from specdec.models import cpu_gemm
from specdec.models.linear import Linear, quantize_int8
from specdec.models.llama import DecoderLayer, LlamaModel


def follow_kernels(drafter: nn.Module, target: nn.Module) -> None:
    """Give a drafter's decoder layers the kernel choice of the target's (see kernels.py): a drafter built
    beside a target loaded with kernels="library" runs the library kernels too."""
    choice = next((m.kernels for m in target.modules() if isinstance(m, DecoderLayer)), "auto")
    for module in drafter.modules():
        if isinstance(module, DecoderLayer):
            module.kernels = choice


def shell(target: LlamaModel, num_layers: int) -> LlamaModel:
    """An empty LlamaModel (no storage) with the target's config but `num_layers` layers."""
    with torch.device("meta"):
        model = LlamaModel(replace(target.config, num_layers=num_layers))
    model.inv_freq = target.inv_freq
    model.tokenizer = target.tokenizer
    return model


def layer_subset(target: LlamaModel, layers: list[int]) -> LlamaModel:
    if not isinstance(target, LlamaModel):
        raise UserError("layer skipping needs a native Llama-family target")
    n = target.config.num_layers
    if not layers or any(not 0 <= i < n for i in layers) or sorted(set(layers)) != list(layers):
        raise UserError(f"layers must be distinct increasing indices in 0..{n - 1}, got {layers}")
    model = shell(target, len(layers))
    model.embed_tokens, model.norm, model.lm_head = target.embed_tokens, target.norm, target.lm_head
    model.layers = nn.ModuleList(target.layers[i] for i in layers)
    model.name = f"{getattr(target, 'name', 'target')}[layers {','.join(map(str, layers))}]"
    return model.eval()


def int8_copy(target: LlamaModel) -> LlamaModel:
    if not isinstance(target, LlamaModel):
        raise UserError("the quantized drafter needs a native Llama-family target")
    model = shell(target, target.config.num_layers)
    model.load_state_dict(target.state_dict(), assign=True)  # shares every tensor with the target...
    model.embed_tokens = target.embed_tokens
    if next(target.parameters()).device.type != "cpu" or not cpu_gemm.available():
        raise UserError("an int8 copy runs on specdec's CPU int8 kernel: it needs a CPU model and a C compiler")
    for module in model.modules():
        if isinstance(module, Linear):  # ...then each linear layer gets its own int8 weights
            quantize_int8(module)
    model.name = f"{getattr(target, 'name', 'target')}[int8]"
    return model.eval()

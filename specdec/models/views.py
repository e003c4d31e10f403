"""Draft models made from the target itself, sharing its weights where they can.

- `layer_subset(target, layers)`: the target's embeddings, the chosen decoder layers (by index, in
  order), its final norm and LM head: a self-speculative draft (layer skipping, Draft & Verify /
  SWIFT) that costs no extra weight memory. Its KV cache holds only the chosen layers.
- `int8_copy(target)`: every linear layer of the target quantised to int8 with one scale per output
  channel (weight-only), embeddings and norms shared: "the quantised target as its own draft". On a
  CPU it reads a quarter of the bytes through the int8 kernel; elsewhere there is no int8 kernel
  here, so the copy is dequantised back to the target's dtype (same speed as the target: honest
  acceptance numbers, no speed-up).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specdec.errors import UserError
from specdec.models import cpu_gemm
from specdec.models.linear import Linear, quantize_int8
from specdec.models.llama import LlamaModel


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
    on_cpu = next(target.parameters()).device.type == "cpu" and cpu_gemm.available()
    for name, module in model.named_modules():
        if isinstance(module, Linear):  # ...then each linear layer gets its own int8 weights
            if on_cpu:
                quantize_int8(module)
            else:
                packed, scales = cpu_gemm.pack_int8(module.weight.float().cpu())
                w = cpu_gemm.dequantize(packed, scales, module.out_features)
                module.weight = nn.Parameter(w.to(module.weight), requires_grad=False)
    model.name = f"{getattr(target, 'name', 'target')}[int8]"
    return model.eval()

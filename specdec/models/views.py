"""Draft models made from the target itself, sharing its weights where they can.

- `layer_subset(target, layers)`: the target's embeddings, the chosen decoder layers (by index, in
  order), its final norm and LM head: a self-speculative draft (layer skipping, Draft & Verify /
  SWIFT) that costs no extra weight memory. Its KV cache holds only the chosen layers.
- `quantized_copy(target, fmt)`: every linear layer of the target quantised (weight-only), embeddings
  and norms shared: "the quantised target as its own draft". fmt "int8" has one scale per output
  channel (a quarter of float32's bytes); "Q8_0", "Q4_1" and "Q4_0" are GGUF's block formats with one
  scale per 32 weights (quantised by gguf's reference quantiser; about 1.06, 0.63 and 0.56 bytes per
  weight). "Q4_1-A8" and "Q4_0-A8" are the same 4-bit blocks multiplied with the activations quantised
  to int8 per block of 32, in integer dot products (int_dot.c, llama.cpp's way): about twice as fast as
  dequantising the weights into float32 FMAs, and a little less accurate. A quantised target (a native
  GGUF) is requantised from its dequantised weights. Block formats need every layer's input size a
  multiple of 32. A 4-bit copy's head only ranks the vocabulary: its best logits are scored again by
  the target's head rows in int8 (RescoredHead). It runs on the CPU kernels, and exists only there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from specdec.errors import UserError
from specdec.models import cpu_gemm, cpu_layer, cpu_quant
from specdec.models.linear import Linear, float_weight, quantize_blocks, quantize_int8
from specdec.models.llama import DecoderLayer, LlamaModel, ModelOutput


def follow_kernels(drafter: nn.Module, target: nn.Module) -> None:
    """Give a drafter's decoder layers the kernel choice of the target's (see kernels.py): a drafter built
    beside a target loaded with kernels="library" runs the library kernels too."""
    choice = next((m.kernels for m in target.modules() if isinstance(m, DecoderLayer)), "auto")
    for module in drafter.modules():
        if isinstance(module, DecoderLayer):
            module.kernels = choice


def shell(target: LlamaModel, num_layers: int, cls: type[LlamaModel] = LlamaModel) -> LlamaModel:
    """An empty LlamaModel (no storage; a `cls`) with the target's config but `num_layers` layers."""
    with torch.device("meta"):
        model = cls(replace(target.config, num_layers=num_layers), target.shard)
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


QUANT_FORMATS = ("int8", "Q8_0", "Q4_1", "Q4_0", "Q4_1-A8", "Q4_0-A8")
# A Q4_1 copy's head is Q4_0 (no per-block minimum: less to read and add for 49,152 rows), its best logits rescored
# in int8 (RescoredHead) as any 4-bit head's are. On a 2-core EPYC (default model, 10 gsm8k-eval prompts, 128 tokens,
# Q4_1-A8 layers, alternated) a proposal of 4 tokens took 21.84 ms against 22.60, alpha 0.859 either way.
HEAD_FORMATS = {"Q4_1": "Q4_0", "Q4_1-A8": "Q4_0-A8"}


def check_blocks(target: LlamaModel, fmt: str) -> None:
    """UserError unless every linear layer's input splits into GGUF's blocks of 32; a note, once, when an
    int8-activation format runs without AVX2 (then its products run in portable C)."""
    from specdec.models import cpu_quant

    odd = sorted({m.in_features for m in target.modules() if isinstance(m, Linear) and m.in_features % cpu_quant.QK})
    if odd:
        raise UserError(f"--quant-format {fmt} quantises blocks of {cpu_quant.QK} inputs, but this model has layers of "
                        f"{', '.join(map(str, odd))} inputs; use int8")
    isa = cpu_gemm.build_status()["int_dot"]
    if cpu_quant.FORMATS[fmt].int_dot and isa == "portable":
        cpu_gemm.say_once(f"{fmt} draft: no AVX2 in this kernel build ({isa}): its integer products run in portable C, "
                          "without the vector instructions that make the format fast")


RESCORED = 8  # a 4-bit copy's best logits per position that the target's head rows score again


@dataclass
class RescoredHead:
    """The target's LM head rows in int8 (one scale per row), beside a 4-bit copy's own head: that head ranks
    the vocabulary, and its RESCORED best logits per position are replaced by these rows' products. A 4-bit
    head cost the default model's draft most of its misses, its head being tied to a Q8_0 embedding (its
    layers re-quantise to the GGUF's own Q4_1 blocks bit for bit). Q4_1-A8 draft of the float32 target,
    gamma 4, 2-core CPU, 4 gsm8k-eval prompts x 128, one run each beside other work: the 4-bit head alone
    alpha 0.79 (c 0.39), the whole head in int8 0.93 (c 0.54), rescored 0.93 (c 0.42). Any q is a
    valid draft distribution, so the output stays the target's whatever this changes."""

    weight: Tensor  # [V, D] int8
    scale: Tensor  # [V] float32

    @classmethod
    def of(cls, head: Linear) -> "RescoredHead":
        w = float_weight(head).detach().float()
        if head.split is not None:  # one rank's vocabulary shard: the logits it scores are gathered whole
            w = head.split.whole_weight(w)
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        return cls(torch.round(w / scale[:, None]).to(torch.int8), scale)

    def apply(self, logits: Tensor, hidden: Tensor) -> Tensor:  # [B, T, V] float32, [B, T, D]
        """The logits rescored: in place, or in a copy where they are a view of wider rows (a head whose
        vocabulary is not a whole number of the kernel's panels leaves its last columns out)."""
        return cpu_gemm.rescore(logits.contiguous(), hidden, self.weight, self.scale, RESCORED)


class QuantizedCopy(LlamaModel):
    """quantized_copy's model: a LlamaModel whose logits, with a 4-bit head, are rescored (RescoredHead)."""

    rescored: RescoredHead | None = None

    @property
    def weights_note(self) -> str:
        return f"the head's top {RESCORED} rescored in int8" if self.rescored is not None else ""

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, cache, mask: Tensor | None = None,
                logits_at: Tensor | None = None, aux_layers: tuple[int, ...] | None = None) -> ModelOutput:
        out = super().forward(tokens, positions, cache, mask, logits_at, aux_layers)
        if self.rescored is None:
            return out
        return replace(out, logits=self.rescored.apply(out.logits, cpu_layer.positions_at(out.hidden, logits_at)))


def quantized_copy(target: LlamaModel, fmt: str = "int8") -> LlamaModel:
    if not isinstance(target, LlamaModel):
        raise UserError("the quantized drafter needs a native Llama-family target")
    if fmt not in QUANT_FORMATS:
        raise UserError(f"unknown quantized format {fmt!r}; choose {', '.join(QUANT_FORMATS)}")
    if next(target.parameters()).device.type != "cpu" or not cpu_gemm.available():
        raise UserError("a quantized copy runs on specdec's CPU kernels: it needs a CPU model and a C compiler")
    if fmt != "int8":
        check_blocks(target, fmt)
    model = shell(target, target.config.num_layers, QuantizedCopy)
    model.embed_tokens, model.norm = target.embed_tokens, target.norm
    for mine, theirs in zip(model.layers, target.layers):
        mine.load_state_dict({k: v for k, v in theirs.state_dict().items() if "norm" in k}, assign=True, strict=False)
    for name, module in model.named_modules():  # each linear layer gets its own quantised weights (and the bias)
        if isinstance(module, Linear):
            source = target.get_submodule(name)
            module.bias = source.bias
            mine = HEAD_FORMATS.get(fmt, fmt) if module is model.lm_head else fmt
            quantize_int8(module, source) if fmt == "int8" else quantize_blocks(module, source, mine)
    if fmt != "int8" and cpu_quant.FORMATS[fmt].bits == 4:
        model.rescored = RescoredHead.of(target.lm_head)
    model.name = f"{getattr(target, 'name', 'target')}[{fmt}]"
    return model.eval()

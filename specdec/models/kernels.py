"""Which kernels run a native model's forwards, chosen at load: `load_model(..., kernels=...)`.

- "exact": every per-token output (logits, hidden state, KV) is bitwise the same whether the token is
  computed alone, inside a verify block or a tree, or in a batch of any size, so greedy speculative
  output equals greedy plain output token for token. On CUDA: specdec's Triton kernels
  (specdec/models/triton_ops.py), five launches per decoder layer, for every forward over a KV cache
  of anything built from DecoderLayer / run_layers / LlamaModel (targets, layer subsets, draft models,
  the EAGLE head's layer). On the CPU: specdec's C kernels (cpu_gemm, cpu_attention), through the
  packed Linear layers. Refused with a UserError where it is not available (no triton, an uncovered
  model feature, a dtype the kernels lack), naming the feature and the `kernels="library"` way out.
- "library": cuBLAS + SDPA + torch.compile'd elementwise ops on CUDA, MKL + SDPA on the CPU: each
  picks its algorithm per shape, so a token's bits depend on the block and batch it is computed in.
- "auto" (the default): "exact" where it is available, else "library" (said once on stderr).

Forwards with autograd on (training) or without a cache (cache=None) always take the library path.
The choice lives on each DecoderLayer (`layer.kernels`), so views that share the target's layers
share its choice; `kernel_path(model)` reports what runs, for the CLI and results.json.

SPECDEC_TRITON_INTERPRET=1 (for development and tests without a GPU) sets TRITON_INTERPRET=1, and CPU
models loaded with kernels="exact" then run the Triton kernels through Triton's (slow) interpreter
instead of the C kernels ("auto" keeps the C kernels).
"""

from __future__ import annotations

import contextlib
import os
import sys
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from functools import cache, wraps

import torch
from torch import Tensor, nn

from specdec.errors import UserError
from specdec.models import fused

CHOICES = ("auto", "exact", "library")
# Which set of arrival counters the Triton kernels launched here use (triton_ops.counters): one per stream of
# work that may run at the same time as another's (see counter_lane).
COUNTER_LANE: ContextVar[str] = ContextVar("counter_lane", default="main")
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class KernelPath:
    name: str  # "triton-exact" | "cpu-exact" | "cublas" | "mkl" | "transformers"
    exact: bool  # per-token outputs bitwise invariant to block and batch size
    detail: str
    weights: str = ""  # the linear layers' weight formats, e.g. "Q4_1 x 120, Q8_0 x 1" or "float32 x 121"

    def to_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def counter_lane(name: str):
    """Kernels launched (or captured) inside use arrival counters of their own. A split-K or split-KV kernel
    counts its programs' arrivals in a shared buffer and leaves it at zero, which holds for launches that run
    one after another, as on one stream; work on a second stream that overlaps the first (a prompt read
    beside a step, step.prefill_stream) would count into the same counters and break both."""
    token = COUNTER_LANE.set(name)
    try:
        yield
    finally:
        COUNTER_LANE.reset(token)


def interpreting() -> bool:
    return os.environ.get("SPECDEC_TRITON_INTERPRET") == "1"


@cache
def triton_problem() -> str | None:
    """Why the Triton kernels cannot run in this process (None: they can). Imports triton once."""
    if interpreting():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from specdec.models import triton_ops  # noqa: F401
    except Exception as e:  # ImportError, or a triton too old for the kernels
        return f"triton is not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def triton_device(device: torch.device, choice: str) -> bool:
    """Whether `choice` means the Triton kernels on `device` (CUDA; the CPU only under the interpreter)."""
    return device.type == "cuda" or (device.type == "cpu" and choice == "exact" and interpreting())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from specdec.models.llama import DecoderLayer

    return [m for m in model.modules() if isinstance(m, DecoderLayer)]


def triton_gap(layer: nn.Module, dtype: torch.dtype) -> str | None:
    """The feature of this decoder layer the Triton kernels do not cover, or None."""
    attn = layer.self_attn
    if attn.head_dim < 16 or attn.head_dim & (attn.head_dim - 1):
        return f"head_dim {attn.head_dim} (the kernels take powers of two from 16)"
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype}"
    return None


def exact_problem(model: nn.Module, device: torch.device, dtype: torch.dtype, triton: bool) -> str | None:
    """Why the exact kernels (Triton, or else the C kernels) cannot run `model` (None: they can)."""
    layers = decoder_layers(model)
    if not layers:
        return "the exact kernels run native Llama-family models only (this is not one)"
    if triton:
        return triton_problem() or next((gap for gap in (triton_gap(layer, dtype) for layer in layers) if gap), None)
    if device.type != "cpu":
        return f"no exact kernels for {device.type} devices"
    from specdec.models import cpu_gemm

    status = cpu_gemm.build_status()
    if not status["available"]:
        return f"the CPU kernels could not be built ({status['error']})"
    if dtype not in cpu_gemm.KERNEL_DTYPES:
        return f"the CPU kernels take {' and '.join(map(str, cpu_gemm.KERNEL_DTYPES))}, not {dtype}"
    return None


def use_kernels(model: nn.Module, choice: str = "auto") -> KernelPath:
    """Set which kernels run `model`'s forwards (see the module docstring) and return the path taken."""
    if choice not in CHOICES:
        raise UserError(f"unknown kernels {choice!r}; choose {', '.join(CHOICES)}")
    p = next(model.parameters())
    triton = triton_device(p.device, choice)
    problem = None if choice == "library" else exact_problem(model, p.device, p.dtype, triton)
    if choice == "exact" and problem:
        raise UserError(f"kernels='exact' cannot run this model: {problem}; load it with kernels='library'")
    if choice == "auto" and problem:
        say_once(f"exact kernels unavailable ({problem}): running the library kernels, so greedy speculative output may differ from plain decoding")
    exact = problem is None and choice != "library"
    for layer in decoder_layers(model):
        layer.kernels = "exact" if exact else "library"
    if p.device.type == "cpu" and not triton:
        pack_for_cpu(model, exact)
    return kernel_path(model)


def pack_for_cpu(model: nn.Module, exact: bool) -> None:
    """Pack the CPU Linear layers for the C kernels (exact), or drop float packings (library: F.linear
    runs; quantized layers, int8 or GGUF blocks, whose float weight is gone, keep theirs)."""
    from specdec.models.linear import Linear, use_cpu_kernels

    if exact:
        use_cpu_kernels(model)
        return
    for module in model.modules():
        if isinstance(module, Linear) and not module.quantized:
            module.packed = module.packed_bias = None


@cache
def say_once(message: str) -> None:
    print(f"specdec: {message}", file=sys.stderr)


def weight_formats(model: nn.Module) -> str:
    """How many linear layers hold each weight format (GGUF blocks, int8 or a float dtype)."""
    from collections import Counter

    from specdec.models.linear import Linear

    formats = Counter(m.qtype or ("int8" if m.scales is not None else str(m.weight.dtype).removeprefix("torch."))
                      for m in model.modules() if isinstance(m, Linear))
    note = getattr(model, "weights_note", "")  # views.QuantizedCopy: its head's best logits rescored
    return ", ".join([f"{name} x {n}" for name, n in formats.most_common()] + ([note] if note else []))


def kernel_path(model: nn.Module) -> KernelPath:
    """The kernels `model`'s forwards over a KV cache run through, and its weight formats."""
    path = kernel_route(model)
    return KernelPath(path.name, path.exact, path.detail, weight_formats(model))


def draft_kernel_path(drafter) -> KernelPath | None:
    """The kernel path of a drafter's own decoder stack (a draft model, a quantized copy, a layer
    subset), None for a drafter without one."""
    draft = getattr(drafter, "draft", None)
    return kernel_path(draft) if isinstance(draft, nn.Module) and decoder_layers(draft) else None


def kernel_route(model: nn.Module) -> KernelPath:
    layers = decoder_layers(model)
    p = next(model.parameters())
    if not layers:
        return KernelPath("transformers", False, f"transformers' own forward on {p.device.type}")
    if runs_triton(layers[0], p.device, p.dtype):
        return KernelPath("triton-exact", True, f"specdec Triton kernels, {p.dtype}: GEMMs in 16-row tiles for every M, "
                                                 "split-K at fixed ranges per weight shape; attention over each token's "
                                                 "visible keys in fixed blocks and chunks")
    if p.device.type == "cuda":
        return KernelPath("cublas", False, f"cuBLAS + SDPA + torch.compile'd elementwise ops, {p.dtype}: algorithms picked per shape")
    from specdec.models import cpu_gemm, cpu_layer, cpu_quant

    packed = getattr(layers[0].self_attn.o_proj, "packed", None) is not None
    if packed:
        stack = getattr(model, "layers", None)
        problem = cpu_layer.prepare(stack, p.dtype).problem if isinstance(stack, nn.ModuleList) else "no layer stack"
        glue = "each forward's layers in one C call" if problem is None else f"PyTorch glue between the C kernels ({problem})"
        status = cpu_gemm.build_status()
        int_dot = any(cpu_quant.FORMATS[q].int_dot for q in (getattr(m, "qtype", None) for m in model.modules())
                      if q in cpu_quant.FORMATS)
        isa = status["isa"] + (f"; int8 dot products: {status['int_dot']}" if int_dot else "")
        return KernelPath("cpu-exact", True, f"specdec C kernels ({isa}), {p.dtype}: fixed order per row; {glue}")
    return KernelPath("mkl", False, f"PyTorch CPU matmul (MKL) + SDPA, {p.dtype}: blocking picked per shape")


@torch.inference_mode()
def block_equals_steps(model: nn.Module, k: int = 4, contexts: tuple[int, ...] = (64, 512)) -> bool:
    """Whether a k-token block's logits and hidden states are bitwise those of k single-token steps, after
    a prefix of each length in `contexts` (eager, dynamic cache): the property the exact path promises,
    checked on a whole forward."""
    device = next(model.parameters()).device
    ok = True
    for context in contexts:
        ids = torch.randint(0, model.config.vocab_size, (1, context + k), device=device,
                            generator=torch.Generator(device).manual_seed(3))
        cache = model.new_cache(1, context + 2 * k)
        model(ids[:, :context], torch.arange(context, device=device)[None], cache)
        block = model(ids[:, context:], torch.arange(context, context + k, device=device)[None], cache)
        cache.trim(torch.tensor([context], device=device))
        for i in range(k):
            step = model(ids[:, context + i:context + i + 1], torch.tensor([[context + i]], device=device), cache)
            ok &= torch.equal(step.logits[0, 0], block.logits[0, i]) and torch.equal(step.hidden[0, 0], block.hidden[0, i])
    return bool(ok)


def runs_triton(layer: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a forward of this decoder layer over a KV cache runs the Triton kernels (grad off)."""
    if device.type == "cpu":  # the interpreter, for a model loaded with kernels="exact" (not packed for the C kernels)
        return layer.kernels == "exact" and interpreting() and getattr(layer.self_attn.o_proj, "packed", None) is None
    if device.type != "cuda" or layer.kernels == "library":
        return False
    return layer.kernels == "exact" or (triton_problem() is None and triton_gap(layer, dtype) is None)  # "auto": no loader set it


# ----------------------------------------------------------------------------- the exact forward (Triton)


def norm_args(norm: nn.Module) -> tuple[Tensor | None, float]:
    """(weight, eps) of an RMSNorm to fuse; (None, 0) for an absent one (nn.Identity: EAGLE's layer 0)."""
    weight = getattr(norm, "weight", None)
    return weight, getattr(norm, "eps", 0.0)


def on_tensor_device(launch):
    """Run a Triton launcher with its tensors' GPU current. Triton launches on the current CUDA device,
    which is cuda:0 in any thread that never chose one (a server's decode thread) and for a model on cuda:1."""

    @wraps(launch)
    def run(*args, **kwargs):
        x = next(a for a in args if isinstance(a, Tensor))
        if not x.is_cuda:  # Triton's interpreter, on the CPU
            return launch(*args, **kwargs)
        with torch.cuda.device(x.device):
            return launch(*args, **kwargs)

    return run


def visible_order(tree_mask: Tensor) -> tuple[Tensor, Tensor]:
    """What each new token sees among the last W slots, as attention_kernel reads it: order [B, T, W]
    int32 (window offsets of the visible slots first, in slot order) and count [B, T] int32 (how many).
    tree_mask [B, T, W] bool (a causal block needs no tables: attention(visible=None)). In a captured
    forward (a tree verify, an EAGLE level) its small operations run as one compiled kernel. Ranks
    come from counting over [W, W], not from cumsums (docs/design.md, "Scans in compiled code")."""
    return fused.run(order_visible, tree_mask)


def order_visible(tree_mask: Tensor) -> tuple[Tensor, Tensor]:
    B, T, W = tree_mask.shape
    earlier = torch.ones(W, W, dtype=torch.bool, device=tree_mask.device).tril(-1)  # [w, j]: slot j comes before w
    alike = tree_mask[..., :, None] == tree_mask[..., None, :]  # [B, T, W, W]: w and j both seen, or both not
    before = (alike & earlier).sum(-1)  # [B, T, W] slots of w's kind before it
    count = tree_mask.sum(-1, keepdim=True)  # [B, T, 1]
    rank = torch.where(tree_mask, before, count + before)  # seen first, then the rest, each in slot order
    offsets = torch.arange(W, dtype=torch.int32, device=tree_mask.device).expand(B, T, W)
    order = torch.empty(B, T, W, dtype=torch.int32, device=tree_mask.device).scatter_(-1, rank, offsets)
    return order, count[..., 0].to(torch.int32)


@on_tensor_device
def run_layers_exact(layers: nn.ModuleList, x: Tensor, positions: Tensor, cache, mask: Tensor | None,
                     inv_freq: Tensor, attention_factor: float, window: int | None, taps=None) -> Tensor:
    """x [B, T, D] (EAGLE-3's layer: [B, T, 2D], see first_inputs) through decoder layers with the Triton
    kernels: q/k/v (+ norm, RoPE, q/k norm, KV write), attention, o_proj (+ residual, + the post-attention
    norm's input), gate_up (+ norm, SiLU·mul), down (+ residual, + the next layer's norm input): five
    launches per layer, one more per forward (the first layer's norm input; EAGLE-3's, three), and no
    other work (RoPE angles come from the positions inside the q/k/v kernel; a causal block needs no
    visibility tables). An RMSNorm is fused as NormedRows: the GEMM that produces the residual stream also
    writes h ⊙ w and the rows' partial sums of squares, and the GEMM that takes them scales its accumulator
    by rstd. Writes the new tokens at slots cache.lengths .. + T - 1; the caller advances cache.lengths. `taps` (llama.Taps) keeps the residual stream h entering
    the layers it names: each h is a fresh output of the GEMM before, never written again, so keeping a
    reference launches nothing."""
    from specdec.models import triton_ops as ops

    B, T, _ = x.shape
    positions = positions.expand(B, T).contiguous()  # [B, T]: the kernels read one position per token (an EAGLE level passes [B, 1])
    visible = None if mask is None else visible_order(mask)  # what each tree node sees, shared by the layers
    h, h_in = first_inputs(layers[0], x.reshape(B * T, -1).contiguous())  # [M, D], the first q/k/v's input
    D = h.shape[-1]
    for i, layer in enumerate(layers):
        if taps is not None and i in taps.layers:
            taps.states[i] = h.view(B, T, D)
        attn, mlp = layer.self_attn, layer.mlp
        k_cache, v_cache = cache.layer(i)  # [B, Hkv, S, Dh]
        q_norm = k_norm = None
        qk_eps = 0.0
        if attn.q_norm is not None:
            q_norm, k_norm, qk_eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps
        q = ops.qkv_rope_write(h_in, attn.qkv_proj.weight, attn.qkv_proj.bias, positions, inv_freq, attention_factor,
                               k_cache, v_cache, cache.lengths, T, attn.num_heads, attn.num_kv_heads,
                               q_norm, k_norm, qk_eps)  # [M, H*Dh]
        o = ops.attention(q, k_cache, v_cache, cache.lengths, T, visible, positions, window)  # [M, H*Dh]
        h, g_in = add_product(o, attn.o_proj, h, norm_args(layer.post_attention_layernorm))  # [M, D]
        g = ops.silu_linear(g_in, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)  # [M, I]
        following = norm_args(layers[i + 1].input_layernorm) if i + 1 < len(layers) else (None, 0.0)
        h, h_in = add_product(g, mlp.down_proj, h, following)  # [M, D]
    return h.view(B, T, D)


def first_inputs(layer: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """(the residual stream h [M, D], the first layer's q/k/v input) from a forward's input x [M, *]. A decoder
    layer: h = x, and its input norm as NormedRows (fused into the GEMM; none for EAGLE's identity norm).
    EAGLE-3's layer (it has a `hidden_norm`): x = [embedding ; h] [M, 2D], and q/k/v read the two halves
    normalised apart, [input_layernorm(embedding) ; hidden_norm(h)] [M, 2D] (two rstds: no NormedRows)."""
    from specdec.models import triton_ops as ops

    if hasattr(layer, "hidden_norm"):
        embedded, h = x.chunk(2, dim=-1)
        h = h.contiguous()
        norm_e, norm_h = layer.input_layernorm, layer.hidden_norm
        return h, torch.cat([ops.rms_norm(embedded.contiguous(), norm_e.weight, norm_e.eps), ops.rms_norm(h, norm_h.weight, norm_h.eps)], -1)
    norm_weight, eps = norm_args(layer.input_layernorm)
    return x, (x if norm_weight is None else ops.prenorm(x, norm_weight, eps))


def add_product(x: Tensor, linear: nn.Module, h: Tensor, next_norm: tuple[Tensor | None, float]):
    """(h + x @ W^T [M, D], the next norm's input): the residual add and the next norm fused into the GEMM;
    for a tensor-parallel shard (row parallel), the ranks' float32 partial products are gathered and added to
    h in rank order by one more kernel (tensor_parallel.py: an all-reduce's order would depend on M)."""
    from specdec.models import triton_ops as ops

    if linear.split is None:
        return ops.linear(x, linear.weight, linear.bias, residual=h, next_norm=next_norm)
    part = ops.linear(x, linear.weight, linear.bias, out_dtype=torch.float32)  # [M, D], this rank's partial sum
    return ops.add_partials(linear.split.gather_ranks(part), h, next_norm)


@on_tensor_device
def norm_exact(norm: nn.Module, x: Tensor) -> Tensor:
    """RMSNorm of x [..., D] per row (the model's final norm)."""
    from specdec.models import triton_ops as ops

    D = x.shape[-1]
    return ops.rms_norm(x.reshape(-1, D).contiguous(), norm.weight, norm.eps).view(x.shape)


@on_tensor_device
def logits_exact(lm_head: nn.Module, h: Tensor) -> Tensor:
    """h [B, T, D] -> float32 logits [B, T, V], accumulated and stored in fp32."""
    from specdec.models import triton_ops as ops

    B, T, D = h.shape
    y = ops.linear(h.reshape(B * T, D).contiguous(), lm_head.weight, lm_head.bias, out_dtype=torch.float32)
    if getattr(lm_head, "split", None) is not None:  # a tensor-parallel vocabulary shard
        y = lm_head.split.combine(y)
    return y.view(B, T, -1)

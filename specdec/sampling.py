"""Logits -> probabilities (temperature, top-k, top-p, min-p), counter-based random numbers, and
sampling from probabilities with given uniforms.

Everything a decode step calls here is graph-safe: no host synchronisation and no data-dependent
shapes, so the step can run inside a CUDA graph capture. That is why:
- random numbers are a stateless hash of (seed, counter) rather than a torch.Generator: a row's numbers
  depend only on its own seed and counter (not on which rows share the batch), are bitwise identical on
  CPU and CUDA, and the counter lives on the device with the rest of the row's state;
- sampling takes uniforms (inverse CDF) instead of a generator;
- each row may carry its own sampling parameters (`RowSampling`, device tensors);
- top-k and top-p find their cut-off by a radix select (fixed shapes) rather than sorting the vocabulary.

Lossless speculative sampling reproduces whatever distribution `logits_to_probs` gives for the
target; the drafter's q may be anything with q(x) > 0 wherever it proposes x.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.config import SamplingParams
from specdec.transfer import to_device

# ---- Counter-based random numbers -------------------------------------------------------------------
# splitmix64 (Steele et al. 2014), emulated with torch int64: addition, multiplication and xor wrap
# exactly like unsigned 64-bit arithmetic; only the right shift needs masking to be logical.


def as_int64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = as_int64(0x9E3779B97F4A7C15)  # splitmix64's Weyl increment
MIX1 = as_int64(0xBF58476D1CE4E5B9)
MIX2 = as_int64(0x94D049BB133111EB)


def shift_right(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: Tensor) -> Tensor:
    """splitmix64's finaliser: a bijection on 64-bit patterns with full avalanche."""
    z = (z ^ shift_right(z, 30)) * MIX1
    z = (z ^ shift_right(z, 27)) * MIX2
    return z ^ shift_right(z, 31)


def uniforms(seed: Tensor, offset: Tensor, n: int) -> Tensor:
    """seed [B] int64, offset [B] int64 -> [B, n] float32 in [0, 1): row b's numbers number offset[b] ..
    offset[b] + n - 1 of the stream keyed by seed[b]. Number i of a stream is splitmix64 at state
    mix64(seed) + i * GOLDEN (the seed is mixed first so that nearby seeds give unrelated streams); its top
    24 bits make the float (exact, the resolution of torch.rand's float32). A caller advances offset by n
    after each use so no number is used twice."""
    counter = offset[:, None] + torch.arange(n, device=offset.device)  # [B, n]
    z = mix64(mix64(seed)[:, None] + counter * GOLDEN)  # [B, n]
    return shift_right(z, 40).float() * 2.0**-24


def seed_of(seed: int | None) -> int:
    """A row's random-number seed: the request's (taken modulo 2**63, so it fits an int64), or a fresh one."""
    return secrets.randbits(63) if seed is None else seed % (1 << 63)


# ---- Sampling parameters ----------------------------------------------------------------------------


TOP_K_CAP = 1 << 24  # past any vocabulary: a larger top_k keeps every token, as this one does


def sampling_columns(params: Sequence[SamplingParams], device: torch.device) -> Tensor:
    """[n, 4] temperature, top_k, top_p and min_p of each row, in one host-to-device copy (top_k as a float32:
    exact up to TOP_K_CAP)."""
    return to_device([[s.temperature, min(s.top_k, TOP_K_CAP), s.top_p, s.min_p] for s in params], device, torch.float32)


@dataclass
class RowSampling:
    """Each row's own sampling parameters, as device tensors a captured step reads (update in place).

    max_top_k is an optional host-side promise: every row's top_k is 0 (off) or at most max_top_k. With
    it, top-k runs as one torch.topk(max_top_k), or not at all for 0, instead of a radix select per row
    (about half the filtering cost when no row uses top-k). None (the default) promises nothing.
    A captured graph bakes it in, so key graphs by it; a row that breaks the promise is cut to
    max_top_k tokens."""

    temperature: Tensor  # [B] float32, 0 = greedy
    top_k: Tensor  # [B] int64, 0 = off
    top_p: Tensor  # [B] float32, 1 = off
    min_p: Tensor  # [B] float32, 0 = off
    max_top_k: int | None = None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str) -> RowSampling:
        values = sampling_columns(params, torch.device(device))  # [n, 4]
        temperature, top_k, top_p, min_p = (values[:, j].clone() for j in range(4))  # each its own tensor, updated in place
        return cls(temperature, top_k.long(), top_p, min_p)

    def put(self, index: Tensor, params: Sequence[SamplingParams]) -> None:
        """Rows index [n] take these parameters (in place: a captured step reads these tensors)."""
        values = sampling_columns(params, index.device)  # [n, 4]
        self.temperature[index] = values[:, 0]
        self.top_k[index] = values[:, 1].long()
        self.top_p[index] = values[:, 2]
        self.min_p[index] = values[:, 3]

    def index(self, rows: Tensor | slice | int | list[int]) -> RowSampling:
        """The parameters of a subset of rows (the promise holds for them too)."""
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows], self.max_top_k)

    @property
    def greedy(self) -> Tensor:
        """[B] bool: rows that take the argmax."""
        return self.temperature == 0


# ---- Logits -> probabilities ------------------------------------------------------------------------
# CPU cost, ms per call (1 thread, V = 49152, temperature 0.7, logits randn * 4; best of 2 x 15
# interleaved runs on a shared 2-core VM, so +-30 %). old = before this rewrite (top-p sorted the
# vocabulary); "rows" = RowSampling as a decode step passes it, greedy-row handling left to the verifier.
#   rows                                            1       5      11      33
#   argmax (greedy, for scale)                   0.05    0.28    0.55    1.75
#   top-p 0.95             old                   4.66   23.83   52.05  160.65
#                          SamplingParams        0.86    3.88    8.37   42.72
#                          rows                  1.73   11.92   18.10   70.22
#                          rows, max_top_k=0     0.84    4.96    7.33   33.29
#   top-k 50, top-p 0.95   old                   1.41    9.63   18.98   54.58   (top-k masked the sort: cheap)
#                          SamplingParams        1.10    6.15   15.29   47.65
#                          rows                  1.76    7.65   18.28   93.69
#                          rows, max_top_k=50    1.06    5.69    9.69   45.58
# Verification at top-p 0.95 (verify.verify_chain vs the old logits_to_probs + rejection_sample), ms:
#   B=1 k=4: greedy 0.30, old 25.6, new 9.4 (4.9 with max_top_k=0); B=1 k=10: 0.59, 50.4, 23.1 (12.3);
#   B=3 k=10: 1.66, 155, 78 (39). A 10-node tree of depth 4 (verify_tree, max_children 4, max_top_k=0):
#   greedy 0.9, old 63 (q) / 65 (deterministic nodes), new 16 / 11.5 (51 / 21 with the default bounds N).
# About half of the new cost is page faults on fresh full-size tensors (glibc hands them back to the
# OS); with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ raised a filtered row costs ~0.6 ms.


def logits_to_probs(logits: Tensor, s: SamplingParams | RowSampling) -> Tensor:
    """logits [B, ..., V] -> probs [B, ..., V] float32. With SamplingParams every row uses them; with
    RowSampling row b of the logits uses row b's parameters. Greedy rows give a one-hot at the argmax.

    Order as in common samplers: temperature, then top-k (the k most likely tokens), then top-p (the
    smallest set of most likely tokens whose mass, after top-k, reaches top_p), then min-p (tokens at
    least min_p times as likely as the most likely), then renormalise. Ties: a token is kept when the
    tokens strictly more likely than it number fewer than k and weigh less than top_p, so tokens tied
    with the last one kept are kept too (the kept set never depends on an order among equals).
    Graph-safe (no host sync) for both kinds of parameters."""
    logits = logits.float()
    if isinstance(s, SamplingParams):
        if s.greedy:
            return one_hot_argmax(logits)
        probs = (logits / s.temperature).softmax(-1)
        if s.top_k == 0 and s.top_p == 1 and s.min_p == 0:
            return probs

        def column(value: float, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.full(probs.shape[:-1] + (1,), value, dtype=dtype, device=probs.device)

        top_k = min(s.top_k, TOP_K_CAP)
        return keep_likely(probs, column(top_k, torch.long), column(s.top_p) if s.top_p < 1 else None,
                           column(s.min_p) if s.min_p > 0 else None, max_top_k=top_k)
    return torch.where(s.greedy.view(-1, *[1] * (logits.dim() - 1)), one_hot_argmax(logits), sampled_probs(logits, s))


def sampled_probs(logits: Tensor, s: RowSampling) -> Tensor:
    """logits [B, ..., V] -> probs [B, ..., V] for the sampled rows of s; greedy rows get their softmax
    (temperature 1, filters applied), for callers that treat greedy rows separately anyway."""
    def column(t: Tensor) -> Tensor:  # [B] -> [B, ..., 1], broadcasting over logits' other dims
        return t.view(-1, *[1] * (logits.dim() - 1)).expand(*logits.shape[:-1], 1).contiguous()

    probs = (logits.float() / column(torch.where(s.greedy, 1.0, s.temperature))).softmax(-1)
    return keep_likely(probs, column(s.top_k), column(s.top_p), column(s.min_p), max_top_k=s.max_top_k)


TOPK_CHUNK = 1024  # the first stage's slice: short enough that torch.topk gives each slice one thread block


def topk_wide(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) [..., k] of the k largest entries of x [..., V] along the last dimension, largest
    first, as torch.topk. On a GPU over a wide vocabulary, in two stages (`topk_in_slices`): torch.topk
    over one 49k-entry row runs a radix select in one thread block (40 us for 16 rows on an H200); a slice
    per block spreads it over the GPU (Medusa's ranking, sampling's top-k cut; an EAGLE tree's children take
    topk_log_probs). On a CPU, one stage (two were 1.4x
    slower). Among equal values the index picked may differ from torch.topk's."""
    if x.is_cuda and x.shape[-1] > 4 * TOPK_CHUNK and k <= TOPK_CHUNK:
        return topk_in_slices(x, k, TOPK_CHUNK)
    return x.topk(k, dim=-1)


def topk_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(log-probabilities float32, indices) [..., k] of the k most likely entries of softmax(logits [..., V]),
    most likely first: a draft tree's children. On CUDA two Triton kernels (models/triton_topk.py: about
    ten PyTorch kernels fewer per tree level); elsewhere log_softmax, then topk_wide."""
    if logits.is_cuda:
        from specdec.models.kernels import say_once, triton_problem

        problem = triton_problem()
        if problem is None:
            from specdec.models.triton_topk import topk_log_softmax

            return topk_log_softmax(logits, k)
        say_once(f"a draft tree's top-k runs as PyTorch operations, about ten kernels more per level ({problem})")
    return topk_wide(logits.float().log_softmax(-1), k)


def topk_in_slices(x: Tensor, k: int, chunk: int) -> tuple[Tensor, Tensor]:
    """torch.topk(x, k) [..., k] as the k largest of each `chunk`-entry slice of x [..., V], then the k
    largest of those (k <= chunk)."""
    V = x.shape[-1]
    n = -(-V // chunk)
    padded = torch.nn.functional.pad(x, (0, n * chunk - V), value=float("-inf"))  # [..., n * chunk]
    values, index = padded.view(*x.shape[:-1], n, chunk).topk(k, dim=-1)  # [..., n, k]
    index = index + torch.arange(0, n * chunk, chunk, device=x.device)[:, None]  # into [0, n * chunk)
    values, pick = values.flatten(-2).topk(k, dim=-1)  # [..., k]
    return values, index.flatten(-2).gather(-1, pick)


def greedy_tokens(logits: Tensor) -> Tensor:
    """[..., V] -> [...] the argmax: the first maximum, as everywhere in specdec. Through max's indices,
    which follow argmax's rule: on the CPU (one thread) torch's argmax took 71 us over one row of 49,152
    float32 logits, max 25 us."""
    return logits.max(-1).indices


def one_hot_argmax(logits: Tensor) -> Tensor:
    """[..., V] -> float32 one-hot at the argmax (greedy_tokens)."""
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, greedy_tokens(logits)[..., None], 1.0)


def keep_likely(probs: Tensor, top_k: Tensor, top_p: Tensor | None, min_p: Tensor | None,
                max_top_k: int | None = None) -> Tensor:
    """probs [..., V] -> the distribution restricted by top-k, top-p and min-p, renormalised. The
    parameters are [..., 1] tensors (per row top_k 0, top_p 1 and min_p 0 are off; None: off for every
    row); max_top_k as in RowSampling.

    Why not sort: sorting 49k probabilities at every verified position dominated sampled verification
    on a CPU. Each filter is a threshold on the probability instead, so the three combine into one
    `floor`, the smallest float32 bit pattern kept (for p >= 0 bit patterns order like the values)."""
    V = probs.shape[-1]
    keys = probs.view(torch.int32)  # [..., V]
    # Histogram sums: float32 on a CPU, whose scatter-add adds in order (deterministic, and no float64
    # copy of the probabilities); float64 on CUDA, whose scatter-add adds in no fixed order: a different
    # order then moves a sum by ~1e-16, which in practice never moves a cut.
    acc = torch.float64 if probs.is_cuda else torch.float32
    floor = torch.zeros_like(probs[..., :1], dtype=torch.int32)  # [..., 1]
    if max_top_k is None:
        droppable = V - torch.where(top_k > 0, top_k.clamp(max=V), V)  # [..., 1] how many tokens top-k drops
        ones = torch.ones(1, dtype=acc, device=probs.device).expand_as(probs)  # [..., V] unit weights (exact counts)
        floor = select_threshold(keys, ones, droppable).int()
    elif max_top_k > 0:
        largest = topk_wide(probs, min(max_top_k, V))[0]  # [..., K] descending
        kth = largest.gather(-1, (top_k - 1).clamp(0, largest.shape[-1] - 1)).view(torch.int32)  # [..., 1]
        floor = torch.where(top_k > 0, kth, 0)
    if top_p is not None:
        mass = (probs if max_top_k == 0 else zero_below(probs, floor)).to(acc)  # [..., V] what top-k kept
        droppable = mass.sum(-1, keepdim=True, dtype=torch.float64) * (1 - top_p.double())  # [..., 1] may go
        floor = torch.maximum(floor, select_threshold(keys, mass, droppable).int())
    top = probs.amax(-1, keepdim=True)  # [..., 1]
    if min_p is not None:
        floor = torch.maximum(floor, (min_p * top).view(torch.int32))
    floor = torch.minimum(floor, top.view(torch.int32))  # the most likely token always stays
    kept = zero_below(probs, floor)
    return kept.div_(kept.sum(-1, keepdim=True))


def zero_below(probs: Tensor, floor: Tensor) -> Tensor:
    """probs [..., V] float32 >= 0 with the entries whose bit pattern is below floor [..., 1] set to 0.
    In bit arithmetic, because torch.where is several times slower on a CPU: (floor - 1 - key) >> 31
    is all ones where key >= floor and all zeros elsewhere."""
    keys = probs.view(torch.int32)
    mask = (floor - 1) - keys  # [..., V] negative where key >= floor (in place below: fewer page faults)
    mask >>= 31
    mask &= keys
    return mask.view(torch.float32)


KEY_BITS = 30  # a probability's float32 bit pattern is below 2**30 (p <= 1.0 = 0x3F800000)


def select_threshold(keys: Tensor, weights: Tensor, droppable: Tensor) -> Tensor:
    """keys [..., V] int32 in [0, 2**30), weights [..., V] >= 0, droppable [..., 1] -> floor
    [..., 1] int64: the smallest v with weight(keys <= v) > droppable, so keeping keys >= floor drops
    the least elements whose total weight stays within droppable, always together with their ties. Unit
    weights and droppable V - k keep the top k; masses and droppable (1 - top_p) * total keep the
    top-p nucleus.

    A radix select with fixed shapes, most significant digit first: a histogram of the keys' digit finds
    the floor's digit, then only keys that start with the digits found so far count. One scatter-add and
    one small cumsum per digit, no sort; digits of up to 10 bits (3 passes for a real vocabulary) keep
    the histograms small next to V. Sums are in the weights' dtype."""
    bits = max(4, min(10, keys.shape[-1].bit_length() - 3))  # digit width
    droppable = droppable.to(weights.dtype)
    floor = torch.zeros_like(keys[..., :1], dtype=torch.long)  # [..., 1] the floor's digits found so far
    below = torch.zeros_like(droppable)  # [..., 1] weight of the keys below them
    # Two full-size buffers reused by every pass: on a CPU a fresh tensor of this size costs page faults
    # that take longer than the arithmetic. int64: scatter-add indices.
    digit, spill = torch.empty_like(keys, dtype=torch.long), torch.empty_like(keys, dtype=torch.long)  # [..., V] each
    for top in range(KEY_BITS, 0, -bits):
        low = max(0, top - bits)
        width = top - low  # this digit's bits
        torch.bitwise_right_shift(keys, low, out=digit)  # the digits found so far, then this one
        if top < KEY_BITS:
            # Keys that do not start with the floor's digits go to 2**width + their digit, out of the way
            # (sending them all to one bin would serialise the scatter-add on it): after the xor such a
            # key is >= 2**width, and the others are just their digit.
            digit ^= floor << width
            torch.bitwise_and(digit, (1 << width) - 1, out=spill).add_(1 << width)
            torch.minimum(digit, spill, out=digit)
        hist = histogram(digit, weights, 2 << width)[..., : 1 << width]  # [..., 2**width]
        cum = below + hist.cumsum(-1)  # [..., 2**width] weight up to the end of each digit value
        d = torch.searchsorted(cum, droppable, right=True).clamp(max=(1 << width) - 1)  # [..., 1] digits that may go
        below = (cum - hist).gather(-1, d)
        floor = (floor << width) | d
    return floor


def histogram(bin_of: Tensor, weights: Tensor, bins: int) -> Tensor:
    """bin_of [..., V] int, weights [..., V] -> [..., bins] total weight per bin."""
    hist = torch.zeros(*bin_of.shape[:-1], bins, dtype=weights.dtype, device=weights.device)
    return hist.scatter_add_(-1, bin_of.long(), weights)


# ---- Sampling ---------------------------------------------------------------------------------------


SAMPLE_BLOCK = 256  # tokens per block of the two-level inverse CDF on CUDA (sample)


def sample(probs: Tensor, u: Tensor, block: int | None = None) -> Tensor:
    """probs [..., V] (need not sum to 1), u [...] in [0, 1) -> token ids [...] by inverse CDF: the first
    token whose cumulative mass exceeds u * total. A zero-probability token adds nothing to the
    cumulative mass, so it is never returned.

    On CUDA in two levels (`block`: SAMPLE_BLOCK there, the whole vocabulary elsewhere): a block of
    tokens by the blocks' masses, then a token of that block by its tokens' masses, with what is left of
    u; in exact arithmetic the same token. Two short scans instead of one over the vocabulary, because
    torch.compile (inductor) cannot generate its split scan kernel for a cumsum over 49152 tokens when
    the batch size is dynamic: the server's verification then ran as separate kernels. On the CPU one
    level: the second level's few operations cost more there than the scan they shorten."""
    p = probs.float()
    size = block or (SAMPLE_BLOCK if p.is_cuda else p.shape[-1])
    if size >= p.shape[-1]:
        return invert_cdf(p, u)[0]
    pad = -p.shape[-1] % size
    blocks = (torch.nn.functional.pad(p, (0, pad)) if pad else p).unflatten(-1, (-1, size))  # [..., nb, size]
    chosen, rest = invert_cdf(blocks.sum(-1), u)  # [...] each
    index = chosen[..., None, None].expand(*chosen.shape, 1, size)  # [..., 1, size]
    token, _ = invert_cdf(blocks.gather(-2, index).squeeze(-2), rest)  # [...]
    return (chosen * size + token).clamp(max=probs.shape[-1] - 1)


def invert_cdf(weights: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """weights [..., N] >= 0 (a positive total), u [...] in [0, 1) -> (i, rest), each [...]: the first
    index whose cumulative weight exceeds u * total, and where u * total falls within i's own interval,
    rescaled to [0, 1) (uniform there when u is uniform)."""
    cdf = weights.cumsum(-1)  # [..., N]
    total = cdf[..., -1:]  # [..., 1]
    x = torch.minimum(u[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))  # [..., 1] < total
    i = torch.searchsorted(cdf, x, right=True).clamp_(max=weights.shape[-1] - 1)  # [..., 1]
    w = weights.gather(-1, i)  # [..., 1] > 0 unless the row is all zeros
    rest = (x - cdf.gather(-1, i) + w).div_(w.clamp(min=torch.finfo(w.dtype).tiny)).clamp_(0, 1 - 2**-24)  # [..., 1]
    return i.squeeze(-1), rest.squeeze(-1)

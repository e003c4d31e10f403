"""specdec's CPU kernels: skinny_gemm.c (linear layers; int_dot.c for a drafter's 4-bit blocks with int8
activations), cpu_attention.c (attention over the KV
cache), cpu_layer.c (whole decoder layers from those two, see cpu_layer.py) and cpu_threads.c (their
threads), compiled on first use into one library, called through ctypes.

Both kernels give every row (every query) one summation order whatever the number of rows beside it
and whatever the threads, which makes greedy speculative decoding exactly equal to plain decoding on
the CPU in float32 and bfloat16 (see skinny_gemm.c, cpu_attention.c). Decode and verify steps
multiply a few rows by every weight, so they are bound by reading the weights: the kernel streams
weights packed into contiguous column panels once per call for all rows (bfloat16 panels are half the
bytes), where PyTorch's BLAS reads a float32 [out, in] weight at 7 GB/s or less and its bfloat16
path is slower still.

Kernel / F.linear (MKL; oneDNN for bfloat16), median ms per product on the default model's shapes,
each call on the next of enough weight copies to overflow L3 (weights come from memory, as in
decoding); AMD EPYC (Zen 3, AVX2, 2.45 GHz), 1 thread, the 2 cores shared with other jobs (load 2-3);
`python -m specdec.models.cpu_gemm 1`:

    float32      M=1          4            16           64           256            512
    576 x 576    0.11/0.15    0.16/0.23    0.27/0.32    0.72/0.73    2.59/2.48      4.05/4.27
    576 x 960    0.15/0.22    0.23/0.41    0.34/0.49    1.23/1.40    4.31/4.08      9.19/9.01
    576 x 3072   0.49/0.78    0.82/1.39    1.48/2.02    3.89/4.71    13.6/14.6      26.3/27.9
    1536 x 576   0.23/0.29    0.38/0.58    0.76/0.88    1.92/1.93    6.64/6.42      12.9/12.7
    576 x 49152  5.28/10.1    10.1/27.8    18.7/37.3    55.1/83.9    211/256        490/570
    bfloat16
    576 x 576    0.08/0.11    0.11/0.34    0.33/1.33    0.83/4.98    3.18/29.0      5.17/41.9
    576 x 960    0.09/0.15    0.14/0.53    0.47/2.14    1.30/8.54    4.48/33.8      8.38/66.1
    576 x 3072   0.21/0.41    0.44/1.83    1.54/6.99    3.84/26.9    13.8/107       26.1/216
    1536 x 576   0.12/0.21    0.20/0.73    0.75/2.86    2.00/11.3    5.92/44.9      11.8/90.1
    576 x 49152  4.33/8.92    7.37/29.9    23.7/112     56.7/403     252/1929       539/5236

The kernel is faster than F.linear, or within a few per cent of it (large products are compute-bound
at about 30 FLOP per cycle, as MKL's), and it is the only row-invariant one, so every inference
product of a packed layer goes through it: nothing falls back to MKL. (On 2 threads of the loaded
machine MKL's OpenMP calls also stalled for ~15 ms at times, waiting for a descheduled thread; the
kernel's threads do not wait for each other, see cpu_threads.c.)

The build: `-O3 -march=native -pthread -ffp-contract=off`, cached under the specdec cache keyed by
the sources, the compiler and its version, the flags and the CPU's model name and flags (a native
build is never reused on another CPU). An unwritable or noexec cache builds into a private temporary
folder instead (saying so once); a missing compiler or a failed build is said once on stderr and kept
in `build_status()`, and callers then use PyTorch's products (not row-invariant: greedy speculative
output may then differ from plain decoding).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from functools import cache, lru_cache
from pathlib import Path

import torch
from torch import Tensor

from specdec.paths import cache_root

NR = 16  # panel width, as in skinny_gemm.c
SOURCES = [Path(__file__).with_name(name) for name in ("skinny_gemm.c", "int_dot.c", "cpu_attention.c", "cpu_layer.c", "cpu_threads.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_bf16.h", "cpu_f16.h")]  # part of the cache key, not of the command line
FLAGS = ["-O3", "-march=native", "-pthread", "-ffp-contract=off", "-fPIC", "-shared"]
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # enum in skinny_gemm.c
BLOCK_TYPES = {"Q4_0": 3, "Q4_1": 4, "Q8_0": 5, "Q4_0-A8": 6, "Q4_1-A8": 7}  # GGUF block formats in uint8 panels (cpu_quant.py), same enum
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes the kernels read and write
STATUS: dict = {"available": False, "isa": None, "int_dot": None, "library": None, "error": None}
CHANGES = [0]  # how often something the C code's prepared arguments are taken from may have changed (note_change)


def note_change(*_) -> None:
    """A Linear's packs were set (linear.Linear), or a module or a parameter was registered on any module (a
    layer, a norm or its weight replaced: torch's global registration hooks, below): cpu_layer.prepare
    rebuilds its arguments at the next forward. Counts every model built too, which costs a rebuild."""
    CHANGES[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(note_change)
torch.nn.modules.module.register_module_parameter_registration_hook(note_change)

KERNEL_THREADS = [0]  # the kernels' threads inside `kernels_own_threads`; 0: torch.get_num_threads()


class BuildError(Exception):
    """Why no kernel library could be built or loaded (one line)."""


@cache
def say_once(message: str) -> None:
    """Print a one-line note about the CPU kernels on stderr, once per process and message."""
    print(f"specdec: {message}", file=sys.stderr)


def cpu_identity() -> str:
    """The CPU's model name and feature flags (from /proc/cpuinfo; platform.processor() is often empty)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = fields.get("flags", fields.get("Features", ""))  # x86, arm
    return f"{fields.get('model name', platform.processor())} | {flags} | {platform.machine()}"


def compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (subprocess.SubprocessError, OSError):
        return ""


def cache_key(compiler: str, flags: list[str], cpu: str) -> str:
    parts = [s.read_bytes() for s in SOURCES + HEADERS]
    parts += [compiler.encode(), compiler_version(compiler).encode(), " ".join(flags).encode(), cpu.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def compile_into(folder: Path, name: str, compiler: str, flags: list[str]) -> Path:
    """The library built into folder/name (kept if already there). OSError: the folder is unusable;
    BuildError: the compiler failed."""
    target = folder / name
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so.tmp", delete=False) as f:  # OSError if read-only
        tmp = Path(f.name)
    try:
        command = [compiler, *flags, *map(str, SOURCES), "-o", str(tmp), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        tmp.rename(target)
    except subprocess.CalledProcessError as e:
        raise BuildError(f"{Path(compiler).name} failed: {(e.stderr.strip().splitlines() or ['?'])[-1]}") from None
    except subprocess.TimeoutExpired:
        raise BuildError(f"{Path(compiler).name} timed out") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.specdec_isa.restype = ctypes.c_char_p
    lib.specdec_int_dot_isa.restype = ctypes.c_char_p
    lib.skinny_gemm.restype = None
    lib.skinny_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p] + [ctypes.c_int] * 5
    lib.attend.restype = None
    lib.attend.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_ssize_t] * 11 + [ctypes.c_int]
    lib.specdec_layers.restype = ctypes.c_int
    lib.specdec_layers.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.specdec_dequantize_rows.restype = None
    lib.specdec_dequantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.specdec_rescore.restype = None
    lib.specdec_rescore.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.specdec_rms_norm.restype = None
    lib.specdec_rms_norm.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    return lib


def private_temp_folder() -> Path:
    """A folder of this user's in the temporary directory, reused across runs; OSError if someone else
    could write to it (they could plant a library there)."""
    folder = Path(tempfile.gettempdir()) / f"specdec-kernels-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{folder} is not a private folder")
    return folder


def build(flags: list[str]) -> ctypes.CDLL:
    """Compile (or reuse) and load the kernels: in the specdec cache, else in a private temporary folder."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise BuildError("no C compiler")
    if sys.platform != "linux":
        raise BuildError(f"only built on Linux, not {sys.platform}")
    name = f"specdec_cpu-{cache_key(compiler, flags, cpu_identity())}.so"
    cached = cache_root() / "kernels"
    try:
        return load(compile_into(cached, name, compiler, flags))
    except OSError as e:  # read-only cache (cannot write) or noexec mount (cannot map)
        problem = e
    try:
        folder = private_temp_folder()
        lib = load(compile_into(folder, name, compiler, flags))
    except OSError as e:
        raise BuildError(f"cannot write or load the library in {cached} ({problem}) nor in a temporary folder ({e})") from None
    say_once(f"CPU kernel cache {cached} unusable ({problem}): using {folder} instead")
    return lib


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The kernels, built once per process; None (said once on stderr, kept in build_status()) when
    they cannot be built."""
    try:
        lib = build(FLAGS)
    except BuildError as e:
        STATUS.update(available=False, isa=None, int_dot=None, library=None, error=str(e))
        say_once(f"CPU kernel unavailable ({e}): falling back to PyTorch's matmul; "
                 "greedy speculative output may differ from plain decoding")
        return None
    STATUS.update(available=True, isa=lib.specdec_isa().decode(), int_dot=lib.specdec_int_dot_isa().decode(),
                  library=lib._name, error=None)
    return lib


def threads() -> int:
    """Threads the kernels run on: PyTorch's intra-op count, or what it was when `kernels_own_threads` began."""
    return KERNEL_THREADS[0] or torch.get_num_threads()


@contextmanager
def kernels_own_threads():
    """Inside: the kernels keep PyTorch's thread count, and PyTorch's own operations run on one thread.
    Between kernel calls a step makes small PyTorch operations (argmax and softmax over logits, top-k,
    gathers); on two threads their OpenMP team waited for a core the kernels' idle workers were still
    spinning on (cpu_threads.c), and an EAGLE tree's log_softmax over [10, 8192] took 3.7 ms (median of
    117) on the 2-core CI-like CPU. One thread is also plenty for their sizes."""
    outer, kept = torch.get_num_threads(), KERNEL_THREADS[0]
    KERNEL_THREADS[0] = kept or outer
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(outer)
        KERNEL_THREADS[0] = kept


def available() -> bool:
    return library() is not None


def build_status() -> dict:
    """{available: bool, isa: "avx2" | "portable" | None, int_dot: the `-A8` formats' integer sums ("avx-vnni",
    "avx512-vnni", "avx2", "portable") | None, library: path | None, error: str | None}."""
    library()
    return dict(STATUS)


BF16_COLUMNS = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]  # BF16_COLUMN in skinny_gemm.c (its own inverse)


def pack(weight: Tensor) -> Tensor:
    """weight [N, K] (an nn.Linear's, float32 or bfloat16) -> panels [ceil(N/NR), K, NR] of the same
    dtype, zero-padded columns; in a bfloat16 panel, columns 4-7 and 8-11 of each row trade places
    (the order in which AVX2 widens them, see skinny_gemm.c)."""
    N, K = weight.shape
    padded = torch.zeros(-(-N // NR) * NR, K, dtype=weight.dtype)
    padded[:N] = weight.detach()
    panels = padded.view(-1, NR, K).transpose(1, 2)  # [N/NR, K, NR]
    return (panels[..., BF16_COLUMNS] if weight.dtype == torch.bfloat16 else panels).contiguous()


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


def pad_bias(bias: Tensor | None, packed: Tensor) -> Tensor | None:
    """bias [N] -> float32 [ceil(N/NR)*NR], zero-padded, as the kernel reads it (None stays None)."""
    if bias is None:
        return None
    return torch.nn.functional.pad(bias.detach().float(), (0, packed.shape[0] * NR - bias.shape[0])).contiguous()


def weight_type(packed: Tensor, qtype: str | None = None) -> int:
    """skinny_gemm's weight type of panels: a GGUF block format by name (uint8 panels), else by dtype."""
    return BLOCK_TYPES[qtype] if qtype is not None else WEIGHT_TYPES[packed.dtype]


def gemm(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int, scales: Tensor | None = None,
         out_dtype: torch.dtype | None = None, qtype: str | None = None) -> Tensor:
    """x [..., K] float32 or bfloat16 -> [..., out_features] = x @ W.T + bias in out_dtype (default x's
    dtype), accumulated in float32, with W packed by `pack` (float32 or bfloat16 panels), `pack_int8`
    (then `scales` is given) or `cpu_quant.pack_blocks` (then `qtype` names the GGUF format), bias
    padded by `pad_bias`. (Lean: a decode forward makes ~120 of these calls.)"""
    x = x.contiguous()
    K, N = x.shape[-1], packed.shape[0] * NR
    y = x.new_empty(x.shape[:-1] + (N,), dtype=out_dtype or x.dtype)
    library().skinny_gemm(x.data_ptr(), x.dtype == torch.bfloat16, packed.data_ptr(), weight_type(packed, qtype),
                          None if scales is None else scales.data_ptr(), None if bias is None else bias.data_ptr(),
                          y.data_ptr(), y.dtype == torch.bfloat16, x.shape[:-1].numel(), K, N, threads())
    return y if N == out_features else y[..., :out_features]


def rescore(logits: Tensor, hidden: Tensor, weight: Tensor, scale: Tensor, k: int) -> Tensor:
    """logits [..., V] float32, rescored in place: each row's k best (k <= 16) become scale[v] *
    (hidden[row] . weight[v]), with hidden [..., D] and int8 rows weight [V, D], scale [V] (int_dot.c)."""
    assert logits.dtype == torch.float32 and logits.is_contiguous() and weight.dtype == torch.int8
    hidden = hidden.float().contiguous()
    V, D = weight.shape
    library().specdec_rescore(logits.data_ptr(), hidden.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                              logits.shape[:-1].numel(), V, D, k)
    return logits


SHAPES = [(576, 576), (576, 576 + 2 * 192), (576, 2 * 1536), (1536, 576), (576, 49152)]  # (K, N): the default model's


def measure_against_mkl(dtype: torch.dtype, rows=(1, 4, 16, 64, 256, 512), repeats: int = 7) -> list[str]:
    """The table in this module's docstring: median ms per product of the kernel and of F.linear (MKL),
    alternating, each call on the next of enough weight copies to overflow a 32 MiB L3 (as in
    decoding, where weights come from memory)."""
    import time

    lines = []
    for K, N in SHAPES:
        copies = -(-64 * 2**20 // (N * K * torch.finfo(dtype).bits // 8))
        weights = [torch.randn(N, K).to(dtype) for _ in range(copies)]
        packs = [pack(w) for w in weights]
        cells = []
        for M in rows:
            x = torch.randn(M, K).to(dtype)
            times: dict[str, list[float]] = {"kernel": [], "mkl": []}
            for i in range(repeats + 1):  # the first round warms up
                start = time.perf_counter()
                gemm(x, packs[i % copies], None, N)
                middle = time.perf_counter()
                torch.nn.functional.linear(x, weights[i % copies])
                times["kernel"].append(middle - start)
                times["mkl"].append(time.perf_counter() - middle)
            cells.append(" ".join(f"{sorted(times[n][1:])[repeats // 2] * 1e3:7.3f}" for n in ("kernel", "mkl")))
        lines.append(f"{K:>4} x {N:<5} " + " ".join(cells))
    return lines


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    print(build_status(), f"threads={torch.get_num_threads()}")
    for dtype in KERNEL_DTYPES:
        print(dtype, "K x N, then kernel and MKL ms for M = 1, 4, 16, 64, 256, 512")
        print("\n".join(measure_against_mkl(dtype)))

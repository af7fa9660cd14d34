"""C kernels for the CPU, compiled on first use and loaded with ctypes.

No torch headers: a C file and the system's C compiler build in about a second, where a torch
C++ extension takes a minute. The library is cached per source, flags and CPU model
(CARPOOL_KERNEL_CACHE, default ~/.cache/carpool/kernels), since `-march=native` code from one
machine may not run on another. It links OpenMP by soname, so inside this process it binds to
the libgomp torch already loaded and shares torch's threads. Without a compiler, or with
CARPOOL_NO_KERNELS=1, callers fall back to torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("carpool")

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # in the cache key; found with -I, not compiled
# -ffast-math lets gcc vectorise expf and reassociate the dot products. It is given when
# compiling only: linked with it, gcc would add crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (torch included).
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]  # libm brings libmvec, the vectorised expf
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _cpu_model() -> str:
    """The CPU's name and instruction-set flags (names alone can be generic: "Intel(R) Xeon(R)
    Processor" covers generations with and without AVX-512 FP16 or AMX)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    first = {}
    for line in lines:
        key = line.split(":")[0].strip()
        if key in ("model name", "flags"):
            first.setdefault(key, line)
    return "\n".join(first.values()) or platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("CARPOOL_KERNEL_CACHE", Path.home() / ".cache" / "carpool" / "kernels"))


def build(sources: tuple[Path, ...] = SOURCES) -> Path:
    """Compile `sources` into one shared library (or reuse the cached one); returns its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    key = hashlib.sha256("\0".join([*(s.read_text() for s in (*sources, *HEADERS)), cc, *COMPILE_FLAGS, *LINK_FLAGS,
                                     _cpu_model()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{s.stem}.o" for s in sources]
        lib = Path(tmp) / "kernels.so"
        commands = [[cc, *COMPILE_FLAGS, f"-I{CSRC}", "-c", str(s), "-o", str(o)] for s, o in zip(sources, objects)]
        for cmd in [*commands, [cc, *map(str, objects), *LINK_FLAGS, "-o", str(lib)]]:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, target)  # atomic: concurrent builders each write their own temp file
    return target


@functools.cache
def library() -> ctypes.PyDLL | None:
    """The compiled kernels, or None (logged once) when they cannot be built here."""
    if os.environ.get("CARPOOL_NO_KERNELS") == "1":
        return None
    try:
        # PyDLL, not CDLL: calls keep the GIL. They last microseconds, and a thread that gives
        # up the GIL 120 times a step waits to get it back whenever the HTTP thread holds it.
        path = str(build())
        lib = ctypes.PyDLL(path)
        # ...except a whole small step's layers (milliseconds, once a step): that call lets the
        # GIL go, so the HTTP thread streams the last step's tokens while this one computes.
        lib.fused_layers = ctypes.CDLL(path).fused_layers
    except (OSError, RuntimeError) as e:
        log.warning("CPU kernels unavailable, using torch ops instead: %s", e)
        return None
    signatures = {
        "paged_decode_attention": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                                   _i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, _ptr, _i64, _ptr, _i64, _ptr],
        "rms_norm_bf16": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float],
        "rope_bf16": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr],
        "silu_mul_bf16": [_ptr, _ptr, _i64, _i64],
        "quantized_matmul": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int],
        "quantized_matmul_using": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, _i64],
        "quant_gemv_supported": [],
        "quant_amx_supported": [],
        "paged_attention_runs": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                                 _i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, _ptr, _i64, _ptr, _i64, _ptr],
        "fused_layers": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                         _ptr, ctypes.c_int],
    }
    returns = {name: ctypes.c_int for name in ("quantized_matmul", "quantized_matmul_using", "quant_gemv_supported",
                                               "quant_amx_supported", "fused_layers", "paged_decode_attention",
                                               "paged_attention_runs")}
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = returns.get(name), argtypes
    return lib


def has_decode_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and library() is not None


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, block_size: int,
                           out: torch.Tensor | None = None, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                           | None = None) -> torch.Tensor:
    """Decodes over their cached contexts, read from the blocks in place. q: [B, heads, D] (rows
    may be strided, heads and D dense); cache: [2, slots, kv_heads, D]; block_tables: [B, n]
    int64; context_lens: [B] int64 -> out [B, heads, D]. new_kv: (k, v, slots): the decodes'
    new [B, kv_heads, D] rows (strided alike), which the kernel writes to the cache first."""
    num_seqs, num_heads, dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert q.stride(2) == 1 and q.stride(1) == dim and out.stride(2) == 1 and out.stride(1) == dim
    assert cache[0].is_contiguous() and block_tables.dtype == context_lens.dtype == torch.int64
    assert block_tables.is_contiguous() and context_lens.is_contiguous() and q.dtype == cache.dtype
    new = (None, 0, None, 0, None)
    if new_kv is not None:
        k, v, slots = new_kv
        assert k.shape == v.shape and k.dtype == v.dtype == q.dtype and len(slots) == len(k) == num_seqs
        assert k.stride(1) == v.stride(1) == dim and k.stride(2) == v.stride(2) == 1
        assert slots.dtype == torch.int64 and slots.is_contiguous()
        new = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr())
    if not library().paged_decode_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), cache[0].data_ptr(), cache[1].data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), num_seqs, num_heads,
        cache.shape[2], dim, block_size, scale, int(q.dtype == torch.bfloat16), torch.get_num_threads(), *new):
        raise MemoryError("decode attention: no memory for the attention scores")
    return out


def paged_attention_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, query_starts: torch.Tensor,
                         slots: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Runs of queries (attention.QueryRuns) over their cached contexts, causally; the tokens'
    k, v [T, kv_heads, D] are written to `slots` first. q: [T, heads, D] -> out [T, heads, D]."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    assert q.dtype == k.dtype == v.dtype == cache.dtype and cache[0].is_contiguous()
    for t in (block_tables, context_lens, query_starts, slots):
        assert t.dtype == torch.int64 and t.is_contiguous()
    out = torch.empty_like(q)
    if not library().paged_attention_runs(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), cache[0].data_ptr(), cache[1].data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), query_starts.data_ptr(),
        len(context_lens), q.shape[1], cache.shape[2], q.shape[2], block_size, scale, int(q.dtype == torch.bfloat16),
        torch.get_num_threads(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr()):
        raise MemoryError("paged attention: no memory for the attention scores")
    return out


def fuses(x: torch.Tensor) -> bool:
    """Whether the element-wise kernels below run for `x`: bf16 on CPU, eager (Inductor fuses
    the same steps in compiled graphs), and the library built. fp32 keeps torch's ops."""
    return (x.dtype == torch.bfloat16 and x.is_cpu and not torch.compiler.is_compiling()
            and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's rows; with `delta`, (x + delta, RMSNorm(x + delta)): the residual add fused."""
    x = x.contiguous()  # held in locals: a pointer into a temporary would dangle
    assert x.dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous()
    out = torch.empty_like(x)
    if delta is not None:
        delta = delta.contiguous()
        assert delta.shape == x.shape and delta.dtype == x.dtype
    x_out = None if delta is None else torch.empty_like(x)
    library().rms_norm_bf16(x.data_ptr(), None if delta is None else delta.data_ptr(),
                            None if x_out is None else x_out.data_ptr(), out.data_ptr(), weight.data_ptr(),
                            x.numel() // x.shape[-1], x.shape[-1], eps)
    return out if delta is None else (x_out, out)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on qk [T, heads, D] (rows may be strided, heads dense); cos, sin: [T, 1, D]."""
    rows, heads, dim = qk.shape
    assert qk.stride(2) == 1 and qk.stride(1) == dim and cos.is_contiguous() and sin.is_contiguous()
    assert qk.dtype == cos.dtype == sin.dtype == torch.bfloat16
    library().rope_bf16(qk.data_ptr(), rows, qk.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr())
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    library().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out



def has_amx() -> bool:
    """Whether the quantized products can run on AMX tiles here (and Linux granted them)."""
    lib = library()
    return lib is not None and bool(lib.quant_amx_supported())


def has_quantized_matmul() -> bool:
    """Whether the int4/int8 integer products run here (AVX-512 VNNI or AVX2, the library built)."""
    lib = library()
    return lib is not None and bool(lib.quant_gemv_supported())


class QuantizedMatmul:
    """x @ W.T for a weight packed for the C kernels (int4 with `low`, its groups' minimums, else
    int8; layouts:
    csrc/quant_gemv.c, written by quant.pack_int4 / pack_int8). The weight's pointers are bound
    once: a decode step makes ~120 of these calls, and each microsecond of Python is 0.1 ms."""

    def __init__(self, n: int, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None = None):
        assert codes.dtype == torch.uint8 and scale.dtype == torch.float16
        assert codes.is_contiguous() and scale.is_contiguous()
        assert low is None or (low.dtype == torch.float16 and low.is_contiguous())
        self.n, self.tensors = n, (codes, scale, low)  # the tensors keep the bound pointers valid
        pointers = (codes.data_ptr(), scale.data_ptr(), None if low is None else low.data_ptr())
        self._matmul = functools.partial(library().quantized_matmul, *pointers)
        self._matmul_using = functools.partial(library().quantized_matmul_using, *pointers)

    def __call__(self, x: torch.Tensor, amx_from: int | None = None) -> torch.Tensor:
        """x: [tokens, k], fp32 or bf16. amx_from: run the AMX kernel from this many tokens up
        (0: never; None: the library's default), where the CPU has AMX; the outputs are the same."""
        x = x.contiguous()
        assert x.dtype is torch.bfloat16 or x.dtype is torch.float32
        out = x.new_empty((x.shape[0], self.n))
        args = (x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], self.n, x.dtype is torch.bfloat16,
                torch.get_num_threads())
        if not (self._matmul(*args) if amx_from is None else self._matmul_using(*args, amx_from)):
            raise MemoryError("quantized matmul: no memory for the quantized activations")
        return out

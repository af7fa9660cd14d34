"""C kernels for the CPU: compiled on first use, called through ctypes, and registered as torch
ops that compiled graphs can hold.

No torch headers: a C file and the system's C compiler build in about a second, where a torch
C++ extension takes a minute. The library is cached per source, flags and CPU model
(CARPOOL_KERNEL_CACHE, default ~/.cache/carpool/kernels), since `-march=native` code from one
machine may not run on another (CARPOOL_KERNEL_FLAGS adds flags: `-mno-avx512f` builds the AVX2
kernels on a CPU with AVX-512, so one machine tests both). It links OpenMP by soname, so inside
this process it binds to the libgomp torch already loaded and shares torch's threads. Without a
compiler, or with CARPOOL_NO_KERNELS=1, callers fall back to torch ops.

Each entry point's signature is declared once, in KERNELS. ctypes' argument and return types
are made from it, and loading the library checks it against the prototypes in csrc/kernels.h
(which the C compiler checks the definitions against) and against the library's symbols: a
signature out of step is an error at load, not a call that corrupts memory. The wrappers below
check their tensors' devices, dtypes, shapes and layouts before handing pointers to C, and raise
ValueError where the kernel would read or write out of bounds. (The values inside index tensors,
block tables and slots, are the caller's to keep in range: checking them would read them.)

The kernels of the model's forward are also `carpool::` torch ops (`torch.library.custom_op`,
each with a fake implementation that gives its outputs' shapes), which torch.compile traces
into its graphs. Eager calls skip the op and call ctypes directly: they run per layer per step,
and the op's dispatch costs more than a small kernel (measured at OPS).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

log = logging.getLogger("carpool")

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # in the cache key; found with -I, not compiled
HEADER = CSRC / "kernels.h"  # every entry point's prototype
# -ffast-math lets gcc vectorise expf and reassociate the dot products. It is given when
# compiling only: linked with it, gcc would add crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (torch included).
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]  # libm brings libmvec, the vectorised expf
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_BF16, _F32 = torch.bfloat16, torch.float32

# ---------------------------------------------------------------- the signature table

# Every entry point of the library: name -> (return kind, its arguments as "kind name", in order).
# Kinds: ptr (any pointer), i64 (int64_t), int, f32 (float), void. ctypes calls with the types
# made from this table; load() checks it against csrc/kernels.h, names included.
KERNELS: dict[str, tuple[str, str]] = {
    "quant_gemv_supported": ("int", ""),
    "quant_amx_supported": ("int", ""),
    "quantized_matmul": ("int", "ptr codes, ptr scale, ptr min, ptr x, ptr out, i64 tokens, i64 k, i64 n, "
                                "int is_bf16, int num_threads"),
    "quantized_matmul_using": ("int", "ptr codes, ptr scale, ptr min, ptr x, ptr out, i64 tokens, i64 k, i64 n, "
                                      "int is_bf16, int num_threads, i64 amx_from"),
    "quantized_matmul_then": ("int", "ptr codes, ptr scale, ptr min, ptr x, ptr out, i64 tokens, i64 k, i64 n, "
                                     "int is_bf16, int num_threads, ptr next"),
    "kq_supported": ("int", ""),
    "kq_gemm_supported": ("int", ""),
    "int8_peak_gops": ("f32", "int num_threads"),
    "kq_rows": ("void", "ptr w, ptr rows, i64 count, ptr out, int is_bf16"),
    "kq_matmul": ("int", "ptr w, ptr x, ptr out, i64 tokens, int is_bf16, int num_threads, i64 tile_from"),
    "kq_pack": ("int", "ptr blocks, i64 row_stride, int qtype, ptr rows, i64 count, ptr out, i64 first_row, "
                       "int num_threads"),
    "bf16_tiles_pack": ("void", "ptr w, i64 n, i64 k, ptr tiles"),
    "bf16_tiles_supported": ("int", ""),
    "bf16_tiles_matmul": ("int", "ptr tiles, ptr x, ptr out, i64 tokens, i64 n, i64 k, int num_threads, "
                                 "i64 amx_from"),
    "paged_attention_runs": ("int", "ptr q, i64 q_stride, ptr out, i64 out_stride, ptr k_cache, ptr v_cache, "
                                    "ptr block_tables, i64 table_width, ptr context_lens, ptr query_starts, "
                                    "i64 num_runs, i64 num_heads, i64 num_kv_heads, i64 head_dim, i64 block_size, "
                                    "f32 scale, int is_bf16, int num_threads, "
                                    "ptr k_new, i64 k_stride, ptr v_new, i64 v_stride, ptr slots"),
    "paged_decode_attention": ("int", "ptr q, i64 q_stride, ptr out, i64 out_stride, ptr k_cache, ptr v_cache, "
                                      "ptr block_tables, i64 table_width, ptr context_lens, i64 num_seqs, "
                                      "i64 num_heads, i64 num_kv_heads, i64 head_dim, i64 block_size, "
                                      "f32 scale, int is_bf16, int num_threads, "
                                      "ptr k_new, i64 k_stride, ptr v_new, i64 v_stride, ptr slots"),
    "rms_norm_bf16": ("void", "ptr x, ptr delta, ptr x_out, ptr out, ptr weight, i64 rows, i64 dim, f32 eps"),
    "rope_bf16": ("void", "ptr qk, i64 rows, i64 row_stride, i64 heads, i64 dim, ptr cos, ptr sin"),
    "silu_mul_bf16": ("void", "ptr gate_up, ptr out, i64 rows, i64 inter"),
    "row_max": ("void", "ptr x, ptr rows, i64 count, i64 n, ptr values, ptr indices, int num_threads"),
    "fused_layers": ("int", "ptr layers, i64 num_layers, ptr shape, ptr x, ptr out, ptr final_norm, i64 tokens, "
                            "ptr cos, ptr sin, ptr kv_cache, i64 cache_slots, ptr block_tables, i64 table_width, "
                            "ptr context_lens, ptr query_starts, i64 num_runs, ptr slots, int num_threads"),
}
# Called without the GIL: a whole small step's layers (milliseconds, once a step), while the
# HTTP thread streams the last step's tokens. Every other kernel keeps it: they last
# microseconds, and a thread that gives up the GIL 120 times a step waits to get it back
# whenever the HTTP thread holds it.
RELEASES_GIL = frozenset({"fused_layers"})
CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "int": ctypes.c_int, "f32": ctypes.c_float, "void": None}
_C_KINDS = {"int64_t": "i64", "int": "int", "float": "f32", "void": "void"}


class KernelSignatureError(TypeError):
    """The signature table, csrc/kernels.h and the library disagree: a call could corrupt memory."""


@dataclass(frozen=True)
class Signature:
    returns: str
    args: tuple[tuple[str, str], ...]  # (kind, name) each

    @classmethod
    def parse(cls, name: str, returns: str, args: str) -> Signature:
        """An entry of KERNELS."""
        parsed = tuple(tuple(arg.split()) for arg in args.split(",") if arg.strip())
        for kind in (returns, *(a[0] for a in parsed)):
            if kind not in CTYPES:
                raise KernelSignatureError(f"{name}: unknown kind {kind!r} (kinds: {', '.join(CTYPES)})")
        if any(len(a) != 2 for a in parsed):
            raise KernelSignatureError(f"{name}: arguments are 'kind name', comma-separated: {args!r}")
        return cls(returns, parsed)

    def __str__(self) -> str:
        return f"{self.returns} ({', '.join(' '.join(a) for a in self.args)})"


def _c_kind(c_type: str, where: str) -> str:
    if "*" in c_type:
        return "ptr"
    kind = _C_KINDS.get(" ".join(w for w in c_type.split() if w not in ("const", "extern")))
    if kind is None:
        raise KernelSignatureError(f"{where}: no kind for the C type {c_type.strip()!r}")
    return kind


def header_prototypes(text: str) -> dict[str, Signature]:
    """The exported (non-static) function prototypes of a C header, as Signatures. Comments,
    preprocessor lines, and the bodies of its static inline functions and structs are skipped."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = re.sub(r"^[ \t]*#[^\n]*", "", text, flags=re.M)
    n = 1
    while n:  # innermost braces first; each body ends its statement
        text, n = re.subn(r"\{[^{}]*\}", ";", text)
    found = {}
    for statement in text.split(";"):
        m = re.fullmatch(r"\s*([\w\s*]+?)\s*\b(\w+)\s*\(([^()]*)\)\s*", statement)
        if m is None or m[1].split()[0] in ("static", "typedef"):
            continue
        name, params = m[2], [p.strip() for p in m[3].split(",")]
        args = []
        for param in ([] if params in ([""], ["void"]) else params):
            arg = re.fullmatch(r"(.*?[\s*])(\w+)", param)
            if arg is None:
                raise KernelSignatureError(f"kernels.h, {name}: name every parameter ({param!r})")
            args.append((_c_kind(arg[1], f"kernels.h, {name}"), arg[2]))
        found[name] = Signature(_c_kind(m[1], f"kernels.h, {name}"), tuple(args))
    return found


def check_signatures(kernels: dict[str, tuple[str, str]], header: str) -> dict[str, Signature]:
    """`kernels` (a table like KERNELS) as Signatures, each equal to its prototype in `header`
    (the text of kernels.h), and one for every prototype there; else KernelSignatureError."""
    declared = {name: Signature.parse(name, *spec) for name, spec in kernels.items()}
    prototypes = header_prototypes(header)
    wrong = [f"{name}: {declared.get(name, 'not in the table')} in the table, "
             f"{prototypes.get(name, 'no prototype')} in kernels.h"
             for name in sorted(declared.keys() | prototypes.keys()) if declared.get(name) != prototypes.get(name)]
    if wrong:
        raise KernelSignatureError("the kernel table and csrc/kernels.h disagree:\n  " + "\n  ".join(wrong))
    return declared


# ---------------------------------------------------------------- building and loading

def cpu_model() -> str:
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
    flags = [*COMPILE_FLAGS, *os.environ.get("CARPOOL_KERNEL_FLAGS", "").split()]
    key = hashlib.sha256("\0".join([*(s.read_text() for s in (*sources, *HEADERS)), cc, *flags, *LINK_FLAGS,
                                     cpu_model()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{s.stem}.o" for s in sources]
        lib = Path(tmp) / "kernels.so"
        commands = [[cc, *flags, f"-I{CSRC}", "-c", str(s), "-o", str(o)] for s, o in zip(sources, objects)]
        for cmd in [*commands, [cc, *map(str, objects), *LINK_FLAGS, "-o", str(lib)]]:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, target)  # atomic: concurrent builders each write their own temp file
    return target


def load(path: Path, kernels: dict[str, tuple[str, str]] = KERNELS, header: Path = HEADER) -> ctypes.PyDLL:
    """The library at `path`, each kernel of `kernels` an attribute typed for ctypes from its
    entry. KernelSignatureError where the table disagrees with `header` or the library lacks one."""
    signatures = check_signatures(kernels, header.read_text())
    # PyDLL, not CDLL: calls keep the GIL, except those in RELEASES_GIL.
    lib, unlocked = ctypes.PyDLL(str(path)), ctypes.CDLL(str(path))
    missing = [name for name in signatures if not hasattr(lib, name)]
    if missing:
        raise KernelSignatureError(f"{path.name} exports no {', '.join(missing)}")
    for name, sig in signatures.items():
        fn = getattr(unlocked if name in RELEASES_GIL else lib, name)
        fn.restype, fn.argtypes = CTYPES[sig.returns], [CTYPES[kind] for kind, _ in sig.args]
        setattr(lib, name, fn)
    return lib


@functools.cache
def library() -> ctypes.PyDLL | None:
    """The compiled kernels, or None (logged once) when they cannot be built here. A table out of
    step with the C code raises instead: that is a bug to fix, not a machine to fall back on."""
    if os.environ.get("CARPOOL_NO_KERNELS") == "1":
        return None
    try:
        return load(build())
    except (OSError, RuntimeError) as e:
        log.warning("CPU kernels unavailable, using torch ops instead: %s", e)
        return None


def has_decode_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and library() is not None


def fuses(x: torch.Tensor) -> bool:
    """Whether the element-wise kernels below run for `x`: bf16 on CPU, eager (Inductor fuses
    the same steps in compiled graphs), and the library built. fp32 keeps torch's ops."""
    return (x.dtype == torch.bfloat16 and x.is_cpu and not torch.compiler.is_compiling()
            and library() is not None)


def has_amx() -> bool:
    """Whether the quantized products can run on AMX tiles here (and Linux granted them)."""
    lib = library()
    return lib is not None and bool(lib.quant_amx_supported())


def has_quantized_matmul() -> bool:
    """Whether the int4/int8 integer products run here (AVX-512 VNNI or AVX2, the library built)."""
    lib = library()
    return lib is not None and bool(lib.quant_gemv_supported())


# ---------------------------------------------------------------- the wrappers
# Each checks, in one expression on the happy path, what the C code assumes of its tensors;
# under torch.compile each calls its op instead (the op's implementation calls it eagerly).

def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} {t.device.type} strides {list(t.stride())}"


def _reject(kernel: str, wants: str, **tensors: object) -> NoReturn:
    got = ", ".join(f"{name} {_describe(t)}" for name, t in tensors.items())
    raise ValueError(f"{kernel} takes {wants}; got {got}")


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, block_size: int,
                           out: torch.Tensor | None = None, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                           | None = None) -> torch.Tensor:
    """Decodes over their cached contexts, read from the blocks in place. q: [B, heads, D] (rows
    may be strided, heads and D dense); cache: [2, slots, kv_heads, D]; block_tables: [B, n]
    int64; context_lens: [B] int64 -> out [B, heads, D]. new_kv: (k, v, slots): the decodes'
    new [B, kv_heads, D] rows (strided alike), which the kernel writes to the cache first."""
    if torch.compiler.is_compiling():
        k, v, slots = (None, None, None) if new_kv is None else new_kv
        o = torch.ops.carpool.paged_decode_attention(q, cache, block_tables, context_lens, scale, block_size,
                                                     k, v, slots)
        return o if out is None else out.copy_(o)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs, num_heads, dim = q.shape
    shape = cache.shape
    # The cache's halves by arithmetic, not as views (cache[0] costs ~1.5 us).
    if not (q.is_cpu and q.dtype in SUPPORTED_DTYPES and q.stride()[1:] == (dim, 1)
            and cache.is_cpu and cache.dtype is q.dtype and len(shape) == 4 and shape[0] == 2 and shape[3] == dim
            and num_heads % shape[2] == 0 and cache.stride()[1:] == (shape[2] * dim, dim, 1)
            and out.is_cpu and out.dtype is q.dtype and out.shape == q.shape and out.stride()[1:] == (dim, 1)
            and block_tables.is_cpu and block_tables.dtype is torch.int64 and block_tables.dim() == 2
            and len(block_tables) == num_seqs and block_tables.is_contiguous()
            and context_lens.is_cpu and context_lens.dtype is torch.int64 and context_lens.shape == (num_seqs,)
            and context_lens.is_contiguous()):
        _reject("paged_decode_attention", "on the CPU, q [B, heads, D] fp32 or bf16 with dense heads, cache "
                "[2, slots, kv_heads, D] with kv_heads dividing heads and each half contiguous, out like q, "
                "contiguous int64 block_tables [B, n] and context_lens [B]", q=q, cache=cache, out=out,
                block_tables=block_tables, context_lens=context_lens)
    new = (None, 0, None, 0, None)
    if new_kv is not None:
        k, v, slots = new_kv
        if not (k.is_cpu and v.is_cpu and k.shape == v.shape == (num_seqs, shape[2], dim)
                and k.dtype is v.dtype is q.dtype and k.stride()[1:] == v.stride()[1:] == (dim, 1)
                and slots.is_cpu and slots.dtype is torch.int64 and slots.shape == (num_seqs,)
                and slots.is_contiguous()):
            _reject("paged_decode_attention", "new_kv: k and v [B, kv_heads, D] as q with dense heads, "
                    "contiguous int64 slots [B]", q=q, k=k, v=v, slots=slots)
        new = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr())
    k_cache = cache.data_ptr()
    if not library().paged_decode_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache, k_cache + cache.stride(0) * q.element_size(),
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), num_seqs, num_heads,
        shape[2], dim, block_size, scale, q.dtype is _BF16, torch.get_num_threads(), *new):
        raise MemoryError("decode attention: no memory for the attention scores")
    return out


def paged_attention_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, query_starts: torch.Tensor,
                         slots: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Runs of queries (attention.QueryRuns) over their cached contexts, causally; the tokens'
    k, v [T, kv_heads, D] are written to `slots` first. q: [T, heads, D] -> out [T, heads, D]."""
    if torch.compiler.is_compiling():
        return torch.ops.carpool.paged_attention_runs(q, k, v, cache, block_tables, context_lens, query_starts,
                                                      slots, scale, block_size)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tokens, num_heads, dim = q.shape
    runs, shape = len(context_lens), cache.shape
    if not (q.is_cpu and q.dtype in SUPPORTED_DTYPES and cache.is_cpu and cache.dtype is q.dtype
            and len(shape) == 4 and shape[0] == 2 and shape[3] == dim and num_heads % shape[2] == 0
            and cache.stride()[1:] == (shape[2] * dim, dim, 1) and k.is_cpu and v.is_cpu
            and k.dtype is v.dtype is q.dtype and k.shape == v.shape == (tokens, shape[2], dim)
            and all(t.is_cpu and t.dtype is torch.int64 and t.is_contiguous()
                    for t in (block_tables, context_lens, query_starts, slots))
            and block_tables.dim() == 2 and len(block_tables) == runs and context_lens.shape == (runs,)
            and query_starts.shape == (runs + 1,) and slots.shape == (tokens,)):
        _reject("paged_attention_runs", "on the CPU, q [T, heads, D] fp32 or bf16, k and v [T, kv_heads, D] "
                "as q, cache [2, slots, kv_heads, D] with kv_heads dividing heads and each half contiguous, "
                "contiguous int64 block_tables [runs, n], context_lens [runs], query_starts [runs + 1] and "
                "slots [T]", q=q, k=k, v=v, cache=cache, block_tables=block_tables, context_lens=context_lens,
                query_starts=query_starts, slots=slots)
    out = torch.empty_like(q)
    k_cache = cache.data_ptr()
    if not library().paged_attention_runs(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache, k_cache + cache.stride(0) * q.element_size(),
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), query_starts.data_ptr(),
        runs, num_heads, shape[2], dim, block_size, scale, q.dtype is _BF16, torch.get_num_threads(),
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr()):
        raise MemoryError("paged attention: no memory for the attention scores")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's rows; with `delta`, (x + delta, RMSNorm(x + delta)): the residual add fused."""
    if torch.compiler.is_compiling():
        if delta is None:
            return torch.ops.carpool.rms_norm(x, weight, eps)
        return tuple(torch.ops.carpool.add_rms_norm(x, delta, weight, eps))
    x = x.contiguous()  # held in locals: a pointer into a temporary would dangle
    if delta is not None:
        delta = delta.contiguous()
    dim = x.shape[-1]
    if not (x.is_cpu and x.dtype is _BF16 and weight.is_cpu and weight.dtype is _BF16 and weight.is_contiguous()
            and weight.numel() == dim
            and (delta is None or (delta.is_cpu and delta.dtype is _BF16 and delta.shape == x.shape))):
        _reject("rms_norm", "bf16 CPU tensors: x [..., dim], weight [dim] contiguous, delta as x",
                x=x, weight=weight, delta=delta)
    out = torch.empty_like(x)
    x_out = None if delta is None else torch.empty_like(x)
    library().rms_norm_bf16(x.data_ptr(), None if delta is None else delta.data_ptr(),
                            None if x_out is None else x_out.data_ptr(), out.data_ptr(), weight.data_ptr(),
                            x.numel() // dim, dim, eps)
    return out if delta is None else (x_out, out)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on qk [T, heads, D] (rows may be strided, heads dense); cos, sin: [T, 1, D]."""
    if torch.compiler.is_compiling():
        torch.ops.carpool.rope_(qk, cos, sin)
        return qk
    rows, heads, dim = qk.shape
    if not (qk.is_cpu and qk.dtype is _BF16 and qk.stride()[1:] == (dim, 1)
            and cos.is_cpu and cos.dtype is _BF16 and cos.is_contiguous() and cos.numel() == rows * dim
            and sin.is_cpu and sin.dtype is _BF16 and sin.is_contiguous() and sin.numel() == rows * dim):
        _reject("rope_", "bf16 CPU tensors: qk [T, heads, D] with dense heads, cos and sin [T, 1, D] contiguous",
                qk=qk, cos=cos, sin=sin)
    library().rope_bf16(qk.data_ptr(), rows, qk.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr())
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]."""
    if torch.compiler.is_compiling():
        return torch.ops.carpool.silu_mul(gate_up)
    gate_up = gate_up.contiguous()
    if not (gate_up.is_cpu and gate_up.dtype is _BF16 and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0):
        _reject("silu_mul", "a bf16 CPU tensor [rows, 2 * inter]", gate_up=gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    library().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def row_max(x: torch.Tensor, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x[rows].max(dim=-1) of [?, n] logits (rows None: all), values and indices alike: the first
    index of each row's maximum, NaN where the row holds one (csrc/row_max.c: 2-4x faster than
    torch's reduction in a decode step, and the rows read in place, not gathered). Tensors the
    kernel does not take (not fp32 on the CPU, no columns) go to torch."""
    lib = library()
    if lib is None or not (x.is_cpu and x.dtype is _F32 and x.dim() == 2 and x.shape[1] > 0):
        return (x if rows is None else x[rows]).max(dim=-1)
    x = x.contiguous()
    count = x.shape[0] if rows is None else len(rows)
    if rows and not (0 <= min(rows) and max(rows) < x.shape[0]):
        raise IndexError(f"row_max: rows {rows} out of range for {x.shape[0]} rows")
    picked = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    values, indices = x.new_empty(count), torch.empty(count, dtype=torch.int64)
    lib.row_max(x.data_ptr(), None if picked is None else picked.data_ptr(), count, x.shape[1], values.data_ptr(),
                indices.data_ptr(), torch.get_num_threads())
    return values, indices


class QuantizedMatmul:
    """x @ W.T for a weight packed for the C kernels (int4 with `low`, its groups' minimums, else
    int8; layouts: csrc/quant_gemv.c, written by quant.pack_int4 / pack_int8). The weight's
    pointers are bound once: a decode step makes ~120 of these calls, and each microsecond of
    Python is 0.1 ms."""

    def __init__(self, n: int, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None = None):
        blocks = -(-n // 16)
        self.k = codes.shape[1] * (4 if low is None else 32) if codes.dim() > 1 else 0
        groups = self.k // 32
        if not (self.k % 32 == 0 and codes.is_cpu and codes.dtype is torch.uint8 and codes.is_contiguous()
                and scale.is_cpu and scale.dtype is torch.float16 and scale.is_contiguous()
                and scale.shape == (blocks, groups, 16)
                and codes.shape == ((blocks, self.k // 4, 16, 4) if low is None else (blocks, groups, 4, 16, 4))
                and (low is None or (low.is_cpu and low.dtype is torch.float16 and low.is_contiguous()
                                     and low.shape == scale.shape))):
            _reject("QuantizedMatmul", f"contiguous CPU tensors packed for n={n}, k a multiple of 32 "
                    "(quant.pack_int8: codes uint8 [n / 16, k / 4, 16, 4]; quant.pack_int4: codes uint8 "
                    "[n / 16, k / 32, 4, 16, 4], low as scale), scale float16 [n / 16, k / 32, 16]",
                    codes=codes, scale=scale, low=low)
        self.n, self.tensors = n, (codes, scale, low)  # the tensors keep the bound pointers valid
        pointers = (codes.data_ptr(), scale.data_ptr(), None if low is None else low.data_ptr())
        self._matmul = functools.partial(library().quantized_matmul, *pointers)
        self._matmul_using = functools.partial(library().quantized_matmul_using, *pointers)

    def __call__(self, x: torch.Tensor, amx_from: int | None = None) -> torch.Tensor:
        """x: [tokens, k], fp32 or bf16. amx_from: run the AMX kernel from this many tokens up
        (0: never; None: the library's default), where the CPU has AMX; the outputs are the same."""
        if torch.compiler.is_compiling():
            return torch.ops.carpool.quantized_matmul(x, *self.tensors, self.n, amx_from)
        x = x.contiguous()
        if not (x.is_cpu and (x.dtype is _BF16 or x.dtype is _F32) and x.dim() == 2 and x.shape[1] == self.k):
            _reject("quantized_matmul", f"a CPU tensor [tokens, {self.k}], fp32 or bf16", x=x)
        out = x.new_empty((x.shape[0], self.n))
        args = (x.data_ptr(), out.data_ptr(), x.shape[0], self.k, self.n, x.dtype is _BF16,
                torch.get_num_threads())
        if not (self._matmul(*args) if amx_from is None else self._matmul_using(*args, amx_from)):
            raise MemoryError("quantized matmul: no memory for the quantized activations")
        return out


class KQuantWeight(ctypes.Structure):
    """csrc/kernels.h's KQuantWeight."""
    _fields_ = [("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("mn", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("bits", ctypes.c_int64), ("offset", ctypes.c_int64), ("super_size", ctypes.c_int64),
                ("lookup", ctypes.c_int64), ("sub_size", ctypes.c_int64), ("m_sign", ctypes.c_float),
                ("next", ctypes.c_void_p)]


def has_kq_matmul() -> bool:
    """Whether kquant.c's integer kernel runs here (AVX-512 VNNI or AVX2, the library built)."""
    lib = library()
    return lib is not None and bool(lib.kq_supported())


def int8_peak_gops(num_threads: int) -> float:
    """The CPU's `vpdpbusd` rate alone on `num_threads` threads, in GOP/s: what the integer
    kernel's prefill could reach at best (0.0 without AVX512-VNNI or the library)."""
    lib = library()
    return float(lib.int8_peak_gops(num_threads)) if lib is not None else 0.0


def has_kq_tiles() -> bool:
    """Whether kquant.c's bf16 tile kernel (prefill from quantized weights) runs here."""
    lib = library()
    return lib is not None and bool(lib.kq_gemm_supported())


def has_bf16_tiles() -> bool:
    """Whether bf16 weights stored as tiles multiply here: kquant.c's bf16 kernels (AVX512-BF16,
    AMX) or its fp32 one for them (AVX2 and FMA without AVX-512)."""
    lib = library()
    return lib is not None and bool(lib.bf16_tiles_supported())


# The tensors of a weight in kquant.c's form, in KQuantWeight's order (None where absent).
KQTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
                  torch.Tensor | None]


def sub_size_of(tensors: KQTensors) -> int:
    """Channels per sub-scale of a weight's tensors (sc, mn [blocks, groups, 32 / sub_size, 16]):
    16 or 32; 32 where it has none, 0 where their shape is neither."""
    subs = next((t.shape[2] for t in tensors[2:4] if t is not None and t.dim() == 4), 1)
    return 32 // subs if subs in (1, 2) else 0


def _check_kq_tensors(kernel: str, tensors: KQTensors, n: int, k: int, bits: int, super_size: int,
                      lookup: bool) -> None:
    """ValueError unless `tensors` are a weight in kquant.c's form for these sizes."""
    blocks, groups = -(-n // 16), k // 32
    planes = 0 if bits == 8 else bits - 4
    subs = 32 // (sub_size_of(tensors) or 16)
    expect = {"lo": ((blocks, groups, 8, 16, 4) if bits == 8 else (blocks, groups, 4, 16, 4), torch.uint8),
              "hi": ((blocks, groups, planes, 8, 8), torch.uint8) if planes else None,
              "sc": ((blocks, groups, subs, 16), torch.int8), "mn": ((blocks, groups, subs, 16), torch.int8),
              "d": ((blocks, k // super_size, 16), torch.float16),
              "m": ((blocks, k // super_size, 16), torch.float16)}
    lo, hi, sc, mn, d, m = tensors
    ok = (k % 32 == 0 and super_size in (32, 256) and k % super_size == 0 and bits in (4, 5, 6, 8)
          and (hi is None) == (planes == 0) and d is not None and (bits == 4 or not lookup))
    for name, t in zip(expect, tensors):
        if t is not None and (expect[name] is None or not (t.is_cpu and t.is_contiguous()
                                                          and (tuple(t.shape), t.dtype) == expect[name])):
            ok = False
    if not ok:
        _reject(kernel, f"contiguous CPU tensors in kquant.c's form for n={n}, k={k}, bits={bits}, "
                f"super-blocks of {super_size}: " + ", ".join(f"{name} {list(v[0])} {v[1]}"
                                                              for name, v in expect.items() if v),
                **dict(zip(expect, tensors)))


class KQuantMatmul:
    """x @ W.T for a weight in csrc/kquant.c's form (codes, their top bits, sub-scales, fp16 super-block
    factors; model/gguf_codes.py packs them). `lookup`: 4-bit codes standing for the IQ4 types'
    8-bit codes (gguf_codes.IQ4_CODES). The struct of pointers is built once."""

    def __init__(self, tensors: KQTensors, n: int, k: int, bits: int, offset: int, super_size: int,
                 m_sign: float = -1.0, lookup: bool = False):
        _check_kq_tensors("KQuantMatmul", tensors, n, k, bits, super_size, lookup)
        self.n, self.k, self.tensors = n, k, tensors  # the tensors keep the pointers valid
        self.parts: tuple[KQuantMatmul, ...] = ()  # stacked(): the parts, each in its own form
        self.form = (n, bits, offset, super_size, m_sign, lookup)
        ptr = lambda t: None if t is None else t.data_ptr()
        self.struct = KQuantWeight(*map(ptr, tensors), n, k, bits, offset, super_size, lookup, sub_size_of(tensors),
                                   m_sign)
        self._matmul = functools.partial(library().kq_matmul, ctypes.byref(self.struct))

    @classmethod
    def stacked(cls, parts: list[KQuantMatmul]) -> KQuantMatmul:
        """Weights stacked by rows, each part in its own form (a fused q/k/v whose v has wider
        codes than q and k): one call multiplies them all, each part into its columns (the C
        structs linked by `next`)."""
        if len(parts) == 1:
            return parts[0]
        if len({p.k for p in parts}) != 1 or any(p.parts for p in parts):
            raise ValueError("stacked parts are single weights with one input size")
        for part, after in zip(parts, parts[1:]):
            part.struct.next = ctypes.addressof(after.struct)
        self = cls.__new__(cls)
        self.n, self.k, self.parts = sum(p.n for p in parts), parts[0].k, tuple(parts)
        self.tensors = tuple(t for p in parts for t in p.tensors)
        self.form, self.struct, self._matmul = None, parts[0].struct, parts[0]._matmul
        return self

    def __call__(self, x: torch.Tensor, tile_from: int) -> torch.Tensor:
        """x: [tokens, k], fp32 or bf16; the bf16 tile kernel from `tile_from` tokens up (0: never)."""
        if torch.compiler.is_compiling():
            if self.parts:
                return torch.cat([p(x, tile_from) for p in self.parts], dim=-1)
            return torch.ops.carpool.kq_matmul(x, *self.tensors, *self.form, tile_from)
        x = x.contiguous()
        if not (x.is_cpu and (x.dtype is _BF16 or x.dtype is _F32) and x.dim() == 2 and x.shape[1] == self.k):
            _reject("kq_matmul", f"a CPU tensor [tokens, {self.k}], fp32 or bf16", x=x)
        out = x.new_empty((x.shape[0], self.n))
        if not self._matmul(x.data_ptr(), out.data_ptr(), x.shape[0], x.dtype is _BF16, torch.get_num_threads(),
                            tile_from):
            raise MemoryError("kq_matmul: no memory for the activations or the tiles")
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized (embedding lookups; fp32: gguf-py's values exactly)."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.n):
            raise IndexError(f"row ids out of range [0, {self.n})")
        out = torch.empty((ids.numel(), self.k), dtype=dtype)
        library().kq_rows(ctypes.byref(self.struct), ids.data_ptr(), ids.numel(), out.data_ptr(), dtype is _BF16)
        return out


def bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [n, k] (k a multiple of 32) rewritten as kquant.c's stored tiles: 16 rows'
    channel pairs together, as its bf16 kernels read them (flat, the last block's missing rows zero)."""
    if not (weight.is_cpu and weight.dtype is _BF16 and weight.dim() == 2 and weight.shape[1] % 32 == 0):
        _reject("bf16_tiles_pack", "a CPU bf16 tensor [n, k], k a multiple of 32", weight=weight)
    n, k = weight.shape
    weight = weight.contiguous()
    tiles = torch.empty((n + 15) // 16 * 16 * k, dtype=_BF16)
    library().bf16_tiles_pack(weight.data_ptr(), n, k, tiles.data_ptr())
    return tiles


def bf16_tiles_matmul(x: torch.Tensor, tiles: torch.Tensor, n: int, amx_from: int) -> torch.Tensor:
    """x [tokens, k] bf16 @ W.T for W stored by `bf16_tiles`; on AMX from `amx_from` tokens (0: never)."""
    if torch.compiler.is_compiling():
        return torch.ops.carpool.bf16_tiles_matmul(x, tiles, n, amx_from)
    x = x.contiguous()
    k = tiles.numel() // ((n + 15) // 16 * 16)
    if not (x.is_cpu and x.dtype is _BF16 and x.dim() == 2 and x.shape[1] == k):
        _reject("bf16_tiles_matmul", f"a CPU bf16 tensor [tokens, {k}]", x=x)
    out = x.new_empty((x.shape[0], n))
    if not library().bf16_tiles_matmul(tiles.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], n, k,
                                       torch.get_num_threads(), amx_from):
        if not has_bf16_tiles():
            raise RuntimeError("bf16_tiles_matmul: this CPU has neither AVX512-BF16 nor AVX2 with FMA")
        raise MemoryError("bf16_tiles_matmul: no memory for the activations' copy")
    return out


def kq_pack(blocks: np.ndarray, qtype: int, rows: np.ndarray, tensors: KQTensors, n: int, k: int, bits: int,
            offset: int, super_size: int, first_row: int, lookup: bool = False) -> None:
    """Rows `rows` of a GGUF tensor of type `qtype` (GGML's number), its blocks [tensor rows, row
    bytes] uint8 (a column cut may stride the rows), written by csrc/kpack.c as rows first_row ..
    of the weight `tensors` (kquant.c's form for n, k, bits, offset, super_size, lookup; zeroed
    before the first call, as the calls OR their bits into shared bytes)."""
    _check_kq_tensors("kq_pack", tensors, n, k, bits, super_size, lookup)
    block_size, type_size = GGML_QUANT_SIZES.get(qtype, (0, 0)) if isinstance(qtype, int) else (0, 0)
    if not (block_size and k % block_size == 0 and isinstance(blocks, np.ndarray) and blocks.dtype == np.uint8
            and blocks.ndim == 2 and blocks.shape[1] == k // block_size * type_size and blocks.strides[1] == 1
            and blocks.strides[0] >= blocks.shape[1] and isinstance(rows, np.ndarray) and rows.dtype == np.int64
            and rows.ndim == 1 and rows.flags.c_contiguous and 0 <= first_row <= n - len(rows)):
        _reject("kq_pack", f"a GGML type's blocks [rows, k / block size * block bytes] uint8 for k={k}, "
                f"int64 rows of them, and a first row with room for them among n={n}",
                blocks=blocks, rows=rows, qtype=qtype, first_row=first_row)
    if len(rows) and not (0 <= rows.min() and rows.max() < len(blocks)):
        raise IndexError(f"kq_pack: rows out of range [0, {len(blocks)})")
    ptr = lambda t: None if t is None else t.data_ptr()
    out = KQuantWeight(*map(ptr, tensors), n, k, bits, offset, super_size, lookup, sub_size_of(tensors), -1.0)
    if not library().kq_pack(blocks.ctypes.data, blocks.strides[0], qtype, rows.ctypes.data, len(rows),
                             ctypes.byref(out), first_row, torch.get_num_threads()):
        raise ValueError(f"kq_pack: GGML type {qtype} does not fit the form bits={bits}, offset={offset}, "
                         f"super-blocks of {super_size}, lookup={lookup}, "
                         f"sub-scales per {sub_size_of(tensors)} channels, " + ", ".join(
                             f"{name} {'present' if t is not None else 'absent'}"
                             for name, t in zip(("sc", "mn", "m"), tensors[2:4] + tensors[5:])))


# ---------------------------------------------------------------- the torch ops
# `torch.ops.carpool.*`, for graphs: each calls its wrapper above (eagerly, with real tensors),
# and its fake implementation gives the output's shape, dtype and strides for tracing. Eager
# calls do not take them: RMSNorm of one 576-wide bf16 row, one thread, took 3.1 us through
# the wrapper and 10.5 us through the op (2026-12-02, a 2-core AMD EPYC VM:
#   python -m timeit -n 20000 -r 20 -s "import torch; from carpool.model.cpu_kernels import rms_norm;
#     torch.set_num_threads(1); x = torch.randn(1, 576).bfloat16(); w = torch.ones(576).bfloat16()"
#     "rms_norm(x, w, 1e-5)"    # and "torch.ops.carpool.rms_norm(x, w, 1e-5)"
# ), and the model's forward makes ~10 such calls per layer per step.
OPS = "carpool"


@torch.library.custom_op(f"{OPS}::rms_norm", mutates_args=(), device_types="cpu")
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{OPS}::add_rms_norm", mutates_args=(), device_types="cpu")
def _add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm(x, weight, eps, delta)


@_add_rms_norm_op.register_fake
def _(x, delta, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op(f"{OPS}::rope_", mutates_args=("qk",), device_types="cpu")
def _rope_op(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rope_(qk, cos, sin)


@_rope_op.register_fake
def _(qk, cos, sin):
    return None


@torch.library.custom_op(f"{OPS}::silu_mul", mutates_args=(), device_types="cpu")
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul(gate_up)


@_silu_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op(f"{OPS}::quantized_matmul", mutates_args=(), device_types="cpu")
def _quantized_matmul_op(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None,
                         n: int, amx_from: int | None) -> torch.Tensor:
    return QuantizedMatmul(n, codes, scale, low)(x, amx_from)


@_quantized_matmul_op.register_fake
def _(x, codes, scale, low, n, amx_from):
    return x.new_empty((x.shape[0], n))


@torch.library.custom_op(f"{OPS}::kq_matmul", mutates_args=(), device_types="cpu")
def _kq_matmul_op(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor | None, sc: torch.Tensor | None,
                  mn: torch.Tensor | None, d: torch.Tensor, m: torch.Tensor | None, n: int, bits: int, offset: int,
                  super_size: int, m_sign: float, lookup: bool, tile_from: int) -> torch.Tensor:
    return KQuantMatmul((lo, hi, sc, mn, d, m), n, x.shape[1], bits, offset, super_size, m_sign, lookup)(x, tile_from)


@_kq_matmul_op.register_fake
def _(x, lo, hi, sc, mn, d, m, n, bits, offset, super_size, m_sign, lookup, tile_from):
    return x.new_empty((x.shape[0], n))


@torch.library.custom_op(f"{OPS}::bf16_tiles_matmul", mutates_args=(), device_types="cpu")
def _bf16_tiles_matmul_op(x: torch.Tensor, tiles: torch.Tensor, n: int, amx_from: int) -> torch.Tensor:
    return bf16_tiles_matmul(x, tiles, n, amx_from)


@_bf16_tiles_matmul_op.register_fake
def _(x, tiles, n, amx_from):
    return x.new_empty((x.shape[0], n))


@torch.library.custom_op(f"{OPS}::paged_decode_attention", mutates_args=("cache",), device_types="cpu")
def _paged_decode_attention_op(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, block_size: int, k: torch.Tensor | None,
                               v: torch.Tensor | None, slots: torch.Tensor | None) -> torch.Tensor:
    new_kv = None if k is None else (k, v, slots)
    return paged_decode_attention(q, cache, block_tables, context_lens, scale, block_size, new_kv=new_kv)


@_paged_decode_attention_op.register_fake
def _(q, cache, block_tables, context_lens, scale, block_size, k, v, slots):
    return q.new_empty(q.shape)


@torch.library.custom_op(f"{OPS}::paged_attention_runs", mutates_args=("cache",), device_types="cpu")
def _paged_attention_runs_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor, query_starts: torch.Tensor,
                             slots: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    return paged_attention_runs(q, k, v, cache, block_tables, context_lens, query_starts, slots, scale, block_size)


@_paged_attention_runs_op.register_fake
def _(q, k, v, cache, block_tables, context_lens, query_starts, slots, scale, block_size):
    return q.new_empty(q.shape)

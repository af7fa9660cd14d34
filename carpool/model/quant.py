"""Weight-only quantized linear layers on CPU: a GGUF's own types (`--quantization gguf`) and
carpool's int4 / int8 (`--quantization int4|int8`).

Each layer holds one copy of its weights, quantized; no dense copy sits beside them.
- GGUF Q4_0 .. Q6_K, Q8_0 tensors keep the file's codes and scales (model/gguf_codes.py decodes
  them, csrc/kquant.c multiplies them).
- int4 and int8 quantize a float checkpoint, after tensor-parallel sharding, into GGUF Q4_1's form
  (w = code * scale + min per 32 input channels, fp16 scales) and Q8_0's (w = code * scale). A
  Q4_1 / Q8_0 GGUF requantized this way gives back its own codes. csrc/quant_gemv.c runs them at
  decode sizes (and the fused layers, model/fused_layers.py).

Two kernels per layer, by token count. Below `tile_from()` tokens (decode steps), the integer
kernels: activations quantized to int8 per 32 channels, integer dot products, so a step reads
each weight byte once and reads 2-4x fewer bytes than bf16. From there (prefill chunks),
kquant.c's tile kernel: each block of 16 rows is dequantized to bf16 once, in cache, and
multiplied against all of the chunk's tokens. Without AVX512-BF16, and on CPUs where the
integer kernel is the faster one at a chunk's size too, the integer kernels run at every size.
In fp32 (the reference arithmetic) and on CPUs without the C kernels, torch's
`_weight_int8pack_mm` (a scale per output channel) and `_weight_int4pack_mm_for_cpu`
((code - 8) * scale + zero per group of 32) run.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from carpool.model import cpu_kernels, gguf_codes

log = logging.getLogger("carpool")

QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
INT4_GROUP_SIZE = 32  # divides every K of the default model, also per TP shard (576 / 2 = 288)
INT8_GROUP_SIZE = 32  # with the C kernel, as GGUF Q8_0
KERNEL_ROWS = 16  # output rows per block of the C kernels' weight layout
_TINY = 1e-30  # scale of an all-equal row/group: its codes are arbitrary, the zero carries it


def quantize_int8(w: torch.Tensor, dtype: torch.dtype, group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 codes [N, K], scales as `dtype` rounds them, kept in fp32): one per
    row ([N]), or with `group_size` one per row and group of input channels ([N, K / group])."""
    n, k = w.shape
    groups = w.reshape(n, -1, group_size or k)
    scales = (groups.abs().amax(dim=-1) / 127).to(dtype).float()
    q = torch.round(groups / scales.clamp(min=_TINY)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales if group_size else scales[:, 0]


def quantize_int4(w: torch.Tensor, dtype: torch.dtype, group_size: int = INT4_GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes 0..15 [N, K] int32, scale_zeros [K / group, N, 2] fp32, rounded as
    `dtype` rounds them); a weight is (code - 8) * scale + zero, the kernel's formula."""
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).to(dtype).float()
    zero = (lo + 8 * scale).to(dtype).float()
    q = torch.round((groups - zero[..., None]) / scale.clamp(min=_TINY)[..., None] + 8).clamp(0, 15)
    return q.to(torch.int32).reshape(n, k), torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


def dequantize_int4(q: torch.Tensor, scale_zeros: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    n, k = q.shape
    scale, zero = scale_zeros.float().transpose(0, 1).unbind(-1)  # [N, K / group] each
    return ((q.reshape(n, k // group_size, group_size) - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


def _row_blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16), 16, ...], zero rows padding the last block."""
    pad = -t.shape[0] % KERNEL_ROWS
    t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
    return t.reshape(-1, KERNEL_ROWS, *t.shape[1:])


def quantize_q4_1(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes 0..15 [N, K] int32, scale and min [N, K / group] as fp16 rounds
    them, kept in fp32): GGUF Q4_1, w = code * scale + min, a Q4_1 tensor's own codes and fp16
    scales given back. The C kernel's int4 form (torch's takes (code - 8) * scale + zero)."""
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale, low = ((hi - lo) / 15).half().float(), lo.half().float()
    q = torch.round((groups - low[..., None]) / scale.clamp(min=_TINY)[..., None]).clamp(0, 15)
    return q.to(torch.int32).reshape(n, k), scale, low


def pack_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_q4_1's codes [N, K], scale and min [N, K / 32] -> the C kernel's blocks of 16 rows
    (csrc/quant_gemv.c): codes [N / 16, K / 32, 4, 16, 4] bytes, channels 16.. in the high
    nibbles; scale and min [N / 16, K / 32, 16] fp16."""
    blocks = _row_blocks(q.to(torch.uint8))  # [B, 16 rows, K]
    b, _, k = blocks.shape
    quads = blocks.reshape(b, 16, k // 32, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [B, G, half, quad, row, 4]
    codes = (quads[:, :, 0] | (quads[:, :, 1] << 4)).contiguous()
    per_group = lambda t: _row_blocks(t).transpose(1, 2).to(torch.float16).contiguous()
    return codes, per_group(scale), per_group(low)


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] int8, scales [N, K / 32] -> codes + 128 as [N / 16, K / 4, 16, 4] bytes;
    scales [N / 16, K / 32, 16] fp16 (GGUF Q8_0's own precision)."""
    blocks = _row_blocks((q.to(torch.int16) + 128).to(torch.uint8))
    b, _, k = blocks.shape
    codes = blocks.reshape(b, 16, k // 4, 4).transpose(1, 2).contiguous()
    return codes, _row_blocks(scales).transpose(1, 2).to(torch.float16).contiguous()


# From this many tokens the bf16 tile kernel (dequantize a block once, reuse it across the chunk)
# runs where the CPU has AMX: its tile products win from one tile of 16 tokens. Elsewhere
# `tile_from()` times where the tile kernel overtakes each integer kernel, whose time grows with
# every token while the tile kernel's barely does until its dequantization is paid for.
TILE_FROM = 16
TILE_PROBE = (4096, 2048)  # rows and input channels of the weights tile_from() times
PROBE_TOKENS = (16, 32, 64, 128)  # the chunk sizes it times them at
# The integer kernels the tile kernel is timed against: a GGUF's own codes (kquant.c, timed on a
# Q4_K tensor) and carpool's int4 / int8 (quant_gemv.c, timed on int4). On a 2-core AMD EPYC
# Zen 5 the tile kernel overtook the first from 32 tokens and never the second (1.00-1.86x its
# time at 128-16 tokens; benchmarks/tile_crossover.py, docs/kernels.md).
KERNEL_FAMILIES = ("gguf", "int4")
# A choice timed while other processes took the CPUs is not kept: the same Zen 5 timed the tile
# kernel 3x slower than kquant.c's integer one at 64 tokens beside a compiler's build, and 0.9x
# the time alone.
MIN_CPU_SHARE = 0.8


def _probe_kernels(family: str):
    """The integer and the tile kernel's products (x -> y) of a random TILE_PROBE weight of `family`."""
    n, k = TILE_PROBE
    if family == "gguf":
        rng = np.random.default_rng(0)
        blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)  # Q4_K: d, dmin, scales, codes
        blocks[..., :4] = np.full(2, 0.01, np.float16).view(np.uint8)  # finite d and dmin
        kernel = packed_kernel(gguf_codes.decode(blocks.reshape(n, -1), GGMLQuantizationType.Q4_K, (n, k)))
        return (lambda x: kernel(x, 0)), (lambda x: kernel(x, 1))
    codes, scale, low = pack_int4(*quantize_q4_1(torch.randn(n, k, generator=torch.Generator().manual_seed(0))))
    integer = cpu_kernels.QuantizedMatmul(n, codes, scale, low)
    tiles = _tiles((codes, None, None, None, scale, low), n, k, 4, 0, 1.0)
    return integer, (lambda x: tiles(x, 1))


def measure_kernels(rounds: int = 5) -> tuple[dict[str, dict[int, tuple[float, float]]], float]:
    """Seconds for each family's probe product at each of PROBE_TOKENS on its integer kernel and
    on the tile kernel, the best of `rounds` calls each, alternating: {family: {tokens: (integer s,
    tiles s)}}; and the share of its threads' time this process got meanwhile (below 1: other
    processes took the CPUs)."""
    generator = torch.Generator().manual_seed(0)
    times: dict[str, dict[int, tuple[float, float]]] = {}
    wall = cpu = 0.0  # over the products alone: building the probes runs on one thread
    for family in KERNEL_FAMILIES:
        kernels, times[family] = _probe_kernels(family), {}
        for tokens in PROBE_TOKENS:
            x = torch.randn(tokens, TILE_PROBE[1], generator=generator).bfloat16()
            best = [float("inf"), float("inf")]
            for _ in range(rounds + 1):  # the first round warms up
                for i, product in enumerate(kernels):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    product(x)
                    seconds = time.perf_counter() - start
                    best[i] = min(best[i], seconds)
                    wall, cpu = wall + seconds, cpu + time.process_time() - start_cpu
            times[family][tokens] = (best[0], best[1])
    return times, cpu / (wall * torch.get_num_threads())


def crossover(times: dict[int, tuple[float, float]]) -> int:
    """The smallest probed token count from which the tile kernel is the faster one at every
    probed count (`times`: {tokens: (integer s, tiles s)}); 0 where it loses at the largest."""
    chosen = 0
    for tokens in sorted(times, reverse=True):
        integer, tiles = times[tokens]
        if tiles >= integer:
            break
        chosen = tokens
    return chosen


def tile_from(family: str) -> int:
    """The token count from which quantized layers of `family` ('gguf': a GGUF's own codes;
    'int4': carpool's int4 / int8) run the tile kernel on this CPU; 0: never. Where the kernels
    cross (measure_kernels, crossover): on AMD Zen 4, whose AVX-512 runs on 256-bit units,
    `vpdpbusd`'s 64 multiply-adds an instruction beat `vdpbf16ps`'s 32 and the tile's
    dequantization at every size (docs/kernels.md has the figures). With AMX the tile kernel
    always runs from TILE_FROM."""
    return tile_choices().get(family, 0)


@functools.cache
def tile_choices() -> dict[str, int]:
    """tile_from() of every family: measured once per CPU and kernel build, and kept beside the
    built kernels, so that every later process (a server, its profile, a benchmark) multiplies alike."""
    if not cpu_kernels.has_kq_tiles():
        return {}
    if cpu_kernels.has_amx():
        return dict.fromkeys(KERNEL_FAMILIES, TILE_FROM)
    path = cpu_kernels.build().with_suffix(".tile_from.json")
    try:
        kept = json.loads(path.read_text())["crossover"]
        return {family: int(kept[family]) for family in KERNEL_FAMILIES}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    times, share = measure_kernels()
    chosen = {family: crossover(times[family]) for family in KERNEL_FAMILIES}
    for family, tokens in chosen.items():
        log.info("quantized layers (%s): %s (a %dx%d weight, integer / tile kernel: %s)", family,
                 "the integer kernel at every size" if tokens == 0 else f"the tile kernel from {tokens} tokens",
                 *TILE_PROBE, ", ".join(f"{t} tokens {a * 1e3:.2f} / {b * 1e3:.2f} ms"
                                        for t, (a, b) in times[family].items()))
    if share < MIN_CPU_SHARE:
        log.warning("the kernels were timed while other processes used the CPUs (this one got %.0f%% of its "
                    "threads' time): the choice is not kept, and the next process times them again", 100 * share)
        return chosen
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump({"crossover": chosen, "seconds": times, "probe": TILE_PROBE, "cpu_share": share}, f)
        os.replace(f.name, path)  # atomic: concurrent processes each write their own file
    except OSError as e:  # a read-only cache: this process keeps its choice, the next measures again
        log.warning("could not keep the kernel choice in %s: %s", path.parent, e)
    return chosen


def _tiles(tensors: cpu_kernels.KQTensors, n: int, k: int, bits: int, offset: int, m_sign: float
           ) -> cpu_kernels.KQuantMatmul | None:
    """The bf16 tile kernel over a weight's own packed tensors (no copy), where it runs."""
    if not cpu_kernels.has_kq_tiles():
        return None
    return cpu_kernels.KQuantMatmul(tensors, n, k, bits, offset, 32, m_sign)


def packed_kernel(codes: gguf_codes.QuantCodes) -> cpu_kernels.KQuantMatmul:
    """A GGUF tensor's codes packed for csrc/kquant.c."""
    p = gguf_codes.pack(codes)
    tensors = tuple(None if a is None else torch.from_numpy(a) for a in (p.lo, p.hi, p.sc, p.mn, p.d, p.dmin))
    return cpu_kernels.KQuantMatmul(tensors, p.n, p.k, p.bits, p.offset, p.super_size, lookup=p.lookup)


class QuantizedLinear(nn.Module):
    """A bias-optional linear layer whose only weights are quantized (see the module doc): one
    copy, whichever kernel runs."""

    def __init__(self, linear: nn.Linear, mode: str, dtype: torch.dtype, group_size: int = INT4_GROUP_SIZE,
                 c_kernel: bool = True):
        """c_kernel: run carpool's C kernel where it can: bf16 (fp32 stays the reference arithmetic:
        the C kernel rounds activations to int8), AVX-512 VNNI or AVX2. False: torch's, as `bench quant`
        times it."""
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        self.mode, self.in_features, self.out_features = mode, k, n
        self.dtype = dtype  # the activations' (the model's: load_model casts it to this dtype)
        # The C kernels' packed weights where they run (plain attributes: the model's .to(dtype)
        # must not cast their scales), else torch's kernels' buffers.
        self.kernel: cpu_kernels.QuantizedMatmul | None = None
        self.tiles: cpu_kernels.KQuantMatmul | None = None  # prefill chunks, from the same tensors
        self.kq: cpu_kernels.KQuantMatmul | None = None  # a GGUF's own codes (from_codes)
        use_kernel = c_kernel and dtype == torch.bfloat16 and k % 32 == 0 and cpu_kernels.has_quantized_matmul()
        if mode == "int8" and use_kernel:  # GGUF Q8_0's form: a Q8_0 tensor keeps its codes
            q, scales = quantize_int8(w, torch.float16, INT8_GROUP_SIZE)
            codes, scale = pack_int8(q, scales)
            self.kernel = cpu_kernels.QuantizedMatmul(n, codes, scale)
            self.tiles = _tiles((codes.view(codes.shape[0], k // 32, 8, 16, 4), None, None, None, scale, None),
                                n, k, 8, 128, 1.0)
        elif mode == "int8":  # torch's kernel takes one scale per output channel
            q, scales = quantize_int8(w, dtype)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales)  # cast to the model dtype with the model
        elif mode == "int4":
            if k % group_size:
                raise ValueError(f"int4 quantization needs input sizes divisible by {group_size}; "
                                 f"a {n}x{k} weight has {k}")
            self.group_size = group_size
            if use_kernel and group_size == 32:
                codes, scale, low = pack_int4(*quantize_q4_1(w))
                self.kernel = cpu_kernels.QuantizedMatmul(n, codes, scale, low)
                self.tiles = _tiles((codes, None, None, None, scale, low), n, k, 4, 0, 1.0)
            else:
                pad = -n % 16  # torch's packing wants N divisible by 16: zero rows, sliced off
                q, scale_zeros = quantize_int4(torch.nn.functional.pad(w, (0, 0, 0, pad)), dtype, group_size)
                self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
                self.register_buffer("scale_zeros", scale_zeros)
        else:
            raise ValueError(f"unknown quantization {mode!r}; choose from {', '.join(QUANTIZATIONS)}")
        # From this many tokens the tile kernel runs; 0: the integer kernel at every size.
        self.tile_from = tile_from("int4") if self.tiles is not None else 0
        self.bias = linear.bias

    @classmethod
    def from_codes(cls, codes: gguf_codes.QuantCodes, bias: torch.Tensor | None, dtype: torch.dtype
                   ) -> QuantizedLinear:
        """A layer that multiplies a GGUF tensor's own codes by csrc/kquant.c."""
        return cls.from_kernel(packed_kernel(codes), bias, dtype)

    @classmethod
    def from_kernel(cls, kq: cpu_kernels.KQuantMatmul, bias: torch.Tensor | None, dtype: torch.dtype
                    ) -> QuantizedLinear:
        """A layer over codes packed already (shared with a tied embedding, or stacked parts)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.kq = kq
        self.mode, self.in_features, self.out_features, self.dtype = "gguf", self.kq.k, self.kq.n, dtype
        self.kernel = self.tiles = None
        self.tile_from = tile_from("gguf") if dtype == torch.bfloat16 else 0
        self.bias = bias
        return self

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors a product reads (what the layer holds in memory, bias aside)."""
        held = self.kq.tensors if self.kq is not None else self.kernel.tensors if self.kernel is not None else \
            list(self.buffers(recurse=False))
        return [t for t in held if t is not None]

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        """The integer kernel (decode steps)."""
        if self.kq is not None:
            y = self.kq(x, 0)
        elif self.kernel is not None:
            y = self.kernel(x)
        elif self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.qweight, self.group_size,
                                                           self.scale_zeros)
            if y.shape[-1] != self.out_features:
                y = y[:, :self.out_features]
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compiled graphs hold the C kernels too (as carpool:: ops).
        if self.kq is not None:
            y = self.kq(x, self.tile_from)
            return y if self.bias is None else y + self.bias
        if self.tile_from and x.shape[0] >= self.tile_from and x.dtype == torch.bfloat16:
            y = self.tiles(x, 1)
            return y if self.bias is None else y + self.bias
        return self.quantized(x)


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as a GGUF's codes: a lookup dequantizes only the rows it reads
    (bit for bit the rows of the dequantized table), and a tied LM head shares the codes."""

    def __init__(self, kq: cpu_kernels.KQuantMatmul, dtype: torch.dtype):
        super().__init__()
        self.kq, self.dtype = kq, dtype
        self.num_embeddings, self.embedding_dim = kq.n, kq.k

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.kq.rows(input_ids, self.dtype)


class CodesAssembly:
    """The layers that keep a GGUF's own codes, built while the weights stream in. The meta
    model's linears (and, unsharded, the embedding) lose their weight parameter, so nothing dense
    is ever allocated for them; their parts (q, k, v; gate, up) collect here, and each becomes a
    QuantizedLinear (QuantizedEmbedding) as soon as all its rows have come, so at most one
    layer's codes wait unpacked. A tied LM head packs the embedding's codes once, for both."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, quantized_lm_head: bool, quantized_embedding: bool):
        self.model, self.dtype = model, dtype
        self.pending: dict[str, str] = {}  # weight name -> its layer's name
        self.parts: dict[str, list] = {}
        self.last: tuple[object, cpu_kernels.KQuantMatmul] | None = None  # the codes packed last
        for name, m in model.named_modules():
            if (isinstance(m, nn.Linear) and (name.startswith("layers.") or (name == "lm_head" and quantized_lm_head))
                    or (isinstance(m, nn.Embedding) and name == "embed_tokens" and quantized_embedding)):
                m.weight = None
                self.pending[f"{name}.weight"] = name

    def add(self, target: str, offset: int, codes) -> None:
        if target not in self.pending:
            raise ValueError(f"no quantized layer takes the codes of {target}")
        parts = self.parts.setdefault(target, [])
        parts.append((offset, codes))
        name = self.pending[target]
        layer = self.model.get_submodule(name)
        rows = layer.num_embeddings if isinstance(layer, nn.Embedding) else layer.out_features
        if sum(c.n for _, c in parts) < rows:
            return
        runs = gguf_codes.stack_rows([c for _, c in sorted(parts, key=lambda part: part[0])])
        if self.last is not None and len(runs) == 1 and self.last[0] is runs[0]:
            kq = self.last[1]
        else:
            kq = cpu_kernels.KQuantMatmul.stacked([packed_kernel(run) for run in runs])
        self.last = (runs[0], kq) if len(runs) == 1 else None
        built = QuantizedEmbedding(kq, self.dtype) if isinstance(layer, nn.Embedding) else \
            QuantizedLinear.from_kernel(kq, layer.bias, self.dtype)
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent), child, built)
        del self.parts[target], self.pending[target]

    def check_complete(self) -> None:
        self.last = None
        if self.pending:
            raise ValueError(f"checkpoint lacks weights for: {', '.join(sorted(self.pending)[:6])}")


def quantize_linears(model: nn.Module, mode: str, dtype: torch.dtype) -> int:
    """Swap every nn.Linear for a QuantizedLinear; returns how many ('none': nothing).
    With int4 the LM head gets int8, as llama.cpp's own Q4 files keep it at 8 bits: at 4 bits
    it alone drops the embedded model's top-1 agreement with fp32 from 0.98 to 0.90 (measured).
    'gguf': the layers keeping the file's codes are in place already (CodesAssembly); others stay."""
    if mode in ("none", "gguf"):
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, QuantizedLinear(child, "int8" if name == "lm_head" else mode, dtype))
    return len(swaps)


def check_quantization(mode: str, device: torch.device) -> None:
    """A resolved mode (not 'auto') that this device can run."""
    if mode not in QUANTIZATIONS[1:]:
        raise ValueError(f"unknown quantization {mode!r}; choose from {', '.join(QUANTIZATIONS)}")
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs torch's CPU kernels; use it with --device cpu")

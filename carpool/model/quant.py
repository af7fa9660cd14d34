"""Weight-only quantized linear layers on CPU (`--quantization int8|int4`).

In bf16 on a CPU with AVX-512 VNNI or AVX2, carpool's C kernels run them (csrc/quant_gemv.c:
activations quantized to int8 per group of 32, integer dot products; 1.4-1.9x faster than
torch's kernels at one token, BENCHMARKS.md) in GGUF's own forms, with fp16 scales per group of
32 input channels: int8 as Q8_0 (w = code * scale), int4 as Q4_1 (w = code * scale + min).
Requantizing a Q8_0 / Q4_1 tensor gives back its codes, so a GGUF checkpoint runs as stored.
Elsewhere (fp32, the reference arithmetic, included) torch's `_weight_int8pack_mm` (a scale
per output channel) and `_weight_int4pack_mm_for_cpu` ((code - 8) * scale + zero per group of
32, scales in the model dtype) run. Weights are quantized from the fp32 values the loader
produced, after tensor-parallel sharding.

The quantized kernels read 2-4x fewer weight bytes than bf16 but reuse nothing across rows:
their time grows linearly with the token count while oneDNN's packed bf16 GEMM stays flat up to
~16 rows (`carpool bench quant`, BENCHMARKS.md). So a QuantizedLinear holds both: the quantized
weights for small token counts (decode) and a bf16 copy *of the dequantized weights* for larger
ones (prefill chunks), one function whichever kernel runs. Dequantizing on the fly instead costs more
than the bf16 GEMM itself (576x49152 LM head: ~48 ms to widen vs ~1 ms to multiply one row).
The crossover is measured per weight shape when the runner is built (`choose_kernels`, ~0.2 s):
it moves with the CPU (AMX makes bf16 strong; without it the quantized kernels win further, and
on AVX2 alone, where torch emulates bf16 GEMMs, at every size).
Being measured, it can differ between runs on a busy host; outputs then differ by rounding
(`--quantization none` for bit-reproducible runs).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from carpool.model import cpu_kernels

log = logging.getLogger("carpool")

QUANTIZATIONS = ("auto", "none", "int8", "int4")
INT4_GROUP_SIZE = 32  # divides every K of the default model, also per TP shard (576 / 2 = 288)
INT8_GROUP_SIZE = 32  # with the C kernel, as GGUF Q8_0
DEFAULT_MAX_QUANTIZED_TOKENS = 4  # until choose_kernels measures it (this crossover on AMX)
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


class QuantizedLinear(nn.Module):
    """A bias-optional linear layer with weight-only quantized weights (see the module doc)."""

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
        self.max_quantized_tokens = DEFAULT_MAX_QUANTIZED_TOKENS
        # The C kernels' packed weights where they run (a plain attribute: the model's .to(dtype)
        # must not cast their scales), else torch's kernels' buffers.
        self.kernel: cpu_kernels.QuantizedMatmul | None = None
        use_kernel = c_kernel and dtype == torch.bfloat16 and k % 32 == 0 and cpu_kernels.has_quantized_matmul()
        if mode == "int8" and use_kernel:  # GGUF Q8_0's form: a Q8_0 tensor keeps its codes
            q, scales = quantize_int8(w, torch.float16, INT8_GROUP_SIZE)
            self.kernel = cpu_kernels.QuantizedMatmul(n, *pack_int8(q, scales))
            dense = (q.float().reshape(n, -1, INT8_GROUP_SIZE) * scales[..., None]).reshape(n, k)
        elif mode == "int8":  # torch's kernel takes one scale per output channel
            q, scales = quantize_int8(w, dtype)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales)  # cast to the model dtype with the model
            dense = q.float() * scales[:, None]
        elif mode == "int4":
            if k % group_size:
                raise ValueError(f"int4 quantization needs input sizes divisible by {group_size}; "
                                 f"a {n}x{k} weight has {k}")
            self.group_size = group_size
            if use_kernel and group_size == 32:
                q, scale, low = quantize_q4_1(w)
                self.kernel = cpu_kernels.QuantizedMatmul(n, *pack_int4(q, scale, low))
                dense = (q.reshape(n, -1, 32) * scale[..., None] + low[..., None]).reshape(n, k)
            else:
                pad = -n % 16  # torch's packing wants N divisible by 16: zero rows, sliced off
                q, scale_zeros = quantize_int4(torch.nn.functional.pad(w, (0, 0, 0, pad)), dtype, group_size)
                self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
                self.register_buffer("scale_zeros", scale_zeros)
                dense = dequantize_int4(q, scale_zeros, group_size)[:n]
        else:
            raise ValueError(f"unknown quantization {mode!r}; choose from {', '.join(QUANTIZATIONS)}")
        self.dense = nn.Linear(k, n, bias=linear.bias is not None)
        self.dense.weight = nn.Parameter(dense, requires_grad=False)
        self.dense.bias = linear.bias
        self.has_bias = linear.bias is not None  # a plain bool: no submodule lookup per call

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x)
        elif self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.qweight, self.group_size,
                                                           self.scale_zeros)
            if y.shape[-1] != self.out_features:
                y = y[:, :self.out_features]
        return y + self.dense.bias if self.has_bias else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compiled graphs hold the C kernel too (as the op carpool::quantized_matmul).
        if x.shape[0] <= self.max_quantized_tokens:
            return self.quantized(x)
        return self.dense(x)  # a oneDNN PackedLinear once the runner has packed the model


def quantize_linears(model: nn.Module, mode: str, dtype: torch.dtype) -> int:
    """Swap every nn.Linear for a QuantizedLinear; returns how many ('none': nothing).
    With int4 the LM head gets int8, as llama.cpp's own Q4 files keep it at 8 bits: at 4 bits
    it alone drops the embedded model's top-1 agreement with fp32 from 0.98 to 0.90 (measured)."""
    if mode == "none":
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


# ---------------------------------------------------------------- kernel choice

CANDIDATE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# The quantized kernel must win by this much: near-ties are where timing noise would flip the
# choice from run to run (and with it the rounding of the outputs) for no speed.
MIN_GAIN = 0.1
# Where the quantized kernel still wins once the dense one takes this long (both then scale with
# the tokens: on AVX2 alone, where bf16 GEMMs are emulated, at every size), the sweep stops and
# the kernel runs at every size.
SWEEP_SECONDS = 0.02
EVERY_SIZE = 1 << 62


def elapsed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_crossover(layers: list[QuantizedLinear], rounds: int = 3, max_layers: int = 8) -> int:
    """The largest token count (a power of two, or 0) at which the quantized kernel beats the
    dense one by MIN_GAIN, or EVERY_SIZE where it wins as far as the sweep goes. Timed over up
    to `max_layers` of `layers` (one shape) in turn, so weights come from memory as in a forward
    pass rather than from a hot cache; best of `rounds`, the two kernels interleaved so that a
    burst of load on a busy host hits both."""
    layers = layers[:max_layers]
    best = 0
    with torch.inference_mode():
        for m in CANDIDATE_TOKENS:
            x = torch.randn(m, layers[0].in_features, dtype=layers[0].dtype)
            quant = lambda: [layer.quantized(x) for layer in layers]
            dense = lambda: [layer.dense(x) for layer in layers]
            quant()  # warm-up
            dense()
            tq = td = float("inf")
            for _ in range(rounds):
                tq, td = min(tq, elapsed(quant)), min(td, elapsed(dense))
            if tq > (1 - MIN_GAIN) * td:
                return best
            best = m
            if td > SWEEP_SECONDS:
                break
    return EVERY_SIZE


def choose_kernels(model: nn.Module) -> dict[tuple[str, int, int], int]:
    """Measure, per quantized weight shape, up to how many tokens the quantized kernel runs;
    returns {(mode, in, out): max tokens}. Call once the dense copies are packed."""
    shapes: dict[tuple[str, int, int], list[QuantizedLinear]] = {}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            shapes.setdefault((m.mode, m.in_features, m.out_features), []).append(m)
    if not shapes:
        return {}
    t = time.perf_counter()
    chosen = {}
    for key, layers in shapes.items():
        chosen[key] = measure_crossover(layers)
        for layer in layers:
            layer.max_quantized_tokens = chosen[key]
    log.info("quantized kernels up to N tokens, dense above (measured in %.2f s): %s", time.perf_counter() - t,
             ", ".join(f"{mode} {k}x{n}: {'all' if v == EVERY_SIZE else v}" for (mode, k, n), v in chosen.items()))
    return chosen

"""Fewer, fatter operations per step: the layers compiled by Inductor (the CPU's CUDA graphs).

Around its ~120 matmuls an eager step runs ~1,000 small aten ops. `torch.compile` with
Inductor's C++/OpenMP backend fuses the code between the matmuls into a few loops per layer
(residual add + RMSNorm, RoPE on q and k together, SiLU * up). Compiled are each layer's
`before_attention` (norm, fused QKV projection, RoPE) and `after_attention` (output projection
+ residual, norm, gate/up + SiLU*mul, down + residual). Attention stays eager: it is a few fat
calls already (the cache write, one SDPA for a step's decodes and one per prefill chunk).

Only steps of at least COMPILE_MIN_TOKENS tokens run compiled. A compiled call costs ~50 us
of Python (guard checks, wrappers) against ~5 us for an eager op, so at a few tokens per step
the fused loops win nothing back (a batch-1 decode: 31.7 ms compiled vs 30.5 eager); from a
few dozen tokens they do (a 256-token prefill: 101-103 ms vs 110-122 ms eager). BENCHMARKS.md
"The compiled forward" has the numbers and how they were measured.

Dynamic shapes take the place of token-count buckets: one graph per function serves every
token count from COMPILE_MIN_TOKENS up (warmed up at start-up, so no request waits for a
compilation), and smaller steps run eager. Weights are graph inputs, so one graph serves all
layers. Inductor caches compiled code on disk (TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_$USER): a second start-up reuses it. If compiling fails (no C++ compiler, an
unsupported op), the model is put back as it was and runs eager.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from carpool.model.llama import DecoderLayer, LlamaModel
from carpool.model.quant import EVERY_SIZE, QuantizedLinear

COMPILED = ("before_attention", "after_attention")
COMPILE_MIN_TOKENS = 32


def can_compile(model: LlamaModel) -> bool:
    """Tensor-parallel layers all-reduce inside `after_attention`: those stay eager. So do models
    whose quantized kernels win at every size (AVX2 alone): a compiled graph would run the dense
    copies instead (the C kernels are ctypes calls, which a graph cannot hold)."""
    return model.tp.size == 1 and not any(isinstance(m, QuantizedLinear) and m.kernel is not None
                                          and m.max_quantized_tokens == EVERY_SIZE for m in model.modules())


class CompiledAbove:
    """A layer method that runs compiled from `min_tokens` tokens up and eager below."""

    def __init__(self, eager, compiled, min_tokens: int):
        self.eager, self.compiled, self.min_tokens = eager, compiled, min_tokens

    def __call__(self, x: torch.Tensor, *args):
        return (self.compiled if x.shape[0] >= self.min_tokens else self.eager)(x, *args)


def compile_model(model: LlamaModel, min_tokens: int = COMPILE_MIN_TOKENS) -> None:
    for name in COMPILED:
        # Every layer of a model has the same structure and its weights are graph inputs, so
        # guards on the modules' attributes would only cost time. They are skipped; then one
        # model's graphs must never serve another (say, one without biases), so each model
        # compiles its own copy of the code: Dynamo keeps compiled graphs per code object.
        fn = getattr(DecoderLayer, name)
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        compiled = torch.compile(own, dynamic=True, fullgraph=True,
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        for layer in model.layers:
            method = CompiledAbove(types.MethodType(fn, layer), types.MethodType(compiled, layer), min_tokens)
            setattr(layer, name, method)


def uncompile_model(model: nn.Module) -> None:
    """Back to the eager methods (the instance attributes compile_model set shadow them)."""
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            for name in COMPILED:
                layer.__dict__.pop(name, None)


def warm_up_sizes(model: nn.Module, min_tokens: int = COMPILE_MIN_TOKENS) -> list[int]:
    """Token counts that reach every compiled graph: Inductor specializes a graph on each
    quantized kernel's crossover (model/quant.py), so one size past each one at or above
    `min_tokens`, and `min_tokens` itself."""
    crossovers = {m.max_quantized_tokens for m in model.modules() if isinstance(m, QuantizedLinear)}
    return sorted({min_tokens} | {c + 1 for c in crossovers if c + 1 > min_tokens})

"""Fewer, fatter operations per step: the layers compiled by Inductor (the CPU's CUDA graphs).

Around its ~120 matmuls an eager step runs ~1,000 small aten ops. `torch.compile` with
Inductor's C++/OpenMP backend fuses the code between the matmuls into a few loops per layer
(residual add + RMSNorm, RoPE on q and k together, SiLU * up). Compiled are each layer's
`before_attention` (norm, fused QKV projection, RoPE) and `after_attention` (output projection
+ residual, norm, gate/up + SiLU*mul, down + residual). Attention stays eager: it is a few fat
calls already (the cache write, one SDPA for a step's decodes and one per prefill chunk).

The model runner runs these layers for steps of COMPILE_MIN_TOKENS tokens and more
(model/paths.py says why there); the model itself stays eager and untouched.

Dynamic shapes take the place of token-count buckets: one graph per function serves every
token count from COMPILE_MIN_TOKENS up (warmed up at start-up, so no request waits for a
compilation). Weights are graph inputs, so one graph serves all layers. Inductor caches
compiled code on disk (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER): a second
start-up reuses it. If compiling fails (no C++ compiler, an unsupported op), the runner drops
these layers and runs eager.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from carpool.model.attention import AttendFn, AttentionMetadata
from carpool.model.llama import DecoderLayer, LlamaModel
from carpool.model.paths import COMPILE_MIN_TOKENS
from carpool.model.quant import QuantizedLinear


def can_compile(model: LlamaModel) -> bool:
    """Tensor-parallel layers all-reduce inside `after_attention`: those stay eager. Quantized
    kernels do not stop a compile: graphs hold them as `carpool::` ops (model/cpu_kernels.py),
    also where they win at every size (AVX2 alone). Gemma's layers (sandwich norms, windows,
    soft-caps) are not the halves compiled here: they stay eager. Nor are models that keep a
    GGUF's K-quant codes (`--quantization gguf`): their steps are the kernels' time, and compiling
    gained nothing for 10-12 s of start-up (a 1B Q4_K_M model's 256-token prefill, three in a row
    through LLMEngine with enforce_eager False / True: 0.84-1.06 s compiled, 0.89-1.05 s eager;
    2-core AMD EPYC Zen 5)."""
    return model.tp.size == 1 and model.config.llama_layers and getattr(model, "quantization", None) != "gguf"


def _compile(fn):
    # Every layer of a model has the same structure and its weights are graph inputs, so guards
    # on the modules' attributes would only cost time. They are skipped; then one model's graphs
    # must never serve another (say, one without biases), so each model compiles its own copy of
    # the code: Dynamo keeps compiled graphs per code object.
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
    return torch.compile(own, dynamic=True, fullgraph=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


class CompiledLayers:
    """A model's decoder layers with their dense halves compiled: called as the eager layers
    are, in the same order (DecoderLayer.forward), with attention between the halves."""

    def __init__(self, model: LlamaModel):
        self.layers = list(model.layers)
        self.final_norm = model.norm if model.is_last else None
        # Unbound: called with the layer first, as the methods are (Dynamo compiles lazily, on
        # the first call).
        self.before_attention = _compile(DecoderLayer.before_attention)
        self.after_attention = _compile(DecoderLayer.after_attention)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, attend: AttendFn) -> torch.Tensor:
        """The hidden states after the last layer (normed on the last stage)."""
        for i, layer in enumerate(self.layers):
            q, k, v = self.before_attention(layer, x, cos, sin)
            x = self.after_attention(layer, x, attend(q, k, v, kv_cache[i], meta, layer.self_attn.scale))
        return x if self.final_norm is None else self.final_norm(x)


def warm_up_sizes(model: nn.Module, min_tokens: int = COMPILE_MIN_TOKENS) -> list[int]:
    """Token counts that reach every compiled graph: the smallest compiled step, and where an
    int4 / int8 layer switches to its tile kernel above it (quant.tile_from(): QuantizedLinear's
    forward branches on the token count, so each side is a graph of its own) that count too. A
    GGUF's own codes switch inside their C op, with no branch."""
    switches = {m.tile_from for m in model.modules()
                if isinstance(m, QuantizedLinear) and m.kq is None and m.tile_from > min_tokens}
    return [min_tokens, *sorted(switches)]

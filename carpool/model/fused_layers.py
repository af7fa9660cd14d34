"""A small step's decoder layers as one C call (csrc/fused_layers.c).

At a few tokens an eager layer is ten C kernels separated by Python: module calls, views and
output tensors, ~1,000 calls per step that together cost more than reading the weights. Where
every layer can run the C kernels (bf16 on a CPU with AVX-512 VNNI or AVX2, all linears quantized),
a step runs them in the same order from one call. Decode-only steps equal the eager layers
with the quantized kernels exactly. Steps with prefill chunks (Sarathi's hybrid steps) attend
as runs of queries (attention.QueryRuns): each chunk token computes exactly what it would as a
decode, so a chunk equals its tokens one step at a time, bit for bit (the eager path's SDPA
rounds differently).

The model runner holds this object and runs it for steps of up to FUSED_MAX_TOKENS tokens
(model/paths.py has the measurements behind that size); bigger steps, and models it cannot
serve (`build` returns None), run the other paths.
"""

from __future__ import annotations

import ctypes

import torch

from carpool.model import cpu_kernels
from carpool.model.attention import AttentionMetadata
from carpool.model.llama import LlamaModel
from carpool.model.paths import FUSED_MAX_TOKENS
from carpool.model.quant import QuantizedLinear


class QuantizedWeight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("tiles", ctypes.c_void_p), ("tile_from", ctypes.c_int64)]


class DecoderLayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_attention_norm", ctypes.c_void_p),
                ("qkv", QuantizedWeight), ("o", QuantizedWeight), ("gate_up", QuantizedWeight),
                ("down", QuantizedWeight)]


class DecoderShape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _weight(linear: QuantizedLinear) -> QuantizedWeight:
    """The layer's kernels as its forward picks them: int4/int8 codes for the integer kernel and
    the same codes as tiles from `tile_from` tokens, or a GGUF's own codes (kquant.c, both sizes)."""
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    codes, scale, low = linear.kernel.tensors if linear.kernel is not None else (None, None, None)
    tiles = linear.kq if linear.kq is not None else linear.tiles if linear.tile_from else None
    return QuantizedWeight(ptr(codes), ptr(scale), ptr(low), ptr(linear.bias),
                           None if tiles is None else ctypes.addressof(tiles.struct), linear.tile_from)


class FusedLayers:
    """The model's layers as C structs of weight pointers, bound once (the weights never move;
    the model runner, which holds the model, holds this object)."""

    def __init__(self, model: LlamaModel, max_tokens: int):
        self.max_tokens = max_tokens  # the largest step it runs
        layers = model.layers
        self.weights = (DecoderLayerWeights * len(layers))(*(
            DecoderLayerWeights(layer.input_layernorm.weight.data_ptr(),
                                layer.post_attention_layernorm.weight.data_ptr(),
                                _weight(layer.self_attn.qkv_proj), _weight(layer.self_attn.o_proj),
                                _weight(layer.mlp.gate_up_proj), _weight(layer.mlp.down_proj))
            for layer in layers))
        attn, config = layers[0].self_attn, model.config
        self.shape = DecoderShape(config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                  layers[0].mlp.inter, 0, config.rms_norm_eps, attn.scale)
        self.final_norm = model.norm.weight.data_ptr() if model.is_last else None
        self._call = cpu_kernels.library().fused_layers

    @classmethod
    def build(cls, model: LlamaModel, max_tokens: int = FUSED_MAX_TOKENS) -> FusedLayers | None:
        """The fused path for `model`, or None where its layers need the eager path."""
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        usable = (model.tp.size == 1 and model.num_local_layers > 0 and not model.config.qk_norm
                  and model.config.llama_layers
                  and model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
                  and all(isinstance(m, QuantizedLinear) and (m.kernel is not None or m.kq is not None)
                          for m in linears))
        return cls(model, max_tokens) if usable and max_tokens > 0 else None

    def can_attend(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether the C kernel can attend this step: decodes only, or with prefill chunks laid
        out as query runs (the runner builds them for steps the fused path may take)."""
        return meta.decode_mask is None and (meta.num_decodes == num_tokens or meta.runs is not None)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states after the last layer (normed on the last stage), as the eager layers
        compute them."""
        x = x.contiguous()
        assert kv_cache.is_contiguous() and x.dtype == kv_cache.dtype == torch.bfloat16
        assert cos.is_contiguous() and sin.is_contiguous()
        out = torch.empty_like(x)
        if meta.runs is None:  # decodes only: a run per token
            tables, lens, starts = meta.decode_block_tables, meta.decode_context_lens, None
        else:
            tables, lens, starts = meta.runs.block_tables, meta.runs.context_lens, meta.runs.query_starts
        self.shape.block_size = meta.block_size
        if not self._call(self.weights, len(self.weights), ctypes.byref(self.shape), x.data_ptr(), out.data_ptr(),
                          self.final_norm, x.shape[0], cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(),
                          kv_cache.shape[2], tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                          None if starts is None else starts.data_ptr(), len(lens), meta.slot_mapping.data_ptr(),
                          torch.get_num_threads()):
            raise MemoryError("fused layers: out of memory for their activations")
        return out

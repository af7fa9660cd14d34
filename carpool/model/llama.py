"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, SmolLM; Gemma 2/3) over a flat
token matrix.

All of a step's tokens, decodes and prefill chunks alike, form one [num_tokens, hidden] matrix:
every linear layer runs once over it and only attention looks at sequence boundaries.
The module can hold a contiguous slice of layers (a pipeline stage) and a 1/tp_size shard of
each projection (Megatron-style), so parallelism needs no second model class.

Gemma 2 and 3 are the same decoder with a few switches in ModelConfig: a GeGLU MLP, norms on both
sides of attention and of the MLP (`GemmaDecoderLayer`), scaled embeddings, sliding-window layers
and tanh soft-capped logits. Their attention runs `masked_paged_attention` where it needs a window
or a soft-cap (the C kernels do neither).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from carpool.config import ModelConfig
from carpool.model import cpu_kernels
from carpool.model.attention import AttendFn, AttentionMetadata, masked_paged_attention, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.fuses(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype != torch.float32:  # one fused kernel (fp32 inside); 8 small ops cost more at decode
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # fp32: exactly the reference implementation's arithmetic, so outputs match it bit for bit.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add and the next norm, one pass on CPU in bf16."""
        if cpu_kernels.fuses(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps, delta)
        x = x + delta
        return x, self(x)


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and the factor cos/sin are multiplied by (yarn's attention factor;
    1.0 for the others). default / linear / llama3 are computed here; every other type (yarn,
    dynamic, longrope, ...) by transformers' ROPE_INIT_FUNCTIONS, as its models do.

    `dynamic` (NTK) recomputes its frequencies in transformers only for sequences longer than
    max_position_embeddings, which carpool never runs (max_model_len is capped there), so the
    static frequencies at max_position_embeddings computed once here are exactly what
    transformers uses for every sequence carpool can hold."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept; the band between is blended.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        blend = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - blend) * scaled / factor + blend * scaled
        in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(in_band, blended, scaled), 1.0
    return _transformers_rope(config, kind, scaling)


def _transformers_rope(config: ModelConfig, kind: str, scaling: dict) -> tuple[torch.Tensor, float]:
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)})")
    params = {k: v for k, v in scaling.items() if k != "type"}
    params.update(rope_type=kind, rope_theta=config.rope_theta)
    hf = PretrainedConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
                          head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                          rope_parameters=params)
    with torch.device("cpu"):  # also when the model is being built on the meta device
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    if inv_freq.shape[0] != config.head_dim // 2:
        raise ValueError(f"rope scaling {kind!r} with a partial rotary dimension is not supported")
    return inv_freq.float(), float(attention_scaling)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    return rope_parameters(config)[0]


class RotaryEmbedding(nn.Module):
    """Looks up cos/sin for a step's positions once; every layer reuses them.

    As vLLM does, the values for every position the model can hold are computed once (per dtype,
    at the first step, in fp32 from the config; as transformers computes them): a lookup a step
    instead of eight small ops. Nothing is stored before then, so building the model on the meta
    device and casting it leave the frequencies untouched."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        with torch.device("cpu"):  # the model is built on meta, where torch's reference ops would
            self.attention_scaling = rope_parameters(config)[1]  # import torch._dynamo: 1.5 s of start-up
        self.max_positions = config.max_position_embeddings
        self._tables: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [2 (cos, sin), positions, head_dim]

    def table(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if dtype not in self._tables:
            inv_freq = rope_parameters(self.config)[0].to(device)
            positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if self.attention_scaling != 1.0:  # yarn: as transformers, on the fp32 cos/sin
                cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
            self._tables[dtype] = torch.stack((cos, sin)).to(dtype)
        return self._tables[dtype]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.table(dtype, positions.device).index_select(1, positions)
        return rows[0][:, None, :], rows[1][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight oneDNN has pre-packed into its blocked layout.
    On CPU in bf16 this skips a per-call weight reorder: decode GEMVs run ~1.5x faster and
    larger GEMMs bit-identically (measured; see BENCHMARKS.md)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the packed weight is opaque to Inductor: an extern call
            return packed_linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.library.custom_op("carpool::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
                  ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class TiledLinear(nn.Module):
    """A bf16 linear layer whose weight is stored as kquant.c's tiles (16 rows' channel pairs
    together), multiplied by its bf16 kernels: `vdpbf16ps` below AMX_FROM tokens, AMX from there
    where the CPU has it; fp32 FMAs on the widened bf16 values on CPUs with AVX2 and no AVX-512,
    where oneDNN neither packs nor multiplies bf16 fast. On an Intel Xeon with AMX whose memory
    reads at 19.8 GB/s, oneDNN's packed GEMV read a 1B model's gate/up weight at 7.6 GB/s; over
    all of that model's linears the tiles ran 2.09x faster at one token, 1.83x at 16, 1.33x at 64
    and 0.94x at 256 (`carpool bench quant`, BENCHMARKS.md "Kernels")."""

    AMX_FROM = 16

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.bias = linear.bias
        self.register_buffer("tiles", cpu_kernels.bf16_tiles(linear.weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_kernels.bf16_tiles_matmul(x.reshape(-1, x.shape[-1]), self.tiles, self.out_features, self.AMX_FROM)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Swap every nn.Linear for a TiledLinear where kquant.c multiplies bf16 tiles, else a
    PackedLinear where oneDNN packs bf16 (CPU, bf16 only); returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if cpu_kernels.has_bf16_tiles() and all(child.in_features % 32 == 0 for _, _, child in swaps):
        layer = TiledLinear
    elif _onednn_packs_bf16():
        layer = PackedLinear
    else:
        return 0
    for parent, name, child in swaps:
        setattr(parent, name, layer(child))
    return len(swaps)


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN packs bf16 linears here (PackedLinear)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _onednn_packs_bf16()


@functools.cache
def _onednn_packs_bf16() -> bool:
    """oneDNN packs bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere
    (AVX2 alone) the reorder raises, and bf16 linears stay plain torch ones."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class TensorParallel:
    """Rank and group of this shard; a no-op when tp_size == 1."""

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on the group's first rank (None elsewhere)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x.contiguous(), parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's [start, start + rows) slice of the vocabulary; the last slice is padded."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: a rank looks up the ids in its slice, zeros
    the others, and the all-reduce sums the one non-zero row per token."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, self.rows = tp.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, layer: int = 0):
        super().__init__()
        if config.num_heads % tp.size or config.num_kv_heads % tp.size:
            raise ValueError(f"{config.num_heads} heads / {config.num_kv_heads} KV heads "
                             f"do not split over tensor-parallel size {tp.size}")
        self.tp = tp
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = config.num_kv_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        # What plain paged attention cannot do (Gemma, Mistral v0.1, Phi-3): None where this layer
        # has none of it.
        self.window = config.sliding_window if layer in config.sliding_layers else None
        self.softcap = config.attn_logit_softcap
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:  # Qwen3, Gemma 3
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def masked(self, meta: AttentionMetadata) -> bool:
        """Whether this step needs masked_paged_attention: soft-capped logits, or a window some
        query's context passes (within it the window changes nothing)."""
        return self.softcap is not None or (self.window is not None and meta.longest_context > self.window)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D]: the fused QKV projection, RoPE applied."""
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = cpu_kernels.rope_(qk, cos, sin) if cpu_kernels.fuses(qk) else apply_rope(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        if config.intermediate_size % tp.size:
            raise ValueError(f"intermediate size {config.intermediate_size} does not split over "
                             f"tensor-parallel size {tp.size}")
        self.tp = tp
        self.gelu = config.hidden_act == "gelu_tanh"  # Gemma's GeGLU; else SwiGLU
        self.inter = config.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if not self.gelu and cpu_kernels.fuses(gate_up):
            return self.tp.all_reduce(self.down_proj(cpu_kernels.silu_mul(gate_up)))
        gate, up = gate_up.split(self.inter, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.tp.all_reduce(self.down_proj(act * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, attend: AttendFn = paged_attention) -> torch.Tensor:
        q, k, v = self.before_attention(x, cos, sin)
        a = self.self_attn
        if attend is paged_attention and a.masked(meta):
            o = masked_paged_attention(q, k, v, cache, meta, a.scale, a.window, a.softcap)
        else:  # plain causal attention, or a stand-in (the profiler's), called as is
            o = attend(q, k, v, cache, meta, a.scale)
        return self.after_attention(x, o)

    # The dense halves of a layer, on either side of attention (the only part that looks at
    # sequence boundaries): pure functions of tensors, so model/compiled.py can compile copies.
    def before_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn.output(o))
        return x + self.mlp(h)


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 2 / 3: attention's output and the MLP's output are normed before their residual add
    (`post_attention_layernorm` is that first norm here, not the MLP's input norm as in Llama),
    and attention may slide or soft-cap."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, layer: int = 0):
        super().__init__(config, tp, layer)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def after_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(self.self_attn.output(o)))
        return x + self.post_feedforward_layernorm(self.mlp(h))


class LlamaModel(nn.Module):
    """Layers [first_layer, last_layer) of the decoder; embedding on the first stage,
    final norm and LM head on the last."""

    def __init__(self, config: ModelConfig, first_layer: int = 0, last_layer: int | None = None,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.first_layer = first_layer
        self.last_layer = config.num_layers if last_layer is None else last_layer
        self.is_first = first_layer == 0
        self.is_last = self.last_layer == config.num_layers
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's sliding layers rotate with their own base and no scaling.
        self.local_rotary = None if config.rope_local_theta is None else RotaryEmbedding(
            dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None))
        if self.is_first:
            # `_weight`: no random init, which on the meta device would import torch._dynamo (1.8 s)
            self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size,
                                              _weight=torch.empty(config.vocab_size, config.hidden_size))
                                 if self.tp.size == 1
                                 else VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp))
        layer_class = GemmaDecoderLayer if config.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer_class(config, self.tp, i) for i in range(self.first_layer, self.last_layer))
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            # Vocabulary-parallel: this rank's rows of the LM head (all of them without TP).
            self.lm_head = nn.Linear(config.hidden_size, self.tp.vocab_range(config.vocab_size)[1], bias=False)
        self.requires_grad_(False)

    @property
    def num_local_layers(self) -> int:
        return self.last_layer - self.first_layer

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor | list[torch.Tensor], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None, attend: AttendFn = paged_attention) -> torch.Tensor:
        """kv_cache: [local_layers, 2, num_slots, kv_heads, head_dim], or each layer's [2, num_slots,
        kv_heads, head_dim] (model_runner.KVLayout). Returns hidden states
        (normed on the last stage). `attend` is the attention kernel every layer calls."""
        x, cos, sin = self.layer_inputs(input_ids, positions, hidden)
        local = (cos, sin) if self.local_rotary is None else self.local_rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            c, s = local if layer.self_attn.window is not None else (cos, sin)
            x = layer(x, c, s, kv_cache[i], meta if meta.per_layer is None else meta.per_layer[i], attend)
        return self.norm(x) if self.is_last else x

    def layer_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                     hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input (embedded ids on the first stage, the previous stage's hidden
        states after it) and the step's RoPE cos/sin: what every path through the layers starts from."""
        if self.is_first:
            x = self.embed_tokens(input_ids)
            if self.config.scale_embeddings:  # Gemma: by sqrt(hidden) rounded to the dtype, as transformers
                x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        else:
            x = hidden
        return x, *self.rotary.cos_sin(positions, x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab]; with TP each rank computes its vocabulary slice and the first
        rank gathers them (the others get None)."""
        logits = self.lm_head(hidden).float()
        if self.config.final_logit_softcap is not None:  # Gemma 2
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_last_dim(logits)
        return None if logits is None else logits[:, :self.config.vocab_size]

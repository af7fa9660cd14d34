"""Writing GGUF K-quants without llama.cpp: a numpy encoder, llama-quantize's per-tensor mixes, and
a requantizer for whole files (tests and benchmarks need Q4_K_M etc. copies of their models).

`quantize` gives a tensor's raw block bytes. Q2_K .. Q6_K are round-to-nearest forms of llama.cpp's
reference quantizers (its `quantize_row_q*_K_ref` search scales iteratively; here each scale comes
from its sub-block's range in one step):

  * Q2_K, Q4_K, Q5_K (w = d sc q - dmin m): per sub-block (16, 32, 32 channels) a scale
    (max - min') / Q and a min m = -min' >= 0, where min' = min(min(w), 0) and Q the largest code;
    the super-block's d = max scale / L and dmin = max min / L (L = 15 for Q2_K's 4-bit sub-scales,
    63 for the 6-bit ones), sub-scales rounded to 0 .. L, codes round((w + dmin m) / (d sc))
    clipped to 0 .. Q.
  * Q3_K, Q6_K (w = d sc (q - n), symmetric): per 16 channels the scale v / -n with v the value of
    largest magnitude (so v itself is a code, -n), n = 4 or 32; d = (scale of largest magnitude) / -L'
    (L' = 32, 128), sub-scales rounded and clipped to 6-bit / int8, codes round(w / (d sc)) clipped.

  * IQ4_NL, IQ4_XS (w = d sc t[q], t the 16 int8 values of gguf.quants.IQ4_NL.kvalues): the first step
    of llama.cpp's quantize_row_iq4_nl_impl, without its search over scales. Per 32 channels the
    scale v / -127 (v the value of largest magnitude, so v is t[0] times it); IQ4_NL stores it as
    d, IQ4_XS as d = (scale of largest magnitude) / -32 and sc = its rounding to -32 .. 31. Each
    code is the table entry nearest w / (d sc).

Every rounding is round-half-even (llama.cpp's nearest_int), d and dmin are fp16. The legacy types
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are gguf-py's own quantizers.

`tensor_type` follows llama.cpp's llama_tensor_get_type (src/llama-quant.cpp) for dense models
without an importance matrix; its rules for 8-expert models, Falcon and 70B Llamas are left out.
Where a row length is not a multiple of 256 it falls back as llama.cpp does (tensor_type_fallback).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

QK_K = 256  # channels per K-quant super-block


# ---------------------------------------------------------------- scales and codes

def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """fp16 [blocks] -> its little-endian bytes [blocks, 2]."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _level(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative per-sub-block values [blocks, subs] -> (fp16 super scale max / levels, the
    values rounded to 0 .. levels in its units)."""
    top = values.max(axis=1)
    with np.errstate(divide="ignore"):
        inverse = np.where(top > 0, np.float32(levels) / top, np.float32(0))
    codes = np.clip(np.rint(values * inverse[:, None]), 0, levels).astype(np.uint8)
    return (top / np.float32(levels)).astype(np.float16), codes


def _asymmetric(blocks: np.ndarray, sub: int, top_code: int, levels: int):
    """Q2_K / Q4_K / Q5_K's codes and scales (module doc) for blocks [B, 256]."""
    x = blocks.reshape(len(blocks), QK_K // sub, sub)
    low = np.minimum(x.min(axis=2), 0)
    d, sc = _level((x.max(axis=2) - low) / np.float32(top_code), levels)
    dmin, mn = _level(-low, levels)
    step = d.astype(np.float32)[:, None] * sc  # the decoder's own products
    offset = dmin.astype(np.float32)[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    return np.clip(q, 0, top_code).astype(np.uint8).reshape(len(blocks), QK_K), sc, mn, d, dmin


def _largest(a: np.ndarray) -> np.ndarray:
    """The entry of largest magnitude along the last axis, with its sign."""
    return np.take_along_axis(a, np.abs(a).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _symmetric(blocks: np.ndarray, n: int, levels: int, lowest: int, highest: int):
    """Q3_K / Q6_K's codes (offset by n) and int sub-scales for blocks [B, 256], 16 channels each."""
    x = blocks.reshape(len(blocks), 16, 16)
    scale = _largest(x) / np.float32(-n)  # [B, 16]
    top = _largest(scale)  # the sub-scale of largest magnitude, signed
    with np.errstate(divide="ignore"):
        inverse = np.where(top != 0, np.float32(-levels) / top, np.float32(0))
    sc = np.clip(np.rint(scale * inverse[:, None]), lowest, highest).astype(np.int8)
    d = (top / np.float32(-levels)).astype(np.float16)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] != 0, np.rint(x / step[..., None]), 0)
    return (np.clip(q, -n, n - 1) + n).astype(np.uint8).reshape(len(blocks), QK_K), sc, d


def _pack(fields: np.ndarray, width: int) -> np.ndarray:
    """Fields [..., F, L] of `width` bits each -> bytes [..., L], field i at bits width * i."""
    out = np.zeros(fields.shape[:-2] + fields.shape[-1:], np.uint8)
    for i in range(fields.shape[-2]):
        out |= fields[..., i, :] << np.uint8(width * i)
    return out


def _scales_6bit(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 8 scales and 8 mins (6 bits each) -> their 12 bytes (get_scale_min's inverse)."""
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    q, sc, mn, d, dmin = _asymmetric(blocks, 16, 3, 15)
    qs = _pack(q.reshape(-1, 2, 4, 32), 2).reshape(-1, 64)
    return np.concatenate([sc | (mn << 4), qs, _fp16_bytes(d), _fp16_bytes(dmin)], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric(blocks, 4, 32, -32, 31)
    hmask = _pack((q >> 2).reshape(-1, 8, 32), 1)
    qs = _pack((q & 3).reshape(-1, 2, 4, 32), 2).reshape(-1, 64)
    s = (sc.astype(np.int16) + 32).astype(np.uint8)  # 0 .. 63
    scales = np.concatenate([(s[:, :8] & 15) | ((s[:, 8:] & 15) << 4), _pack((s >> 4).reshape(-1, 4, 4), 2)], axis=1)
    return np.concatenate([hmask, qs, scales, _fp16_bytes(d)], axis=1)


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    q, sc, mn, d, dmin = _asymmetric(blocks, 32, 2 ** bits - 1, 63)
    qs = _pack((q & 15).reshape(-1, 4, 2, 32), 4).reshape(-1, 128)
    high = [_pack((q >> 4).reshape(-1, 8, 32), 1)] if bits == 5 else []
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _scales_6bit(sc, mn), *high, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric(blocks, 32, 128, -128, 127)
    halves = q.reshape(-1, 2, 4, 32)  # [B, half, quarter, channel]
    low = (halves & 15).reshape(-1, 2, 2, 2, 32)  # quarter = 2 * nibble + part
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = _pack(halves >> 4, 2).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1)


IQ4_VALUES = np.array(gguf_quants.IQ4_NL.kvalues, np.float32)


def _iq4_codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Blocks [B, S, 32] and their steps [B, S] -> the index of the table entry nearest x / step,
    packed 16 bytes per 32 channels (channel j in byte j's low nibble, j + 16 in its high one)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(step[..., None] != 0, x / step[..., None], 0)
    q = np.empty(scaled.shape, np.uint8)
    for at in range(0, len(x), 1 << 14):  # in slices: the distances take 16 floats per weight
        part = scaled[at:at + (1 << 14)]
        q[at:at + len(part)] = np.abs(part[..., None] - IQ4_VALUES).argmin(axis=-1)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(len(x), -1)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    x = blocks.reshape(len(blocks), 1, 32)
    d = (_largest(x[:, 0]) / np.float32(IQ4_VALUES[0])).astype(np.float16)
    return np.concatenate([_fp16_bytes(d), _iq4_codes(x, d.astype(np.float32)[:, None])], axis=1)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    x = blocks.reshape(len(blocks), 8, 32)
    scale = _largest(x) / np.float32(IQ4_VALUES[0])  # [B, 8]
    d = (_largest(scale) / np.float32(-32)).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] != 0, np.clip(np.rint(scale / d32[:, None]), -32, 31), 0).astype(np.int16)
    codes = _iq4_codes(x, d32[:, None] * sc)
    s = (sc + 32).astype(np.uint8)  # 0 .. 63: 4 low bits in scales_l, 2 high in scales_h
    high = ((s >> 4).astype(np.uint16) << np.arange(0, 16, 2, dtype=np.uint16)).sum(axis=1, dtype=np.uint16)
    scales_l = (s[:, 0::2] & 15) | ((s[:, 1::2] & 15) << 4)
    return np.concatenate([_fp16_bytes(d), high.astype("<u2").view(np.uint8).reshape(-1, 2), scales_l, codes],
                          axis=1)


_K_ENCODERS = {T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: lambda b: _q45_k(b, 4), T.Q5_K: lambda b: _q45_k(b, 5),
               T.Q6_K: _q6_k, T.IQ4_XS: _iq4_xs}
LEGACY = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0})
SUPPORTED = frozenset(_K_ENCODERS) | LEGACY | {T.IQ4_NL}


def quantize(w: np.ndarray, qtype: T | str) -> np.ndarray:
    """float32 [..., K] -> the GGUF block bytes [..., row bytes] of `qtype` (a type or its name)."""
    qtype = T[qtype] if isinstance(qtype, str) else T(qtype)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype in LEGACY:
        return gguf_quants.quantize(w, qtype)
    if qtype == T.IQ4_NL:
        if w.shape[-1] % 32:
            raise ValueError(f"IQ4_NL rows hold blocks of 32; K = {w.shape[-1]}")
        return _iq4_nl(w.reshape(-1, 32)).reshape(*w.shape[:-1], -1)
    if qtype not in _K_ENCODERS:
        raise ValueError(f"no encoder for {qtype.name}; supported: {', '.join(sorted(t.name for t in SUPPORTED))}")
    k = w.shape[-1]
    if k % QK_K:
        raise ValueError(f"{qtype.name} rows hold super-blocks of {QK_K}; K = {k}")
    raw = _K_ENCODERS[qtype](w.reshape(-1, QK_K))
    assert raw.shape[1] == GGML_QUANT_SIZES[qtype][1]
    return raw.reshape(*w.shape[:-1], k // QK_K * raw.shape[1])


# ---------------------------------------------------------------- llama-quantize's mixes

# mix name -> the type most tensors get (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
LLAMA_CPP_MIXES: dict[str, T] = {
    "Q2_K": T.Q2_K, "Q3_K_S": T.Q3_K, "Q3_K_M": T.Q3_K, "Q3_K_L": T.Q3_K, "Q4_K_S": T.Q4_K, "Q4_K_M": T.Q4_K,
    "Q5_K_S": T.Q5_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K,
    "Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q5_0": T.Q5_0, "Q5_1": T.Q5_1, "Q8_0": T.Q8_0,
    "IQ4_NL": T.IQ4_NL, "IQ4_XS": T.IQ4_XS,
}
# where a row does not hold whole super-blocks (llama.cpp's tensor_type_fallback)
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.IQ4_XS: T.IQ4_NL}
# weights llama-quantize copies unquantized, besides 1-D tensors
_KEPT = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight",
         "ssm_conv1d.weight", "attn_rel_b.weight")
_LAYER = re.compile(r"blk\.(\d+)\.")


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _rule(name: str, mix: str, default: T, layer: int, n_layers: int, n_gqa: int, is_output: bool) -> T:
    """The type llama_tensor_get_type picks before its fallback for rows that are not whole super-blocks."""
    if is_output:
        return T.Q8_0 if default == T.Q8_0 else T.Q6_K
    if "attn_v.weight" in name:
        if mix == "Q2_K":
            return T.Q4_K if n_gqa >= 4 else T.Q3_K
        if mix == "Q3_K_M":
            return T.Q5_K if layer < 2 else T.Q4_K
        if mix == "Q3_K_L":
            return T.Q5_K
        if mix in ("IQ4_NL", "IQ4_XS") and n_gqa >= 4:
            return T.Q5_K
        if mix in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, n_layers):
            return T.Q6_K
        if mix == "Q4_K_S" and layer < 4:
            return T.Q5_K
    elif "ffn_down" in name:
        if mix == "Q2_K":
            return T.Q3_K
        if mix == "Q3_K_M":
            return T.Q5_K if layer < n_layers // 16 else T.Q4_K
        if mix == "Q3_K_L":
            return T.Q5_K
        if mix == "Q4_K_M" and _more_bits(layer, n_layers):
            return T.Q6_K
        if mix in ("IQ4_NL", "IQ4_XS") and layer < n_layers // 8:
            return T.Q5_K
        if mix == "Q5_K_M" and _more_bits(layer, n_layers):
            return T.Q6_K
        if mix == "Q4_K_S" and layer < n_layers // 8:
            return T.Q5_K
    elif "attn_output.weight" in name:
        return {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(mix, default)
    elif "attn_qkv.weight" in name:
        return {"Q3_K_M": T.Q4_K, "Q3_K_L": T.Q4_K, "Q4_K_M": T.Q5_K, "Q5_K_M": T.Q6_K}.get(mix, default)
    return default


def tensor_type(name: str, shape: Sequence[int], mix: str, n_layers: int, *, n_gqa: int = 1,
                tied_output: bool = False) -> str:
    """The type llama-quantize gives tensor `name` of numpy shape `shape` (rows last: [..., K]) in
    `mix`, for a dense model of `n_layers` blocks and n_gqa query heads per KV head. With
    `tied_output` (no output.weight in the file) token_embd.weight is treated as the output.
    Tensors llama.cpp leaves unquantized (1-D, norms, ...) are F32 here."""
    if mix not in LLAMA_CPP_MIXES:
        raise ValueError(f"unknown mix {mix!r}; known: {', '.join(LLAMA_CPP_MIXES)}")
    if len(shape) < 2 or not name.endswith("weight") or any(kept in name for kept in _KEPT):
        return T.F32.name
    default = LLAMA_CPP_MIXES[mix]
    is_output = name == "output.weight" or (tied_output and name == "token_embd.weight")
    found = _LAYER.search(name)
    qtype = _rule(name, mix, default, int(found.group(1)) if found else 0, n_layers, n_gqa, is_output)
    k = shape[-1]
    if k % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, T.F16)
        if k % GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F16
    return qtype.name


# ---------------------------------------------------------------- files

def _hparam(reader: GGUFReader, key: str, default: int) -> int:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return int(max(value)) if isinstance(value, list) else int(value)  # per-layer lists: the largest


def requantize_gguf(src: str, dst: str, mix: str) -> dict[str, str]:
    """Write `src` (a GGUF of any types) to `dst` with its tensors in llama-quantize's `mix` and
    every metadata field copied unchanged; returns {tensor name: type name}. As llama-quantize
    does, a tensor already in its new type is copied byte for byte; the rest are dequantized to
    fp32 (gguf-py) and quantized again. Tensors are written one at a time (one in memory)."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layers = _hparam(reader, f"{arch}.block_count", 0)
    heads = _hparam(reader, f"{arch}.attention.head_count", 1)
    kv_heads = _hparam(reader, f"{arch}.attention.head_count_kv", heads)
    n_gqa = heads // kv_heads if kv_heads else 1
    tied = not any(t.name == "output.weight" for t in reader.tensors)

    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer's own
        if field.name == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)

    plan = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order, rows last
        qtype = T[tensor_type(t.name, shape, mix, n_layers, n_gqa=n_gqa, tied_output=tied)]
        plan[t.name] = qtype
        if qtype in (T.F32, T.F16):
            dtype = np.float32 if qtype == T.F32 else np.float16
            writer.add_tensor_info(t.name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                   raw_dtype=qtype)
        else:
            byte_shape = gguf_quants.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        qtype = plan[t.name]
        if qtype == t.tensor_type:
            data = np.asarray(t.data)
        else:
            w = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type)
            w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
            data = w.astype(np.float16) if qtype == T.F16 else w.astype(np.float32) if qtype == T.F32 \
                else quantize(w, qtype)
        writer.write_tensor_data(data)
    writer.close()
    return {name: qtype.name for name, qtype in plan.items()}


# Llama-family shapes for `random_gguf`: hidden, FFN, layers, heads, KV heads, tied embeddings.
RANDOM_SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, True),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, False),
}


def random_gguf(dst: str, shape: str | tuple[int, int, int, int, int, bool], mix: str, tokenizer_from: str,
                seed: int = 0) -> dict[str, str]:
    """A random-weight Llama GGUF of a real model's `shape` (a RANDOM_SHAPES name, or such a tuple)
    in llama-quantize's `mix`,
    with the tokenizer and chat template of the GGUF `tokenizer_from` (its vocabulary sets the
    embedding's rows): speed and memory measurements at sizes no download can give here. Each
    (shape, type) is quantized once and its bytes written for every tensor that has it, so an 8B
    file takes a minute; the layers read distinct copies all the same. Returns {tensor: type}."""
    hidden, ffn, n_layers, heads, kv_heads, tied = RANDOM_SHAPES[shape] if isinstance(shape, str) else shape
    source = GGUFReader(tokenizer_from)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    head_dim = hidden // heads
    writer = GGUFWriter(dst, "llama")
    writer.add_name(f"random {shape}" if isinstance(shape, str) else "random")
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)

    tensors = {"token_embd.weight": (vocab, hidden)}
    for i in range(n_layers):
        b = f"blk.{i}."
        tensors |= {b + "attn_norm.weight": (hidden,), b + "attn_q.weight": (heads * head_dim, hidden),
                    b + "attn_k.weight": (kv_heads * head_dim, hidden), b + "attn_v.weight": (kv_heads * head_dim, hidden),
                    b + "attn_output.weight": (hidden, heads * head_dim), b + "ffn_norm.weight": (hidden,),
                    b + "ffn_gate.weight": (ffn, hidden), b + "ffn_up.weight": (ffn, hidden),
                    b + "ffn_down.weight": (hidden, ffn)}
    tensors["output_norm.weight"] = (hidden,)
    if not tied:
        tensors["output.weight"] = (vocab, hidden)
    plan = {name: T[tensor_type(name, dims, mix, n_layers, n_gqa=heads // kv_heads, tied_output=tied)]
            for name, dims in tensors.items()}
    rng = np.random.default_rng(seed)
    data: dict[tuple, np.ndarray] = {}
    for name, dims in tensors.items():
        qtype = plan[name]
        if (dims, qtype) not in data:
            if qtype == T.F32:  # norms
                data[dims, qtype] = np.ones(dims, np.float32)
            else:
                w = rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)
                data[dims, qtype] = w.astype(np.float16) if qtype == T.F16 else quantize(w, qtype)
        raw = data[dims, qtype]
        writer.add_tensor_info(name, raw.shape, raw.dtype, raw.nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in tensors.items():
        writer.write_tensor_data(data[dims, plan[name]])
    writer.close()
    return {name: qtype.name for name, qtype in plan.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m carpool.model.gguf_encode",
        description="Requantize a GGUF into a llama-quantize mix, or write a random-weight one (numpy, no llama.cpp).")
    parser.add_argument("src", help="input .gguf (any tensor types), or random:SHAPE for random weights in "
                                    f"one of {', '.join(RANDOM_SHAPES)} with the embedded model's tokenizer")
    parser.add_argument("dst", help="output .gguf")
    parser.add_argument("--mix", default="Q4_K_M", choices=list(LLAMA_CPP_MIXES), help="llama-quantize type mix")
    args = parser.parse_args(argv)
    if args.src.startswith("random:"):
        from carpool.config import default_model_path
        shape = args.src.removeprefix("random:")
        if shape not in RANDOM_SHAPES:
            parser.error(f"unknown shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
        types = random_gguf(args.dst, shape, args.mix, default_model_path())
    else:
        types = requantize_gguf(args.src, args.dst, args.mix)
    for name, count in sorted(Counter(types.values()).items()):
        print(f"{name:6} {count:4d} tensors")


if __name__ == "__main__":
    main()

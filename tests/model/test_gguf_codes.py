"""GGUF tensors decoded into the kq form: gguf-py's own dequantization reproduced bit for bit,
the kernel's packed layout checked against its spec formulas, and sharding by rows / columns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.model import gguf_codes
from carpool.model.gguf_codes import SUPPORTED, decode, dequantize, encode_q4_1, pack, unpack
from carpool.model.quant import quantize_q4_1
from tests.helpers import examples

TYPES = sorted(SUPPORTED, key=lambda t: t.value)
# Byte offsets of each block's fp16 fields (d, dmin), from the block structs in ggml-common.h.
FP16_FIELDS = {T.Q4_0: [0], T.Q8_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q2_K: [80, 82], T.Q3_K: [108],
               T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}
# Largest code per type (2- and 3-bit codes are held as 4-bit ones; the IQ4 types' are 4-bit
# indices into their table).
MAX_CODE = {T.Q4_0: 15, T.Q8_0: 255, T.Q4_1: 15, T.Q5_0: 31, T.Q5_1: 31, T.Q2_K: 3, T.Q3_K: 7, T.Q4_K: 15, T.Q5_K: 31,
            T.Q6_K: 63, T.IQ4_NL: 15, T.IQ4_XS: 15}
FIELDS = ("q", "sc", "mn", "d", "dmin")


def random_raw(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid raw bytes [N, row bytes]: random bytes, the fp16 fields overwritten by finite values
    (some negative, some zero, some subnormal)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        values = rng.standard_normal((n, k // block_size)) * 10.0 ** rng.integers(-7, 1, (n, k // block_size))
        values[rng.random(values.shape) < 0.05] = 0
        blocks[..., at:at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def same_codes(a, b) -> bool:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and (x.dtype != y.dtype or not np.array_equal(x, y))):
            return False
    return (a.super_size, a.offset, a.bits, a.lookup) == (b.super_size, b.offset, b.bits, b.lookup)


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def check_decode(qtype: T, raw: np.ndarray, n: int, k: int) -> gguf_codes.QuantCodes:
    codes = decode(raw, qtype, (n, k))
    assert (codes.n, codes.k) == (n, k)
    assert codes.q.dtype == np.uint8 and codes.q.max() <= MAX_CODE[qtype] < 2 ** codes.bits
    assert codes.d.dtype == np.float16 and codes.d.shape == (n, k // codes.super_size)
    # the file's own sub-scales, not repeated: per 32 channels for Q4_K, Q5_K, IQ4_XS
    assert codes.sub_size == (16 if qtype in (T.Q2_K, T.Q3_K, T.Q6_K) else 32)
    for name in ("sc", "mn"):
        if getattr(codes, name) is not None:
            assert getattr(codes, name).dtype == np.int8 and getattr(codes, name).shape == (n, k // codes.sub_size)
    assert_bitwise(dequantize(codes), gguf_dequantize(raw, qtype))
    return codes


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_random_blocks_matches_gguf(qtype):
    n, k = 37, 512
    raw = random_raw(qtype, n, k)
    codes = check_decode(qtype, raw, n, k)
    assert codes.q.max() == MAX_CODE[qtype]  # every code bit reached the codes
    assert same_codes(decode(raw.ravel(), qtype, (n, k)), codes)  # flat bytes


def test_decode_reads_a_memmap(tmp_path):
    raw = random_raw(T.Q5_K, 20, 256, seed=3)
    raw.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r", shape=raw.shape)
    assert same_codes(decode(mapped, T.Q5_K, (20, 256)), decode(raw, T.Q5_K, (20, 256)))


@pytest.mark.parametrize("qtype", [t for t in TYPES if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)], ids=lambda t: t.name)
def test_decode_gguf_quantized_floats(qtype):
    """Tensors as gguf-py writes them (it quantizes only the legacy types)."""
    w = np.random.default_rng(1).standard_normal((19, 96)).astype(np.float32)
    check_decode(qtype, gguf_quantize(w, qtype), 19, 96)


@settings(max_examples=examples(60))
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 40), blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_decode_any_shape_matches_gguf(qtype, n, blocks, seed):
    k = blocks * GGML_QUANT_SIZES[qtype][0]
    check_decode(qtype, random_raw(qtype, n, k, seed), n, k)


@settings(max_examples=examples(40))
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 40), blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_unpack_inverts_pack_and_padding_is_zero(qtype, n, blocks, seed):
    k = blocks * GGML_QUANT_SIZES[qtype][0]
    codes = decode(random_raw(qtype, n, k, seed), qtype, (n, k))
    packed = pack(codes)
    assert same_codes(unpack(packed), codes)
    b = -(-n // 16)
    assert packed.lo.shape == (b, k // 32, 8 if codes.bits == 8 else 4, 16, 4)
    assert packed.d.shape == (b, k // codes.super_size, 16)
    assert packed.hi is None if codes.bits in (4, 8) else packed.hi.shape == (b, k // 32, codes.bits - 4, 8, 8)
    pad = b * 16 - n
    if pad:  # the last block's rows n.. : zero codes and scales
        last = 16 - pad
        assert not packed.lo[-1, :, :, last:].any()
        for name in ("sc", "mn"):
            assert getattr(packed, name) is None or not getattr(packed, name)[-1, ..., last:].any()
        for name in ("d", "dmin"):
            assert getattr(packed, name) is None or not getattr(packed, name)[-1, :, last:].view(np.uint16).any()
        if packed.hi is not None:  # no field of rows n..: byte i is row i // 4's
            assert not packed.hi[-1].reshape(k // 32, -1, 64)[..., 4 * last:].any()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q3_K, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_pack_follows_the_layout_formulas(qtype):
    """Every packed element against kq_layout.md's formula for it, index by index."""
    n, k = 21, 512
    c = decode(random_raw(qtype, n, k, seed=5), qtype, (n, k))
    p = pack(c)
    q = np.concatenate([c.q, np.zeros((-n % 16, k), np.uint8)])
    b, g, j, r, ch = np.indices(p.lo.shape)
    want = (q[16 * b + r, 32 * g + 4 * j + ch] & 15) | ((q[16 * b + r, 32 * g + 16 + 4 * j + ch] & 15) << 4)
    np.testing.assert_array_equal(p.lo, want)
    if c.bits > 4:
        planes = c.bits - 4
        fields = p.hi.reshape(*p.hi.shape[:3], 64)  # [B, G, v, byte]
        b, g, v, i, s = np.indices(fields.shape + (8 // planes,))
        j = 8 * v // planes + s
        col = np.where(j < 4, 4 * j + i % 4, 16 + 4 * (j - 4) + i % 4)
        want = q[16 * b + i // 4, 32 * g + col] >> 4
        np.testing.assert_array_equal((fields[..., None] >> (planes * s)) & ((1 << planes) - 1), want)
    for name in ("sc", "mn"):
        if getattr(c, name) is not None:
            full = np.concatenate([getattr(c, name), np.zeros((-n % 16, k // c.sub_size), np.int8)])
            b, g, u, r = np.indices(getattr(p, name).shape)
            subs = 32 // c.sub_size
            assert getattr(p, name).shape[2] == subs
            np.testing.assert_array_equal(getattr(p, name), full[16 * b + r, subs * g + u])
    for name in ("d", "dmin"):
        if getattr(c, name) is not None:
            full = np.concatenate([getattr(c, name), np.zeros((-n % 16, k // c.super_size), np.float16)])
            b, s, r = np.indices(getattr(p, name).shape)
            np.testing.assert_array_equal(getattr(p, name), full[16 * b + r, s])


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q2_K, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rows_and_columns_slice_the_weight(qtype):
    s = 256 if qtype.name.endswith("_K") else 32
    n, k = 24, 4 * s
    codes = decode(random_raw(qtype, n, k, seed=7), qtype, (n, k))
    w = dequantize(codes)
    perm = np.random.default_rng(0).permutation(n)
    assert_bitwise(dequantize(codes.rows(perm)), w[perm])
    assert_bitwise(dequantize(codes.rows(slice(8, 20))), w[8:20])
    assert_bitwise(dequantize(codes.columns(s, 3 * s)), w[:, s:3 * s])
    assert_bitwise(dequantize(codes.rows(perm[:5]).columns(2 * s, 4 * s)), w[perm[:5], 2 * s:])
    for start, stop in [(16, 2 * s), (0, s + 16), (0, 0), (0, 5 * s), (2 * s, s)]:
        with pytest.raises(ValueError, match="super-blocks"):
            codes.columns(start, stop)


@settings(max_examples=examples(40))
@given(n=st.integers(1, 40), groups=st.integers(1, 4), seed=st.integers(0, 2**32 - 1), flat=st.booleans())
def test_encode_q4_1_matches_quantize_q4_1(n, groups, seed, flat):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, 32 * groups)) * 10.0 ** rng.integers(-4, 2)).astype(np.float32)
    if flat:  # all-equal groups: the tiny-scale path
        w[:, :32] = w[:, :1]
    codes = encode_q4_1(w)
    q, scale, low = quantize_q4_1(torch.from_numpy(w))
    np.testing.assert_array_equal(codes.q, q.numpy())
    np.testing.assert_array_equal(codes.d.astype(np.float32), scale.numpy())
    np.testing.assert_array_equal((-codes.dmin).astype(np.float32), low.numpy())
    dense = (q.reshape(n, -1, 32) * scale[..., None] + low[..., None]).reshape(n, -1).numpy()
    np.testing.assert_array_equal(dequantize(codes).view(np.uint32), dense.view(np.uint32))
    assert same_codes(unpack(pack(codes)), codes)


def test_encode_q4_1_keeps_a_q4_1_tensors_codes():
    """Requantizing a Q4_1 tensor's dequantized values gives back its codes and scales."""
    w = np.random.default_rng(2).standard_normal((17, 128)).astype(np.float32)
    stored = decode(gguf_quantize(w, T.Q4_1), T.Q4_1, (17, 128))
    assert same_codes(encode_q4_1(dequantize(stored)), stored)


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.F16, T.IQ3_S], ids=lambda t: t.name)
def test_unsupported_type_is_named(qtype):
    with pytest.raises(ValueError, match=qtype.name):
        decode(np.zeros(1024, np.uint8), qtype, (1, 256))


def test_wrong_byte_count_is_refused():
    raw = random_raw(T.Q4_K, 4, 512)
    with pytest.raises(ValueError, match="bytes"):
        decode(raw[:3], T.Q4_K, (4, 512))
    with pytest.raises(ValueError, match="blocks of 256"):
        decode(raw, T.Q4_K, (4, 480))


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q4_0, T.Q5_1, T.Q8_0), (T.Q3_K, T.Q2_K, T.Q5_K),
                                   (T.Q4_1, T.Q6_K), (T.IQ4_XS, T.IQ4_NL), (T.IQ4_XS, T.Q5_K, T.Q6_K)],
                         ids=lambda ts: "+".join(t.name for t in ts))
def test_concat_rows_of_mixed_types_keeps_every_value(types):
    """Fused projections of tensors of different types: one form, each row's values unchanged
    (to fp32 rounding where an offset folds into the min term: its products are exact, their
    difference is rounded once where gguf rounds the product once)."""
    parts = [decode(random_raw(t, 5 + i, 512, seed=i), t, (5 + i, 512)) for i, t in enumerate(types)]
    merged = gguf_codes.concat_rows(parts)
    want = np.concatenate([dequantize(p) for p in parts])
    got = dequantize(merged)
    np.testing.assert_allclose(got, want, rtol=2 ** -22, atol=np.abs(want).max() * 2 ** -23)
    assert same_codes(unpack(pack(merged)), merged)


def test_iq4_codes_stay_4_bit_indices():
    """An IQ4 weight is held at 4 bits a code (table indices, looked up by the kernels), alone or
    stacked with IQ4 weights; stacked with other types its codes become the 8-bit codes they stand for."""
    xs, nl, q5 = (decode(random_raw(t, 16, 512, seed=i), t, (16, 512)) for i, t in enumerate((T.IQ4_XS, T.IQ4_NL, T.Q5_K)))
    for c in (xs, nl, gguf_codes.concat_rows([xs, nl])):
        assert c.lookup and c.bits == 4 and c.q.max() <= 15
        assert pack(c).lo.nbytes == c.q.size // 2
    wide = gguf_codes.concat_rows([xs, q5])
    assert not wide.lookup and wide.bits == 8
    np.testing.assert_array_equal(wide.q[:16], gguf_codes.IQ4_CODES[xs.q])

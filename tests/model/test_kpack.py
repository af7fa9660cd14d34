"""csrc/kpack.c: a GGUF tensor's blocks packed straight into kquant.c's layout, byte for byte
what numpy's pack(decode(...)) writes, for every type, any row count, rows picked in any order,
column cuts, and fused projections whose parts differ in type; and the wrapper's refusals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.model import cpu_kernels, gguf_codes
from carpool.model.gguf_codes import BlockCodes, concat_rows, decode, from_blocks, pack
from tests.helpers import examples
from tests.model.test_gguf_codes import FP16_FIELDS, TYPES, same_codes

needs_c = pytest.mark.skipif(cpu_kernels.library() is None, reason="the C kernels are not built here")

PACKED = ("lo", "hi", "sc", "mn", "d", "dmin")


def raw_blocks(qtype: T, n: int, k: int, seed: int, finite: bool = False) -> np.ndarray:
    """Random bytes [N, row bytes]: any fp16 scale at all (nan, inf, subnormal) unless `finite`."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
    if finite:
        for at in FP16_FIELDS[qtype]:
            values = rng.standard_normal((n, k // block_size)) * 10.0 ** rng.integers(-7, 4, (n, k // block_size))
            raw[..., at:at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def assert_same_packing(got: gguf_codes.PackedCodes, want: gguf_codes.PackedCodes) -> None:
    assert (got.n, got.k, got.bits, got.offset, got.super_size, got.lookup) == (
        want.n, want.k, want.bits, want.offset, want.super_size, want.lookup)
    for name in PACKED:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, name
            differ = np.count_nonzero(a.view(np.uint8) != b.view(np.uint8))
            assert a.tobytes() == b.tobytes(), f"{name}: {differ} bytes differ"


def packed_by_c(codes: BlockCodes) -> gguf_codes.PackedCodes:
    assert isinstance(codes, BlockCodes)
    packed = pack(codes)
    assert codes._decoded is None  # numpy never decoded them: kpack.c packed them
    return packed


@needs_c
@settings(max_examples=examples(80))
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 50), blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_one_tensor_packs_as_numpy(qtype, n, blocks, seed):
    k = blocks * max(GGML_QUANT_SIZES[qtype][0], 32)
    raw = raw_blocks(qtype, n, k, seed)
    assert_same_packing(packed_by_c(from_blocks(raw, qtype, (n, k))), pack(decode(raw, qtype, (n, k))))


@needs_c
@settings(max_examples=examples(60))
@given(data=st.data(), qtype=st.sampled_from(TYPES), n=st.integers(1, 50), seed=st.integers(0, 2**32 - 1))
def test_rows_in_any_order_pack_as_numpy(data, qtype, n, seed):
    """Rows picked, repeated and reordered (a shard; llama.cpp's Q/K permutation undone)."""
    k = GGML_QUANT_SIZES[qtype][0] * 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    raw = raw_blocks(qtype, n, k, seed)
    index = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40)))
    blocks = from_blocks(raw, qtype, (n, k)).rows(index)
    assert blocks.n == len(index)
    assert_same_packing(packed_by_c(blocks), pack(decode(raw, qtype, (n, k)).rows(index)))


@needs_c
@settings(max_examples=examples(80))
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_fused_parts_of_mixed_types_pack_as_numpy(data, seed):
    """A fused projection: parts of any types and heights (not multiples of 16), stacked, then
    perhaps rows of the stack taken again; one call per part writes the merged form."""
    types = data.draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=4))
    heights = data.draw(st.lists(st.integers(1, 40), min_size=len(types), max_size=len(types)))
    k = 512
    raws = [raw_blocks(t, h, k, seed + i) for i, (t, h) in enumerate(zip(types, heights))]
    stacked = concat_rows([from_blocks(r, t, (h, k)) for r, t, h in zip(raws, types, heights)])
    want = concat_rows([decode(r, t, (h, k)) for r, t, h in zip(raws, types, heights)])
    assert isinstance(stacked, BlockCodes) and stacked.form == want.form
    assert_same_packing(packed_by_c(stacked), pack(want))
    if data.draw(st.booleans()):
        picked = slice(data.draw(st.integers(0, sum(heights) - 1)), None, data.draw(st.integers(1, 3)))
        assert_same_packing(packed_by_c(stacked.rows(picked)), pack(want.rows(picked)))


@needs_c
def test_folded_offsets_round_as_numpy():
    """An offset folded into the min term (d * offset in fp16) at every size of d: subnormal,
    normal, past fp16's range (inf), and nan; Q6_K's 32 and Q8_0's 128 beside Q4_K's min term."""
    halves = np.array([0x0001, 0x0123, 0x03ff, 0x0400, 0x3c00, 0x57ff, 0x5800, 0x7bff, 0x7c00, 0x7d00, 0x7e01,
                       0x8001, 0xbc00, 0xfbff, 0xfc00, 0xffff, 0x0000, 0x8000], np.uint16)
    for qtype in (T.Q6_K, T.Q8_0, T.Q3_K, T.Q4_0):
        n, k = len(halves), 256
        raw = raw_blocks(qtype, n, k, seed=7).reshape(n, k // GGML_QUANT_SIZES[qtype][0], -1)
        at = FP16_FIELDS[qtype][0]
        raw[..., at:at + 2] = halves[:, None, None].view(np.uint8)
        raw = raw.reshape(n, -1)
        other = raw_blocks(T.Q4_K, 3, k, seed=8)
        with np.errstate(all="ignore"):
            want = pack(concat_rows([decode(raw, qtype, (n, k)), decode(other, T.Q4_K, (3, k))]))
        got = packed_by_c(concat_rows([from_blocks(raw, qtype, (n, k)), from_blocks(other, T.Q4_K, (3, k))]))
        assert_same_packing(got, want)
        assert np.isinf(got.dmin).any() and np.isnan(got.dmin).any()


@needs_c
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_column_cuts_pack_as_numpy(qtype):
    """A row-parallel shard cuts each row's blocks (a strided view of the file's bytes)."""
    n, k = 21, 1024
    raw = raw_blocks(qtype, n, k, seed=3)
    cut = from_blocks(raw, qtype, (n, k)).columns(256, 768)
    assert isinstance(cut, BlockCodes) and not cut.parts[0].blocks.flags.c_contiguous
    assert_same_packing(packed_by_c(cut), pack(decode(raw, qtype, (n, k)).columns(256, 768)))


def test_a_cut_inside_a_block_is_decoded():
    """Columns on a 32-channel edge of a merged form split a K-quant's block: decoded, it is exact."""
    raws = raw_blocks(T.Q4_0, 5, 512, seed=1, finite=True), raw_blocks(T.Q4_K, 6, 512, seed=2, finite=True)
    stacked = concat_rows([from_blocks(raws[0], T.Q4_0, (5, 512)), from_blocks(raws[1], T.Q4_K, (6, 512))])
    want = concat_rows([decode(raws[0], T.Q4_0, (5, 512)), decode(raws[1], T.Q4_K, (6, 512))])
    cut = stacked.columns(32, 480)
    assert not isinstance(cut, BlockCodes)
    assert same_codes(cut, want.columns(32, 480))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fields_decode_as_numpy(qtype):
    """Reading a BlockCodes' fields gives decode's codes (the numpy route, and the loader's
    dequantizing one)."""
    raw = raw_blocks(qtype, 19, 512, seed=4, finite=True)
    index = np.array([18, 0, 5, 5, 3])
    assert same_codes(from_blocks(raw, qtype, (19, 512)).rows(index), decode(raw, qtype, (19, 512)).rows(index))


def test_without_the_library_numpy_packs(monkeypatch):
    raw = raw_blocks(T.Q5_K, 20, 256, seed=5)
    want = pack(decode(raw, T.Q5_K, (20, 256)))
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    assert_same_packing(pack(from_blocks(raw, T.Q5_K, (20, 256))), want)


@needs_c
def test_a_permuted_fused_qkv_packs_as_numpy():
    """q, k, v as the encoder writes them (Q4_K, Q5_K, Q6_K), Q and K rows unpermuted as the
    loader does, stacked: the fused layer's packed tensors are numpy's."""
    from carpool.model import gguf_encode, loader

    rng = np.random.default_rng(6)
    n_q, n_kv, k = 64, 32, 256
    tensors = {"q": (rng.standard_normal((n_q, k)), T.Q4_K), "k": (rng.standard_normal((n_kv, k)), T.Q5_K),
               "v": (rng.standard_normal((n_kv, k)), T.Q6_K)}
    parts_c, parts_np = [], []
    for w, qtype in tensors.values():
        raw = gguf_encode.quantize(w.astype(np.float32), qtype)
        parts_c.append(from_blocks(raw, qtype, w.shape).rows(loader.unpermute_qk(np.arange(len(w)), 2)))
        parts_np.append(decode(raw, qtype, w.shape).rows(loader.unpermute_qk(np.arange(len(w)), 2)))
    assert_same_packing(packed_by_c(concat_rows(parts_c)), pack(concat_rows(parts_np)))


def zeroed(n: int, k: int, form: gguf_codes.Form) -> cpu_kernels.KQTensors:
    b, g, s = -(-n // 16), k // 32, k // form.super_size
    planes = form.bits - 4 if 4 < form.bits < 8 else 0
    make = lambda on, shape, dtype: torch.zeros(shape, dtype=dtype) if on else None
    return (torch.zeros((b, g, 8 if form.bits == 8 else 4, 16, 4), dtype=torch.uint8),
            make(planes, (b, g, planes, 8, 8), torch.uint8), make(form.sc, (b, g, 32 // form.sub_size, 16), torch.int8),
            make(form.mn, (b, g, 32 // form.sub_size, 16), torch.int8), torch.zeros((b, s, 16), dtype=torch.float16),
            make(form.dmin, (b, s, 16), torch.float16))


@needs_c
def test_the_wrapper_refuses_what_c_would_misread():
    raw = raw_blocks(T.Q6_K, 8, 256, seed=9)
    rows = np.arange(8, dtype=np.int64)
    q6 = gguf_codes._TYPES[T.Q6_K][1]
    tensors = zeroed(8, 256, q6)
    args = (8, 256, q6.bits, q6.offset, q6.super_size)
    cpu_kernels.kq_pack(raw, int(T.Q6_K), rows, tensors, *args, 0)
    with pytest.raises(ValueError, match="kq_pack"):  # bytes of another type
        cpu_kernels.kq_pack(raw, int(T.Q4_K), rows, tensors, *args, 0)
    with pytest.raises(ValueError, match="kq_pack"):  # no room for the rows
        cpu_kernels.kq_pack(raw, int(T.Q6_K), rows, tensors, *args, 1)
    with pytest.raises(ValueError, match="kq_pack"):  # rows as int32
        cpu_kernels.kq_pack(raw, int(T.Q6_K), rows.astype(np.int32), tensors, *args, 0)
    with pytest.raises(ValueError, match="kq_pack"):  # a tensor of the wrong shape
        cpu_kernels.kq_pack(raw, int(T.Q6_K), rows, (tensors[0].view(-1), *tensors[1:]), *args, 0)
    with pytest.raises(IndexError):
        cpu_kernels.kq_pack(raw, int(T.Q6_K), rows + 1, tensors, *args, 0)
    # Q6_K's codes and sub-scales do not fit Q4_K's form; Q4_K's min term has no room in Q6_K's.
    q4 = gguf_codes._TYPES[T.Q4_K][1]
    narrow = zeroed(8, 256, q4)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.kq_pack(raw, int(T.Q6_K), rows, narrow, 8, 256, q4.bits, q4.offset, q4.super_size, 0)
    q4_raw = raw_blocks(T.Q4_K, 8, 256, seed=10)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.kq_pack(q4_raw, int(T.Q4_K), rows, tensors, *args, 0)
    # Q6_K's per-16 sub-scales do not fit a form of 6-bit codes with one sub-scale per 32 channels
    per_32 = zeroed(8, 256, replace(q6, sub_size=32))
    with pytest.raises(ValueError, match="sub-scales per 32 channels"):
        cpu_kernels.kq_pack(raw, int(T.Q6_K), rows, per_32, *args, 0)

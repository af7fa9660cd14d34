"""GGUF quantized tensors as codes and scales ("kq" form), and their packing for csrc/kquant.c.

A GGUF Q4_0 .. Q6_K or IQ4_NL / IQ4_XS tensor decodes into one canonical form, the one csrc/kquant.c computes:

    w[r, c] = (float(d[r, c // S]) * sc[r, c // U]) * (q[r, c] - offset) - float(dmin[r, c // S]) * mn[r, c // U]

unsigned codes q (2- and 3-bit codes held as 4-bit), fp16 super-block scales d / dmin per S
channels (32 for the legacy types, 256 for K-quants) and int8 sub-scales sc / mn per U = 16 or
32 channels (`sub_size`: the file's own; None: 1). Evaluated in fp32 in that order, it
gives gguf.quants.dequantize's values bit for bit: d * sc is exact, and the rest of each type's
arithmetic is the same operations in the same order. So a model runs from the file's own
codes, never from a requantized copy.

Per type (bits, offset, S; sc, mn, U): Q4_0 4, 8, 32; Q4_1 4, 0, 32 (dmin = -m); Q5_0 5, 16, 32;
Q5_1 5, 0, 32 (dmin = -m); Q2_K 4, 0, 256 (codes 0..3; scales & 15, scales >> 4, 16); Q3_K 4, 4,
256 (codes 0..7: low 2 bits + 4 * hmask bit; scale - 32, 16); Q4_K / Q5_K 4 / 5, 0, 256 (6-bit
scale, 6-bit min, 32); Q6_K 6, 32, 256 (int8 scales, 16); IQ4_NL 4, 128, 32 and IQ4_XS 4, 128, 256
(6-bit scale - 32, 32) with `lookup`: their 4-bit codes index a table of int8 values
(IQ4_VALUES), so the code q stands for the 8-bit code IQ4_CODES[q] = value + 128, which the
formula takes in its place. The kernels look the codes up as they read them: an IQ4 weight is
held at the file's 4.25-4.5 bits. Stacked with weights of other types in one form (merged_form),
IQ4 codes become their 8-bit codes.

A fused projection (q/k/v, gate/up) whose parts differ in type is held in one form only where
that costs little (stack_rows); else each run of parts keeps its own form, and the kernel takes
the parts in one call (KQuantMatmul.stacked).

Decoding and packing are numpy operations over the whole tensor, never Python loops over rows
or blocks: they are the reference. A model's weights load another way, about 3x faster (numbers
in csrc/kpack.c): the loader takes them as BlockCodes (from_blocks: rows of the file's blocks,
not decoded), whose rows and concatenations are index arithmetic, and pack() writes those in C
(csrc/kpack.c) straight from the blocks into the kernel's layout, the same bytes as
pack(decode(...)). Where the C library is not built they decode and pack with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import IQ4_NL, Q4_K

from carpool.model import cpu_kernels

ROWS = 16  # output rows per block of the kernel's layout
GROUP = 32  # input channels per group of the kernel's layout
_TINY = 1e-30  # as carpool.model.quant: the scale an all-equal group divides by


@dataclass(frozen=True)
class Form:
    """What a weight's canonical form holds besides its values: code bits, offset, super-block
    size, and which of sc, mn, dmin it has."""
    bits: int
    offset: int
    super_size: int
    sc: bool
    mn: bool
    dmin: bool
    lookup: bool = False  # 4-bit codes standing for IQ4_CODES[q] (the module doc)
    sub_size: int = 32  # channels per sub-scale: 16 or 32 (32 where there are none)


@dataclass
class QuantCodes:
    """A weight [N, K] in canonical form (module doc). Fields are plain numpy arrays."""
    q: np.ndarray  # uint8 [N, K], 0 .. 2**bits - 1
    sc: np.ndarray | None  # int8 [N, K / sub_size]; None: 1
    mn: np.ndarray | None  # int8 [N, K / sub_size]; None: 1 (where dmin is given)
    d: np.ndarray  # float16 [N, K / S]
    dmin: np.ndarray | None  # float16 [N, K / S]; None: no min term
    super_size: int  # S: 32 or 256
    offset: int
    bits: int  # 4, 5, 6 or 8
    lookup: bool = False  # 4-bit codes standing for IQ4_CODES[q] (the module doc)
    sub_size: int = 32  # channels per sub-scale (sc, mn): 16 or 32

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def form(self) -> Form:
        return Form(self.bits, self.offset, self.super_size, self.sc is not None, self.mn is not None,
                    self.dmin is not None, self.lookup, self.sub_size)

    @property
    def codes8(self) -> np.ndarray:
        """The codes the formula takes: q, or for a lookup form the 8-bit codes q stands for."""
        return IQ4_CODES[self.q] if self.lookup else self.q

    def rows(self, index) -> QuantCodes:
        """The codes of the rows `index` (a slice, or indices in any order: a tensor-parallel
        shard of the output rows, or llama.cpp's Q/K row permutation undone)."""
        pick = lambda a: None if a is None else np.ascontiguousarray(a[index])
        return replace(self, q=pick(self.q), sc=pick(self.sc), mn=pick(self.mn), d=pick(self.d),
                       dmin=pick(self.dmin))

    def columns(self, start: int, stop: int) -> QuantCodes:
        """Input channels start .. stop (a row-parallel shard); both on super-block edges, as a
        super-block's scale cannot be split."""
        _check_columns(self, start, stop)
        s = self.super_size
        cut = lambda a, per: None if a is None else np.ascontiguousarray(a[:, start // per:stop // per])
        u = self.sub_size
        return replace(self, q=cut(self.q, 1), sc=cut(self.sc, u), mn=cut(self.mn, u), d=cut(self.d, s),
                       dmin=cut(self.dmin, s))


def _check_columns(c: QuantCodes, start: int, stop: int) -> None:
    if start % c.super_size or stop % c.super_size or not 0 <= start < stop <= c.k:
        raise ValueError(f"columns {start}:{stop} of a {c.n}x{c.k} weight must lie on "
                         f"super-blocks of {c.super_size} channels")


# ---------------------------------------------------------------- decoding, per type
# Each takes the blocks as bytes [blocks, type_size] and gives (q [blocks, block_size],
# sc, mn [blocks, block_size / U] or None, d, dmin [blocks] or None), following gguf/quants.py.

def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16)[:, 0]


def _nibbles(x: np.ndarray) -> np.ndarray:
    """Bytes [..., L] -> [..., 2, L]: all low nibbles, then all high ones."""
    return np.stack((x & 15, x >> 4), axis=-2)


def _crumbs(x: np.ndarray) -> np.ndarray:
    """Bytes [..., L] -> 2-bit fields [..., 4, L], bits 0-1 first."""
    return (x[..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3


def _bit_rows(x: np.ndarray) -> np.ndarray:
    """Bytes [blocks, L] -> bits [blocks, 8 * L] in the order bit 0 of every byte, then bit 1, ..."""
    bits = np.unpackbits(x[..., None], axis=-1, bitorder="little")  # [blocks, L, 8]
    return bits.transpose(0, 2, 1).reshape(len(x), -1)


def _legacy(b: np.ndarray, has_min: bool, high_bits: bool):
    at = 4 if has_min else 2
    qh = None
    if high_bits:  # a little-endian uint32: bit j is code j's bit 4
        qh = np.unpackbits(b[:, at:at + 4], axis=-1, bitorder="little")
        at += 4
    q = _nibbles(b[:, at:at + 16]).reshape(len(b), 32)
    if qh is not None:
        q |= qh << 4
    dmin = -_f16(b, 2) if has_min else None  # w = d * q + m = d * q - (-m)
    return q, None, None, _f16(b, 0), dmin


def _q2_k(b: np.ndarray):
    scales = b[:, :16]
    q = _crumbs(b[:, 16:80].reshape(-1, 2, 32)).reshape(len(b), 256)
    return q, (scales & 15).view(np.int8), (scales >> 4).view(np.int8), _f16(b, 80), _f16(b, 82)


def _q3_k(b: np.ndarray):
    q = _crumbs(b[:, 32:96].reshape(-1, 2, 32)).reshape(len(b), 256) | (_bit_rows(b[:, :32]) << 2)
    packed = b[:, 96:108]
    low = _nibbles(packed[:, :8]).reshape(-1, 16)
    high = _crumbs(packed[:, 8:12]).reshape(-1, 16)
    sc = ((low | (high << 4)).astype(np.int8) - np.int8(32))
    return q, sc, None, _f16(b, 108), None


def _q45_k(b: np.ndarray, high_bits: bool):
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # 6-bit, per 32 channels
    at = 48 if high_bits else 16
    q = _nibbles(b[:, at:at + 128].reshape(-1, 4, 32)).reshape(len(b), 256)
    if high_bits:
        q |= _bit_rows(b[:, 16:48]) << 4
    return q, sc.view(np.int8), mn.view(np.int8), _f16(b, 0), _f16(b, 2)


def _q6_k(b: np.ndarray):
    low = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(len(b), 256)
    high = _crumbs(b[:, 128:192].reshape(-1, 2, 32)).reshape(len(b), 256)
    return low | (high << 4), b[:, 192:208].view(np.int8), None, _f16(b, 208), None


def _q8_0(b: np.ndarray):
    return (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), None, None, _f16(b, 0), None


# IQ4_NL / IQ4_XS's 4-bit codes index this table (gguf.quants.IQ4_NL.kvalues): the value a code
# stands for is an int8, whose 8-bit code, value + 128 as Q8_0's, the formula takes (csrc/kernels.h's
# IQ4_CODES).
IQ4_VALUES = np.array(IQ4_NL.kvalues, np.int16)
IQ4_CODES = (IQ4_VALUES + 128).astype(np.uint8)


def _iq4_nl(b: np.ndarray):
    return _nibbles(b[:, 2:18]).reshape(len(b), 32), None, None, _f16(b, 0), None


def _iq4_xs(b: np.ndarray):
    """d, scales_h (uint16: 2 high bits per 32 channels), scales_l[4] (4 low bits each), qs[128]."""
    high = (b[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [blocks, 8]
    low = _nibbles(b[:, 4:8]).transpose(0, 2, 1).reshape(len(b), 8)  # byte i: sub-blocks 2i, 2i + 1
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    q = _nibbles(b[:, 8:136].reshape(-1, 8, 16)).reshape(len(b), 256)
    return q, sc, None, _f16(b, 0), None


# type: (decoder, form)
_TYPES = {
    T.Q8_0: (_q8_0, Form(8, 128, 32, sc=False, mn=False, dmin=False)),
    T.Q4_0: (lambda b: _legacy(b, False, False), Form(4, 8, 32, sc=False, mn=False, dmin=False)),
    T.Q4_1: (lambda b: _legacy(b, True, False), Form(4, 0, 32, sc=False, mn=False, dmin=True)),
    T.Q5_0: (lambda b: _legacy(b, False, True), Form(5, 16, 32, sc=False, mn=False, dmin=False)),
    T.Q5_1: (lambda b: _legacy(b, True, True), Form(5, 0, 32, sc=False, mn=False, dmin=True)),
    T.Q2_K: (_q2_k, Form(4, 0, 256, sc=True, mn=True, dmin=True, sub_size=16)),
    T.Q3_K: (_q3_k, Form(4, 4, 256, sc=True, mn=False, dmin=False, sub_size=16)),
    T.Q4_K: (lambda b: _q45_k(b, False), Form(4, 0, 256, sc=True, mn=True, dmin=True)),
    T.Q5_K: (lambda b: _q45_k(b, True), Form(5, 0, 256, sc=True, mn=True, dmin=True)),
    T.Q6_K: (_q6_k, Form(6, 32, 256, sc=True, mn=False, dmin=False, sub_size=16)),
    T.IQ4_NL: (_iq4_nl, Form(4, 128, 32, sc=False, mn=False, dmin=False, lookup=True)),
    T.IQ4_XS: (_iq4_xs, Form(4, 128, 256, sc=True, mn=False, dmin=False, lookup=True)),
}
SUPPORTED = frozenset(_TYPES)


def _blocks(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> np.ndarray:
    """A tensor's raw bytes as [N, row bytes], checked against its type and shape (no copy)."""
    if qtype not in _TYPES:
        raise ValueError(f"GGUF type {qtype.name} has no kq form; supported: "
                         f"{', '.join(t.name for t in _TYPES)}")
    n, k = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if k % block_size:
        raise ValueError(f"a {qtype.name} row holds blocks of {block_size}; K = {k}")
    blocks = np.asarray(data).view(np.uint8)
    if blocks.size != n * k // block_size * type_size:
        raise ValueError(f"{blocks.size} bytes for a {n}x{k} {qtype.name} tensor; expected "
                         f"{n * k // block_size * type_size}")
    return blocks.reshape(n, k // block_size * type_size)


def decode(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> QuantCodes:
    """A GGUF tensor's raw block bytes (GGUFReader's `tensor.data`, [N, row bytes] or flat; a
    memmap is read, not copied whole) and its (N, K) -> its codes in canonical form."""
    qtype = T(qtype)
    blocks = _blocks(data, qtype, shape)
    decoder, f = _TYPES[qtype]
    n, k = shape
    q, sc, mn, d, dmin = decoder(blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    per_row = lambda a, width: None if a is None else np.ascontiguousarray(a).reshape(n, width)
    s = f.super_size
    u = f.sub_size
    return QuantCodes(q=per_row(q, k), sc=per_row(sc, k // u), mn=per_row(mn, k // u), d=per_row(d, k // s),
                      dmin=per_row(dmin, k // s), super_size=s, offset=f.offset, bits=f.bits, lookup=f.lookup,
                      sub_size=u)


def dequantize(c: QuantCodes) -> np.ndarray:
    """Codes -> float32 [N, K], in the canonical form's fp32 order (gguf's values bit for bit)."""
    n, k = c.q.shape
    u = c.sub_size
    subs = c.super_size // u
    scale = np.repeat(c.d.astype(np.float32), subs, axis=1)  # [N, K / U]
    if c.sc is not None:
        scale *= c.sc
    w = scale[..., None] * (c.codes8.reshape(n, k // u, u).astype(np.float32) - np.float32(c.offset))
    if c.dmin is not None:
        low = np.repeat(c.dmin.astype(np.float32), subs, axis=1)
        if c.mn is not None:
            low *= c.mn
        w -= low[..., None]
    return w.reshape(n, k)


def merged_form(forms: list[Form]) -> Form:
    """The one form of weights stacked by rows (concat_rows): theirs where they agree, else the
    widest codes, the smallest super-block and sub-scale size, every sub-scale and a min term, and
    their offset if they share one (else 0: the others are folded into the min term). Lookup codes
    stay so only among lookup codes; beside others they count as 8-bit codes."""
    if len(set(forms)) == 1:
        return forms[0]
    offsets = {f.offset for f in forms}
    lookup = all(f.lookup for f in forms)
    return Form(bits=max(8 if f.lookup and not lookup else f.bits for f in forms),
                offset=offsets.pop() if len(offsets) == 1 else 0, super_size=min(f.super_size for f in forms),
                sc=True, mn=True, dmin=True, lookup=lookup, sub_size=min(f.sub_size for f in forms))


def as_form(c: QuantCodes, form: Form) -> QuantCodes:
    """c's values in `form` (its own, or a merged_form with c among its parts): a super-block's
    factors and a sub-scale repeat exactly over smaller blocks, absent sub-scales are 1, and an
    offset the form lacks goes into the min term (w = d sc q - (offset d) sc, exact: offsets are
    powers of two), and lookup codes become the 8-bit codes they stand for unless the form looks
    them up too."""
    if c.form == form:
        return c
    widened = c.lookup and not form.lookup
    if not (form.sc and form.mn and form.dmin and form.bits >= (8 if widened else c.bits)
            and c.super_size % form.super_size == 0 and c.sub_size % form.sub_size == 0
            and (c.lookup or not form.lookup)):
        raise ValueError(f"a weight in {c.form} does not fit {form}")
    n, k = c.shape
    d = np.repeat(c.d, c.super_size // form.super_size, axis=1)
    sc = np.ones((n, k // form.sub_size), np.int8) if c.sc is None else \
        np.repeat(c.sc, c.sub_size // form.sub_size, axis=1)
    if c.dmin is not None:
        dmin = np.repeat(c.dmin, c.super_size // form.super_size, axis=1)
        mn = np.ones_like(sc) if c.mn is None else np.repeat(c.mn, c.sub_size // form.sub_size, axis=1)
    elif c.offset != form.offset:
        if form.offset or c.offset & (c.offset - 1):
            raise ValueError(f"offset {c.offset} cannot fold into a form with offset {form.offset}")
        dmin, mn = (d.astype(np.float32) * c.offset).astype(np.float16), sc
    else:
        dmin, mn = np.zeros_like(d), np.zeros_like(sc)
    return QuantCodes(q=c.codes8 if widened else c.q, sc=sc, mn=mn, d=d, dmin=dmin, super_size=form.super_size,
                      offset=form.offset, bits=form.bits, lookup=form.lookup, sub_size=form.sub_size)


def _stacked(parts: list[QuantCodes], form: Form) -> QuantCodes:
    parts = [as_form(p, form) for p in parts]
    cat = lambda name: None if getattr(parts[0], name) is None else np.concatenate([getattr(p, name) for p in parts])
    return QuantCodes(q=cat("q"), sc=cat("sc"), mn=cat("mn"), d=cat("d"), dmin=cat("dmin"),
                      super_size=form.super_size, offset=form.offset, bits=form.bits, lookup=form.lookup,
                      sub_size=form.sub_size)


def concat_rows(parts: list[QuantCodes]) -> QuantCodes:
    """Weights stacked by rows in one form, merged_form's where their types differ. BlockCodes
    stay blocks (their parts listed, nothing copied)."""
    form = merged_form([p.form for p in parts])
    if all(isinstance(p, BlockCodes) for p in parts):
        return BlockCodes(tuple(part for p in parts for part in p.parts), parts[0].k, form)
    return _stacked(parts, form)


def bits_per_weight(form: Form) -> float:
    """What a form holds per weight: its code bits, sub-scales and fp16 super-block factors."""
    return form.bits + 8 * (form.sc + form.mn) / form.sub_size + 16 * (1 + form.dmin) / form.super_size


MERGE_COST = 1.05  # stack_rows: one form for parts of several types, if it holds at most this much more


def stack_rows(parts: list[QuantCodes]) -> list[QuantCodes]:
    """Weights stacked by rows (the fused q/k/v or gate/up projections) as the runs to pack, each
    run in one form: all in one (concat_rows), where that holds at most 5% more than the parts'
    own forms, else each run of parts that share a form. One form saves a kernel call; Q4_K_M
    files give v Q6_K beside q and k Q4_K, whose one form would give q and k 6-bit codes and
    per-16 sub-scales: 1.5x their bytes (KQuantMatmul.stacked runs the parts in one call)."""
    own = sum(p.n * bits_per_weight(p.form) for p in parts)
    if sum(p.n for p in parts) * bits_per_weight(merged_form([p.form for p in parts])) <= MERGE_COST * own:
        return [parts[0] if len(parts) == 1 else concat_rows(parts)]
    runs = [[parts[0]]]
    for p in parts[1:]:
        if p.form == runs[-1][-1].form:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [run[0] if len(run) == 1 else concat_rows(run) for run in runs]


# ---------------------------------------------------------------- the file's blocks, not decoded

@dataclass(frozen=True)
class BlockRows:
    """Rows of one GGUF tensor as the file holds them."""
    blocks: np.ndarray  # uint8 [the tensor's rows, its row bytes] (a column cut is a strided view)
    qtype: T
    index: np.ndarray  # int64: which rows of `blocks`, in order


class BlockCodes(QuantCodes):
    """QuantCodes still in a GGUF file's blocks: rows of one or more tensors (the parts of a
    fused projection), in `form`. Taking rows or stacking them is index arithmetic; pack() packs
    them from the blocks in C. Reading a field (q, sc, ...) decodes them with numpy, once."""

    def __init__(self, parts: tuple[BlockRows, ...], k: int, form: Form):
        self.parts, self._k, self._form, self._decoded = parts, k, form, None

    n = property(lambda self: sum(len(p.index) for p in self.parts))
    k = property(lambda self: self._k)
    shape = property(lambda self: (self.n, self._k))
    form = property(lambda self: self._form)
    bits = property(lambda self: self._form.bits)
    offset = property(lambda self: self._form.offset)
    super_size = property(lambda self: self._form.super_size)
    lookup = property(lambda self: self._form.lookup)
    sub_size = property(lambda self: self._form.sub_size)
    q = property(lambda self: self.decoded().q)
    sc = property(lambda self: self.decoded().sc)
    mn = property(lambda self: self.decoded().mn)
    d = property(lambda self: self.decoded().d)
    dmin = property(lambda self: self.decoded().dmin)

    def __repr__(self) -> str:
        types = ", ".join(sorted({p.qtype.name for p in self.parts}))
        return f"BlockCodes({self.n}x{self.k} {types}, {self._form})"

    def decoded(self) -> QuantCodes:
        """The codes, decoded by numpy (the reference; kept once made)."""
        if self._decoded is None:
            self._decoded = _stacked([decode(p.blocks[p.index], p.qtype, (len(p.index), self.k))
                                      for p in self.parts], self._form)
        return self._decoded

    def rows(self, index) -> BlockCodes:
        picked = np.arange(self.n)[index]
        starts = np.cumsum([0] + [len(p.index) for p in self.parts])
        which = np.searchsorted(starts, picked, side="right") - 1  # each row's part
        cuts = np.flatnonzero(np.diff(which)) + 1
        parts = tuple(replace(self.parts[w[0]], index=self.parts[w[0]].index[run - starts[w[0]]])
                      for run, w in zip(np.split(picked, cuts), np.split(which, cuts)) if len(run))
        return BlockCodes(parts, self.k, self._form)

    def columns(self, start: int, stop: int) -> QuantCodes:
        _check_columns(self, start, stop)
        sizes = [GGML_QUANT_SIZES[p.qtype] for p in self.parts]
        if any(start % block or stop % block for block, _ in sizes):
            return self.decoded().columns(start, stop)  # the cut splits a block: decoded, it need not
        return BlockCodes(tuple(replace(p, blocks=p.blocks[:, start // block * size:stop // block * size])
                                for p, (block, size) in zip(self.parts, sizes)), stop - start, self._form)


def from_blocks(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> BlockCodes:
    """decode's arguments -> the tensor as BlockCodes: nothing decoded, nothing copied."""
    qtype = T(qtype)
    blocks = _blocks(data, qtype, shape)
    return BlockCodes((BlockRows(blocks, qtype, np.arange(shape[0], dtype=np.int64)),), shape[1], _TYPES[qtype][1])


def encode_q4_1(w: np.ndarray) -> QuantCodes:
    """float32 [N, K] -> round-to-nearest Q4_1: carpool.model.quant.quantize_q4_1's codes and fp16
    scale / min (w = code * scale + min), in canonical form (dmin = -min)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"Q4_1 needs K divisible by {GROUP}; got {k}")
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    scale, low = ((hi - lo) / np.float32(15)).astype(np.float16), lo.astype(np.float16)
    step = np.maximum(scale.astype(np.float32), np.float32(_TINY))
    q = np.rint((groups - low.astype(np.float32)[..., None]) / step[..., None])
    return QuantCodes(q=np.clip(q, 0, 15).astype(np.uint8).reshape(n, k), sc=None, mn=None, d=scale, dmin=-low,
                      super_size=GROUP, offset=0, bits=4)


# ---------------------------------------------------------------- the kernel's layout

@dataclass
class PackedCodes:
    """QuantCodes in csrc/kquant.c's blocks of 16 rows (B = ceil(N / 16), G = K / 32); contiguous."""
    lo: np.ndarray  # uint8 [B, G, 4, 16, 4]: codes' low nibbles, channels 16.. of a group in the high ones
    hi: np.ndarray | None  # uint8 [B, G, bits - 4, 8, 8]: the codes' bits 4.., in fields over lo's bytes
    sc: np.ndarray | None  # int8 [B, G, 32 / sub_size, 16]
    mn: np.ndarray | None  # int8 [B, G, 32 / sub_size, 16]
    d: np.ndarray  # float16 [B, K / S, 16]
    dmin: np.ndarray | None  # float16 [B, K / S, 16]
    n: int
    k: int
    bits: int
    offset: int
    super_size: int
    lookup: bool = False  # 4-bit codes standing for IQ4_CODES[q]
    sub_size: int = 32  # channels per sub-scale: 16 or 32


def _row_blocks(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [B, 16, ...], zero rows padding the last block."""
    pad = -a.shape[0] % ROWS
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(-1, ROWS, *a.shape[1:])


def pack(c: QuantCodes) -> PackedCodes:
    """Canonical codes -> the kernel's layout; padding rows get zero codes and scales. BlockCodes
    are packed from their blocks by csrc/kpack.c where the C library is built (the same bytes).

    lo[b, g, j, r, c] = (q[16b + r, 32g + 4j + c] & 15) | (q[16b + r, 32g + 16 + 4j + c] & 15) << 4,
    carpool.model.quant.pack_int4's layout. With P = bits - 4 (1 or 2), hi[b, g, v] (64 bytes)
    holds at byte i, bits P s .. P s + P - 1, the bits 4.. of the code lo[b, g, j % 4] holds at
    byte i (in its low nibble for j < 4, its high one for j >= 4), j = 8v / P + s: row
    16b + i // 4, channel 32g + 16 (j // 4) + 4 (j % 4) + i % 4.
    sc, mn[b, g, u, r] = sc, mn[16b + r, G' g + u] (G' = 32 / sub_size sub-scales a group);
    d, dmin[b, s, r] = d, dmin[16b + r, s]."""
    n, k = c.shape
    if k % GROUP:
        raise ValueError(f"the kernel layout needs K divisible by {GROUP}; got {k}")
    if isinstance(c, BlockCodes) and cpu_kernels.library() is not None:
        return _pack_blocks(c)
    g = k // GROUP
    rows = _row_blocks(c.q).reshape(-1, ROWS, g, 2, 16)  # [B, row, G, half, channel]
    b = rows.shape[0]
    per_sub = lambda a: None if a is None else np.ascontiguousarray(
        _row_blocks(a).reshape(b, ROWS, g, GROUP // c.sub_size).transpose(0, 2, 3, 1))
    per_super = lambda a: None if a is None else np.ascontiguousarray(_row_blocks(a).transpose(0, 2, 1))
    if c.bits == 8:  # bytes: lo[b, g, j, r, c] = q[16b + r, 32g + 4j + c] (quant.pack_int8's layout)
        lo = np.ascontiguousarray(rows.reshape(b, ROWS, g, 8, 4).transpose(0, 2, 3, 1, 4))
        return PackedCodes(lo=lo, hi=None, sc=per_sub(c.sc), mn=per_sub(c.mn), d=per_super(c.d),
                           dmin=per_super(c.dmin), n=n, k=k, bits=8, offset=c.offset, super_size=c.super_size,
                           sub_size=c.sub_size)
    nibbles = (rows[:, :, :, 0] & 15) | ((rows[:, :, :, 1] & 15) << 4)  # [B, row, G, 16]
    lo = np.ascontiguousarray(nibbles.reshape(b, ROWS, g, 4, 4).transpose(0, 2, 3, 1, 4))
    hi = None
    if c.bits > 4:
        planes = c.bits - 4
        # [B, G, v, s, row * 4 + c]: code vector j = 8v / P + s (half * 4 + quad) in lo's byte order
        top = (rows >> 4).reshape(b, ROWS, g, 8, 4).transpose(0, 2, 3, 1, 4).reshape(b, g, planes, 8 // planes, 64)
        fields = top << (planes * np.arange(8 // planes, dtype=np.uint8))[:, None]
        hi = np.ascontiguousarray(np.bitwise_or.reduce(fields, axis=3).reshape(b, g, planes, 8, 8))
    return PackedCodes(lo=lo, hi=hi, sc=per_sub(c.sc), mn=per_sub(c.mn), d=per_super(c.d), dmin=per_super(c.dmin),
                       n=n, k=k, bits=c.bits, offset=c.offset, super_size=c.super_size, lookup=c.lookup,
                       sub_size=c.sub_size)


def _pack_blocks(c: BlockCodes) -> PackedCodes:
    """pack() in C: each part's rows written from its blocks into zeroed arrays, in c's form."""
    f, (n, k) = c.form, c.shape
    b, g, supers = -(-n // ROWS), k // GROUP, k // f.super_size
    planes, subs = f.bits - 4 if 4 < f.bits < 8 else 0, GROUP // f.sub_size
    zeros = lambda present, shape, dtype: np.zeros(shape, dtype) if present else None
    p = PackedCodes(lo=np.zeros((b, g, 8 if f.bits == 8 else 4, ROWS, 4), np.uint8),
                    hi=zeros(planes, (b, g, planes, 8, 8), np.uint8), sc=zeros(f.sc, (b, g, subs, ROWS), np.int8),
                    mn=zeros(f.mn, (b, g, subs, ROWS), np.int8), d=np.zeros((b, supers, ROWS), np.float16),
                    dmin=zeros(f.dmin, (b, supers, ROWS), np.float16), n=n, k=k, bits=f.bits, offset=f.offset,
                    super_size=f.super_size, lookup=f.lookup, sub_size=f.sub_size)
    tensors = tuple(None if a is None else torch.from_numpy(a) for a in (p.lo, p.hi, p.sc, p.mn, p.d, p.dmin))
    first = 0
    for part in c.parts:
        cpu_kernels.kq_pack(part.blocks, int(part.qtype), part.index, tensors, n, k, f.bits, f.offset,
                            f.super_size, first, f.lookup)
        first += len(part.index)
    return p


def unpack(p: PackedCodes) -> QuantCodes:
    """pack's inverse: the reference the C kernel's reading of the layout is tested against."""
    b, g = p.lo.shape[:2]
    if p.bits == 8:
        q = p.lo.reshape(b, g, 2, 4, ROWS, 4)
    else:
        q = np.stack((p.lo & 15, p.lo >> 4), axis=2)  # [B, G, half, quad, row, c]
    if p.hi is not None:
        planes = p.hi.shape[2]
        fields = p.hi.reshape(b, g, planes, 1, 64) >> (planes * np.arange(8 // planes, dtype=np.uint8))[:, None]
        q |= (fields & ((1 << planes) - 1)).reshape(b, g, 2, 4, ROWS, 4) << 4
    q = q.transpose(0, 4, 1, 2, 3, 5).reshape(b * ROWS, p.k)[:p.n]
    per_sub = lambda a: None if a is None else np.ascontiguousarray(a.transpose(0, 3, 1, 2).reshape(b * ROWS, -1)[:p.n])
    per_super = lambda a: None if a is None else np.ascontiguousarray(a.transpose(0, 2, 1).reshape(b * ROWS, -1)[:p.n])
    return QuantCodes(q=np.ascontiguousarray(q), sc=per_sub(p.sc), mn=per_sub(p.mn), d=per_super(p.d),
                      dmin=per_super(p.dmin), super_size=p.super_size, offset=p.offset, bits=p.bits, lookup=p.lookup,
                      sub_size=p.sub_size)

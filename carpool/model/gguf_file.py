"""A GGUF file's metadata and tensor table, read fast; the tensors stay in the mapped file.

gguf-py's GGUFReader builds numpy views for every part of every field, which takes seconds for a
vocabulary of 49k-128k tokens (3.4 s for the embedded model's, before anything else can start).
This reads the same header with `struct` and keeps gguf-py's interface where carpool uses it:
`fields[key].contents()`, and tensors with `name`, `shape` (GGUF's order: fastest dimension
first), `tensor_type`, `n_bytes` and `data` (a read-only view of the mapped file: float types as
their dtype, quantized ones as bytes, rows first, as GGUFReader gives them).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = 0x46554747  # "GGUF", little-endian
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one value (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass
class Field:
    name: str
    value: object

    def contents(self) -> object:
        return self.value


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the row length first
    tensor_type: GGMLQuantizationType
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, self._at = self._map, 0
        magic, version = self._unpack("<II")
        if magic != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (magic {magic:#x})")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
        n_tensors, n_fields = self._unpack("<QQ")
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = Field(key, self._value(kind))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (dims,) = self._unpack("<I")
            shape = self._unpack(f"<{dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in shape), GGMLQuantizationType(kind), offset))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields \
            else DEFAULT_ALIGNMENT
        start = -(-self._at // alignment) * alignment
        self.tensors: list[Tensor] = []
        for name, shape, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape))
            n_bytes = count // block * size
            at = start + offset
            raw = np.frombuffer(buf, dtype=np.uint8, count=max(0, min(n_bytes, len(buf) - at)), offset=min(at, len(buf)))
            numpy_shape = tuple(reversed(shape))
            if raw.size < n_bytes:
                data = raw  # truncated: open_gguf reports it
            elif kind in _FLOAT_DTYPES:
                data = raw.view(_FLOAT_DTYPES[kind]).reshape(numpy_shape)
            else:
                data = raw.reshape(*numpy_shape[:-1], numpy_shape[-1] // block * size)
            self.tensors.append(Tensor(name, shape, kind, n_bytes, data))

    def drop_pages(self) -> None:
        """Let the kernel drop the file's pages from this process's memory (they stay mapped and
        are read again if touched): once a model is loaded, nothing reads them."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = self._map[self._at:self._at + n].decode("utf-8", errors="replace")
        self._at += n
        return s

    def _value(self, kind: int) -> object:
        if kind == 8:
            return self._string()
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind != 9:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("<IQ")
        if item == 8:
            return [self._string() for _ in range(count)]
        if item in _NUMPY:
            values = np.frombuffer(self._map, dtype=_NUMPY[item], count=count, offset=self._at)
            self._at += values.nbytes
            return values.tolist()
        return [self._value(item) for _ in range(count)]

"""The control channel's messages and their wire format: typed frames, never pickle.

Driver -> workers: `LoadModel`, `InitKVCache`, `RunPlan`, `SendTimings`, `Shutdown`.
Workers -> driver: `WorkerReady` (the model loaded, or why not), `Timings`.

A frame is one byte string:

    b"CPM1" | header length (uint32, little-endian) | header (UTF-8 JSON) | array bytes

with the header `{"type": NAME, "fields": {...}, "arrays": [[name, dtype, shape], ...]}`. NAME is
one of `MESSAGES`; `fields` holds exactly that message's scalar fields (int, float, bool, str or
null, each of its declared type); `arrays` lists exactly its arrays (int64, int32, float64 or
float32, each of its declared dtype and rank), whose little-endian C-order bytes follow in that
order and fill the rest of the frame exactly. Decoding reads JSON and numpy buffers and builds
only these dataclasses, so the worst a peer (or anything else that reaches the socket) can send
is a `ProtocolError`, never code to run.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from carpool.model_runner import StepPlan

MAGIC = b"CPM1"
MAX_FRAME_BYTES = 1 << 30  # a batch plan is a few MB at most; refuse a length past this unread
DTYPES = {"int64": np.dtype("<i8"), "int32": np.dtype("<i4"), "float64": np.dtype("<f8"),
          "float32": np.dtype("<f4")}
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ProtocolError(ValueError):
    """A control frame that is not a well-formed message of the expected kind."""


# ------------------------------------------------------------ driver -> worker
@dataclass
class LoadModel:
    dtype: torch.dtype  # resolved once by the driver ('auto' could differ between hosts)


@dataclass
class InitKVCache:
    num_blocks: int


@dataclass
class RunPlan:
    micro_batch: int
    plan: StepPlan


@dataclass
class SendTimings:
    reset: bool = False


@dataclass
class Shutdown:
    pass


# ------------------------------------------------------------ worker -> driver
@dataclass
class WorkerReady:
    error: str | None = None  # why the model did not load; None when it did


@dataclass
class Timings:
    records: list[tuple[int, float, float]] = field(default_factory=list)  # (micro-batch, start, end)


# ------------------------------------------------------------ schemas
Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class Schema:
    """What one message type carries on the wire and how it maps to its dataclass."""

    cls: type
    scalars: dict[str, tuple[type, ...]]  # field -> the JSON types it may have
    arrays: dict[str, tuple[str, int]]  # array -> (dtype, rank)
    flatten: Callable[[Any], tuple[dict, Arrays]]
    build: Callable[[dict, Arrays], Any]


def ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)  # native order here; little-endian on the wire


def ragged(seqs: list) -> tuple[np.ndarray, np.ndarray]:
    """A list of int sequences as (concatenated values, lengths)."""
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    return flat, lens


def unragged(flat: np.ndarray, lens: np.ndarray, what: str) -> list[list[int]]:
    """Back from `ragged`, as lists; ProtocolError when the lengths do not split `flat`."""
    if (lens < 0).any() or int(lens.sum()) != len(flat):
        raise ProtocolError(f"{what}: lengths {lens.tolist()[:8]} do not split {len(flat)} values")
    values, ends = flat.tolist(), np.cumsum(lens).tolist()
    return [values[end - n:end] for n, end in zip(lens.tolist(), ends)]


def flatten_plan(msg: RunPlan) -> tuple[dict, Arrays]:
    p = msg.plan
    decode_tables, decode_table_lens = ragged(p.decode_tables)
    prefill_tables, prefill_table_lens = ragged([t for _, _, _, t in p.prefills])
    fresh_tails, fresh_tail_lens = ragged(p.fresh_tails)
    return {"micro_batch": msg.micro_batch}, {
        "input_ids": ints(p.input_ids), "positions": ints(p.positions), "slot_mapping": ints(p.slot_mapping),
        "decode_tables": decode_tables, "decode_table_lens": decode_table_lens, "decode_lens": ints(p.decode_lens),
        "prefills": ints([x for row, end, cached, _ in p.prefills for x in (row, end, cached)]).reshape(-1, 3),
        "prefill_table_lens": prefill_table_lens,
        "prefill_tables": prefill_tables, "sample_rows": ints(p.sample_rows),
        "fresh_tails": fresh_tails, "fresh_tail_lens": fresh_tail_lens,
        "prompt_logprob_rows": ints(p.prompt_logprob_rows),
    }


def build_plan(fields: dict, a: Arrays) -> RunPlan:
    n = len(a["input_ids"])
    if len(a["positions"]) != n or len(a["slot_mapping"]) != n:
        raise ProtocolError("RunPlan: input_ids, positions and slot_mapping differ in length")
    decode_tables = unragged(a["decode_tables"], a["decode_table_lens"], "RunPlan.decode_tables")
    if len(a["decode_lens"]) != len(decode_tables):
        raise ProtocolError("RunPlan: decode_lens and decode_tables differ in length")
    tables = unragged(a["prefill_tables"], a["prefill_table_lens"], "RunPlan.prefill_tables")
    if len(a["prefills"]) != len(tables):
        raise ProtocolError("RunPlan: prefills and prefill_table_lens differ in length")
    prefills = [(row, end, cached, table) for (row, end, cached), table in zip(a["prefills"].tolist(), tables)]
    fresh_tails = [np.asarray(x, dtype=np.int64) for x in
                   unragged(a["fresh_tails"], a["fresh_tail_lens"], "RunPlan.fresh_tails")]
    plan = StepPlan(a["input_ids"].tolist(), a["positions"], a["slot_mapping"], decode_tables,
                    a["decode_lens"].tolist(), prefills, a["sample_rows"].tolist(), fresh_tails,
                    a["prompt_logprob_rows"].tolist())
    return RunPlan(fields["micro_batch"], plan)


def flatten_dtype(msg: LoadModel) -> tuple[dict, Arrays]:
    name = str(msg.dtype).removeprefix("torch.")
    if name not in MODEL_DTYPES:
        raise ProtocolError(f"LoadModel: unsupported dtype {msg.dtype}")
    return {"dtype": name}, {}


def build_dtype(fields: dict, arrays: Arrays) -> LoadModel:
    if fields["dtype"] not in MODEL_DTYPES:
        raise ProtocolError(f"LoadModel: unsupported dtype {fields['dtype']!r}")
    return LoadModel(MODEL_DTYPES[fields["dtype"]])


def flatten_timings(msg: Timings) -> tuple[dict, Arrays]:
    r = msg.records
    return {}, {"micro_batch": ints([x[0] for x in r]), "start": np.asarray([x[1] for x in r], np.float64),
                "end": np.asarray([x[2] for x in r], np.float64)}


def build_timings(fields: dict, a: Arrays) -> Timings:
    if not len(a["micro_batch"]) == len(a["start"]) == len(a["end"]):
        raise ProtocolError("Timings: micro_batch, start and end differ in length")
    return Timings(list(zip(a["micro_batch"].tolist(), a["start"].tolist(), a["end"].tolist())))


def scalars_only(cls: type, **scalars: tuple[type, ...]) -> Schema:
    return Schema(cls, scalars, {}, lambda m: ({k: getattr(m, k) for k in scalars}, {}),
                  lambda f, a: cls(**f))


INT, STR = (int,), (str,)
I64_1D, F64_1D = ("int64", 1), ("float64", 1)
SCHEMAS = {s.cls.__name__: s for s in (
    Schema(LoadModel, {"dtype": STR}, {}, flatten_dtype, build_dtype),
    scalars_only(InitKVCache, num_blocks=INT),
    Schema(RunPlan, {"micro_batch": INT},
           {"input_ids": I64_1D, "positions": I64_1D, "slot_mapping": I64_1D, "decode_tables": I64_1D,
            "decode_table_lens": I64_1D, "decode_lens": I64_1D, "prefills": ("int64", 2),
            "prefill_table_lens": I64_1D, "prefill_tables": I64_1D, "sample_rows": I64_1D,
            "fresh_tails": I64_1D, "fresh_tail_lens": I64_1D, "prompt_logprob_rows": I64_1D},
           flatten_plan, build_plan),
    scalars_only(SendTimings, reset=(bool,)),
    scalars_only(Shutdown),
    scalars_only(WorkerReady, error=(str, type(None))),
    Schema(Timings, {}, {"micro_batch": I64_1D, "start": F64_1D, "end": F64_1D}, flatten_timings, build_timings),
)}
MESSAGES = tuple(s.cls for s in SCHEMAS.values())


# ------------------------------------------------------------ frames
def encode(msg: Any) -> bytes:
    schema = SCHEMAS.get(type(msg).__name__)
    if schema is None or schema.cls is not type(msg):
        raise ProtocolError(f"not a control message: {type(msg).__name__}")
    fields, arrays = schema.flatten(msg)
    check_fields(schema, fields)
    if set(arrays) != set(schema.arrays):
        raise ProtocolError(f"{schema.cls.__name__}: arrays {sorted(arrays)}, expected {sorted(schema.arrays)}")
    listed, chunks = [], []
    for name, (dtype, _) in schema.arrays.items():
        x = np.ascontiguousarray(arrays[name]).astype(DTYPES[dtype], copy=False)
        listed.append([name, dtype, list(x.shape)])
        chunks.append(x.tobytes())
    header = json.dumps({"type": schema.cls.__name__, "fields": fields, "arrays": listed},
                        separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *chunks])


def decode(frame: bytes | bytearray | memoryview | np.ndarray, expect: tuple[type, ...] = MESSAGES) -> Any:
    """The message in `frame` (bytes, or a uint8 array), if it is one of `expect`; ProtocolError
    otherwise. Nothing but JSON and flat numeric buffers is parsed."""
    buf = memoryview(frame).cast("B")
    if len(buf) < 8 or bytes(buf[:4]) != MAGIC:
        raise ProtocolError("not a carpool control frame (bad magic); the peer speaks another protocol")
    (header_len,) = struct.unpack("<I", buf[4:8])
    if 8 + header_len > len(buf):
        raise ProtocolError("control frame truncated in its header")
    try:
        header = json.loads(bytes(buf[8:8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"control frame header is not JSON: {e}") from None
    if not isinstance(header, dict) or set(header) != {"type", "fields", "arrays"}:
        raise ProtocolError("control frame header must have exactly type, fields and arrays")
    name = header["type"]
    schema = SCHEMAS.get(name) if isinstance(name, str) else None
    if schema is None:
        raise ProtocolError(f"unknown control message type {name!r}; known: {', '.join(SCHEMAS)}")
    if schema.cls not in expect:
        raise ProtocolError(f"unexpected control message {name}; expected {', '.join(c.__name__ for c in expect)}")
    fields = header["fields"]
    if not isinstance(fields, dict):
        raise ProtocolError(f"{name}: fields must be an object")
    check_fields(schema, fields)
    arrays = read_arrays(schema, header["arrays"], buf[8 + header_len:])
    return schema.build(fields, arrays)


def check_fields(schema: Schema, fields: dict) -> None:
    name = schema.cls.__name__
    if set(fields) != set(schema.scalars):
        raise ProtocolError(f"{name}: fields {sorted(fields)}, expected {sorted(schema.scalars)}")
    for key, types in schema.scalars.items():
        value = fields[key]
        if type(value) not in types:  # exact: a bool is not an int here
            raise ProtocolError(f"{name}.{key}: {type(value).__name__} where "
                                f"{' or '.join(t.__name__ for t in types)} belongs")
        if type(value) is int and not -(1 << 63) <= value < 1 << 63:
            raise ProtocolError(f"{name}.{key}: {value} does not fit in 64 bits")


def read_arrays(schema: Schema, listed: Any, body: memoryview) -> Arrays:
    name = schema.cls.__name__
    if not (isinstance(listed, list) and all(isinstance(a, list) and len(a) == 3 for a in listed)
            and [a[0] for a in listed] == list(schema.arrays)):
        raise ProtocolError(f"{name}: arrays must be [name, dtype, shape] for {list(schema.arrays)}, in order")
    arrays, offset = {}, 0
    for array, dtype, shape in listed:
        want_dtype, rank = schema.arrays[array]
        if dtype != want_dtype or not isinstance(shape, list) or len(shape) != rank or \
                not all(type(d) is int and 0 <= d <= MAX_FRAME_BYTES for d in shape):
            raise ProtocolError(f"{name}.{array}: got {dtype} {shape}, expected a rank-{rank} {want_dtype} array")
        size = DTYPES[dtype].itemsize * math.prod(shape)
        if offset + size > len(body):
            raise ProtocolError(f"{name}.{array}: the frame ends inside it")
        wire = np.frombuffer(body[offset:offset + size], dtype=DTYPES[dtype]).reshape(shape)
        arrays[array] = wire.astype(wire.dtype.newbyteorder("="))  # a copy, in this machine's byte order
        offset += size
    if offset != len(body):
        raise ProtocolError(f"{name}: {len(body) - offset} bytes after the last array")
    return arrays

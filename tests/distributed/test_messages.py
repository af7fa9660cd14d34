"""The control channel's wire format: every message round-trips; anything else is refused with a
ProtocolError, and nothing is ever unpickled."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch

from carpool.distributed import comm, messages
from carpool.distributed.messages import (MAGIC, MESSAGES, InitKVCache, LoadModel, ProtocolError, RunPlan,
                                          SendTimings, Shutdown, Timings, WorkerReady, decode, encode)
from carpool.model_runner import StepPlan


def a_plan() -> StepPlan:
    """Two decodes, a first chunk and a later one (each with its block table), fresh tails."""
    return StepPlan(
        input_ids=[5, 9, 100, 101, 102, 49151, 7],
        positions=np.array([40, 17, 0, 1, 2, 16, 17], dtype=np.int64),
        slot_mapping=np.array([72, 33, 48, 49, 50, 96, 97], dtype=np.int64),
        decode_tables=[[0, 1, 4], [2, 3]],
        decode_lens=[41, 18],
        prefills=[(2, 5, 0, [5]), (5, 7, 16, [6, 1 << 40])],
        sample_rows=[0, 1, 6],
        fresh_tails=[np.array([51, 52, 53], dtype=np.int64), np.array([98], dtype=np.int64)],
    )


def empty_plan() -> StepPlan:
    e = np.zeros(0, dtype=np.int64)
    return StepPlan([], e, e, [], [], [], [], [])


def same_plan(a: StepPlan, b: StepPlan) -> bool:
    return (a.input_ids == b.input_ids and np.array_equal(a.positions, b.positions)
            and np.array_equal(a.slot_mapping, b.slot_mapping) and a.decode_tables == b.decode_tables
            and a.decode_lens == b.decode_lens and a.prefills == b.prefills and a.sample_rows == b.sample_rows
            and len(a.fresh_tails) == len(b.fresh_tails)
            and all(np.array_equal(x, y) for x, y in zip(a.fresh_tails, b.fresh_tails)))


EXAMPLES = [LoadModel(torch.float32), LoadModel(torch.bfloat16), LoadModel(torch.float16), InitKVCache(1234),
            RunPlan(7, a_plan()), RunPlan(0, empty_plan()), SendTimings(), SendTimings(reset=True), Shutdown(),
            WorkerReady(), WorkerReady("KeyError: 'model.layers.0.mlp' lacks weights"), Timings(),
            Timings([(0, 12.5, 12.75), (1, 13.0, 13.25)])]


@pytest.fixture
def no_pickle(monkeypatch):
    """Any unpickling during the test fails it."""
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used on the control channel")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)


def test_every_message_type_round_trips(no_pickle):
    assert {type(m) for m in EXAMPLES} == set(MESSAGES)
    for msg in EXAMPLES:
        frame = encode(msg)
        assert frame.startswith(MAGIC)
        got = decode(np.frombuffer(frame, dtype=np.uint8))  # as recv_message hands it over
        assert type(got) is type(msg)
        if isinstance(msg, RunPlan):
            assert got.micro_batch == msg.micro_batch and same_plan(got.plan, msg.plan)
            assert got.plan.positions.dtype == np.int64 and all(t.dtype == np.int64 for t in got.plan.fresh_tails)
        else:
            assert got == msg


def test_decoded_plan_runs_like_the_original(no_pickle):
    """The decoded plan has the types the runner reads (lists of ints, int64 arrays)."""
    got = decode(encode(RunPlan(1, a_plan()))).plan
    assert all(type(x) is int for x in got.input_ids + got.sample_rows + got.decode_lens)
    assert got.prefills[0][3] == [5] and all(type(x) is int for x in got.prefills[1][3])


def frame_of(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + body


class RunsCode:
    """A pickle payload that would run code when unpickled."""

    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').touch()",))


def test_pickle_payload_is_refused_not_run(no_pickle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = pickle.dumps(RunsCode())
    with pytest.raises(ProtocolError, match="bad magic"):
        decode(payload)
    # A valid-looking header with a pickle where the arrays belong: read as numbers, then refused.
    header = {"type": "Timings", "fields": {}, "arrays": [["micro_batch", "int64", [1]], ["start", "float64", [1]],
                                                           ["end", "float64", [1]]]}
    with pytest.raises(ProtocolError, match="bytes after the last array|ends inside"):
        decode(frame_of(header, payload))
    assert not (tmp_path / "PWNED").exists()
    assert not hasattr(comm, "pickle") and not hasattr(messages, "pickle")


@pytest.mark.parametrize("header,error", [
    ({"type": "Exploit", "fields": {}, "arrays": []}, "unknown control message type 'Exploit'"),
    ({"type": "builtins.exec", "fields": {}, "arrays": []}, "unknown control message type"),
    ({"type": ["Shutdown"], "fields": {}, "arrays": []}, "unknown control message type"),
    ({"type": "Shutdown", "fields": {}}, "exactly type, fields and arrays"),
    ({"type": "Shutdown", "fields": {"x": 1}, "arrays": []}, r"fields \['x'\], expected \[\]"),
    ({"type": "InitKVCache", "fields": {"num_blocks": "12"}, "arrays": []}, "str where int belongs"),
    ({"type": "InitKVCache", "fields": {"num_blocks": True}, "arrays": []}, "bool where int belongs"),
    ({"type": "InitKVCache", "fields": {"num_blocks": 1 << 70}, "arrays": []}, "64 bits"),
    ({"type": "LoadModel", "fields": {"dtype": "object"}, "arrays": []}, "unsupported dtype 'object'"),
    ({"type": "Timings", "fields": {}, "arrays": [["micro_batch", "object", [1]]]}, "arrays must be"),
    ({"type": "Timings", "fields": {}, "arrays": [["micro_batch", "O", [0]], ["start", "float64", [0]],
                                                  ["end", "float64", [0]]]}, "expected a rank-1 int64"),
    ({"type": "Timings", "fields": {}, "arrays": [["micro_batch", "int64", [-1]], ["start", "float64", [0]],
                                                  ["end", "float64", [0]]]}, "expected a rank-1 int64"),
    ({"type": "Timings", "fields": {}, "arrays": [["micro_batch", "int64", [1 << 40]], ["start", "float64", [0]],
                                                  ["end", "float64", [0]]]}, "expected a rank-1 int64|ends inside"),
])
def test_malformed_frames_are_refused(no_pickle, header, error):
    with pytest.raises(ProtocolError, match=error):
        decode(frame_of(header))


def test_truncated_and_inconsistent_frames_are_refused(no_pickle):
    frame = encode(RunPlan(3, a_plan()))
    for cut in (0, 3, 7, 20, len(frame) - 1):
        with pytest.raises(ProtocolError):
            decode(frame[:cut])
    with pytest.raises(ProtocolError, match="bytes after"):
        decode(frame + b"\0" * 8)
    with pytest.raises(ProtocolError, match="not JSON"):
        decode(MAGIC + struct.pack("<I", 4) + b"\xff\xfe{}")
    bad = a_plan()
    bad.positions = bad.positions[:-1]
    with pytest.raises(ProtocolError, match="differ in length"):
        decode(encode(RunPlan(3, bad)))


def test_receiver_accepts_only_what_it_expects(no_pickle):
    with pytest.raises(ProtocolError, match="unexpected control message RunPlan; expected Timings"):
        decode(encode(RunPlan(1, empty_plan())), (Timings,))
    assert decode(encode(Shutdown()), (InitKVCache, Shutdown)) == Shutdown()


def test_only_control_messages_are_encoded():
    with pytest.raises(ProtocolError, match="not a control message: dict"):
        encode({"type": "Shutdown"})
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        encode(LoadModel(torch.int8))

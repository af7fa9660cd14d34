"""model/gguf_file.py reads what gguf-py's GGUFReader reads: every field's contents, every
tensor's name, shape, type, size and bytes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from carpool.model.gguf_file import GGUFFile
from carpool.model.loader import open_gguf


def test_reads_what_gguf_py_reads(model_path):
    ours, theirs = GGUFFile(model_path), GGUFReader(model_path)
    keys = {k for k in theirs.fields if not k.startswith("GGUF.")}  # gguf-py's own header pseudo-fields
    assert set(ours.fields) == keys
    for key in keys:
        assert ours.fields[key].contents() == pytest.approx(theirs.fields[key].contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.shape, a.tensor_type, a.n_bytes) == (tuple(int(d) for d in b.shape), b.tensor_type, b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_not_a_gguf_file_is_named(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a (readable )?GGUF file"):
        open_gguf(str(path))

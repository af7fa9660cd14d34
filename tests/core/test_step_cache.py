"""The step-time calibration cache: steps written come back as they were; a missing, foreign or
broken file is no cache; the key changes with anything a step's cost depends on."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core import step_cache
from carpool.core.step_cost import BatchShape
from tests.helpers import examples

shapes = st.builds(BatchShape,
                   prefills=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 8192)), max_size=3).map(tuple),
                   decode_contexts=st.lists(st.integers(1, 8192), max_size=20).map(tuple),
                   num_sampled=st.integers(0, 20), num_drafts=st.integers(0, 40))


@settings(max_examples=examples(20), deadline=None)
@given(steps=st.lists(st.tuples(shapes, st.floats(1e-4, 10.0)), min_size=1, max_size=20))
def test_steps_come_back_as_written(steps, tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "steps.json"
    step_cache.save_steps(path, {"model": "m"}, steps)
    assert step_cache.load_steps(path) == steps


def test_the_directory_follows_the_environment_and_off_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv(step_cache.CACHE_ENV, str(tmp_path))
    path = step_cache.cache_path({"model": "m", "threads": 2})
    assert path.parent == tmp_path
    assert path == step_cache.cache_path({"threads": 2, "model": "m"})  # key order does not matter
    assert path != step_cache.cache_path({"model": "m", "threads": 1})
    monkeypatch.setenv(step_cache.CACHE_ENV, "off")
    assert step_cache.cache_path({"model": "m"}) is None
    assert step_cache.load_steps(None) is None
    step_cache.save_steps(None, {}, [(BatchShape(decode_contexts=(5,)), 0.01)])  # nothing to write, no error


def test_a_missing_foreign_or_broken_file_is_no_cache(tmp_path, caplog):
    assert step_cache.load_steps(tmp_path / "absent.json") is None
    bad = tmp_path / "bad.json"
    for text in ("{not json", json.dumps({"format": "other/9", "steps": []}),
                 json.dumps({"format": step_cache.FORMAT, "steps": [{"prefills": []}]})):
        bad.write_text(text)
        assert step_cache.load_steps(bad) is None
    assert caplog.text.count("ignoring the step-time cache") == 3


def test_an_unwritable_directory_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    step_cache.save_steps(blocker / "sub" / "steps.json", {}, [(BatchShape(decode_contexts=(5,)), 0.01)])
    assert "could not write the step-time cache" in caplog.text


def test_a_model_file_rewritten_under_its_name_is_another_model(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"1234")
    before = step_cache.file_identity(str(model))
    model.write_bytes(b"123456")
    assert step_cache.file_identity(str(model)) != before
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    assert [name.rsplit("/", 1)[1] for name, *_ in step_cache.file_identity(str(folder))] == [
        "config.json", "model.safetensors"]

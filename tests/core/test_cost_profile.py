"""`carpool profile` tables: the file format, interpolation, predictions from them."""

from __future__ import annotations

import pytest

from carpool.core.cost_profile import Grid2, Profile, ProfiledCostModel, interp1
from carpool.core.step_cost import BatchShape


def test_interpolation():
    assert interp1([1, 3], [10, 30], 2) == 20
    assert interp1([1, 3], [10, 30], 5) == 50  # linear extrapolation
    g = Grid2([0, 2], [0, 10], [[0, 10], [20, 30]])
    assert g(1, 5) == 15


def write_profile(path, **overrides):
    prof = Profile()
    for n in (1, 64, 512):
        prof.add("linear", n, 0, overrides.get("linear", 0.01 + n * 1e-4))
    for n in (1, 512):
        for p in (0, 1024):
            prof.add("prefill_attn", n, p, 1e-6 * n * (p + n))
    for d in (1, 32):
        for c in (16, 2048):
            prof.add("decode_attn", d, c, 1e-6 * d * c)
    for rows in (1, 64):
        prof.add("sample", rows, 0, 1e-3 * rows)
    prof.add("overhead", 0, 0, 0.002)
    prof.write(path)


def test_profiled_model_predicts_from_its_tables(tmp_path):
    path = tmp_path / "p.csv"
    write_profile(path)
    model = ProfiledCostModel.load(path)
    shape = BatchShape(prefills=((256, 0),), decode_contexts=(100, 300), num_sampled=3)
    linear = interp1([1, 64, 512], [0.01 + n * 1e-4 for n in (1, 64, 512)], 258)
    prefill = interp1([1, 512], [1e-6 * 1 * 1, 1e-6 * 512 * 512], 256)  # bilinear: at prefix 0
    expected = linear + prefill + 1e-6 * 2 * 300 + 3e-3 + 0.002  # decode: 2 rows padded to the longest
    assert model.stage_time(shape, 0) == pytest.approx(expected)
    two = ProfiledCostModel.load(path, num_stages=2)
    assert two.stage_time(shape, 0) + two.stage_time(shape, 1) == pytest.approx(expected)


def test_small_steps_take_the_whole_step_table(tmp_path):
    """Where the runner fuses small forwards, the profile times decode-only ones whole
    (decode_step); hybrid steps within it count each chunk token as a decode at the step's
    longest context; bigger steps still add up the parts."""
    path = tmp_path / "p.csv"
    write_profile(path)
    with path.open("a") as f:
        for d in (1, 8):
            for c in (16, 2048):
                f.write(f"decode_step,{d},{c},{0.004 * d + 1e-6 * c}\n")
    model, parts = ProfiledCostModel.load(path), ProfiledCostModel.load(path)
    parts.decode_step = None
    assert model.decode_step is not None
    decodes = BatchShape(decode_contexts=(100, 300), num_sampled=2)
    assert model.stage_time(decodes, 0) == pytest.approx(0.008 + 300e-6 + 2e-3 + 0.002)
    assert model.stage_time(decodes, 0) != pytest.approx(parts.stage_time(decodes, 0))
    hybrid = BatchShape(prefills=((4, 200),), decode_contexts=(100,), num_sampled=2)  # 5 tokens, context 204
    assert model.stage_time(hybrid, 0) == pytest.approx(0.02 + 204e-6 + 2e-3 + 0.002)
    for shape in (BatchShape(prefills=((16, 0),), decode_contexts=(100,), num_sampled=2),  # 17 tokens
                  BatchShape(decode_contexts=(100,) * 9, num_sampled=9)):  # 9 > the table's 8
        assert model.stage_time(shape, 0) == pytest.approx(parts.stage_time(shape, 0))


@pytest.mark.parametrize("content, message", [
    ("op,x,y,seconds\nlinear,1,0,0.1\n", "no rows for"),
    ("a,b\n1,2\n", "expected columns"),
    ("op,x,y,seconds\nlinear,one,0,0.1\n", "not a number"),
    ("op,x,y,seconds\nlinear,1,0,-3\n", "bad time"),
])
def test_bad_profile_files(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        ProfiledCostModel.load(path)


def test_missing_profile_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="carpool profile"):
        ProfiledCostModel.load(tmp_path / "none.csv")


def test_profile_grid_must_be_full(tmp_path):
    path = tmp_path / "p.csv"
    write_profile(path)
    path.write_text(path.read_text() + "decode_attn,64,16,0.5\n")
    with pytest.raises(ValueError, match="full grid"):
        ProfiledCostModel.load(path)


def test_the_engine_seeds_its_step_time_fit_from_a_profile(tmp_path):
    """--cost-profile: the SLO policy's fit starts from the table's predictions, not empty."""
    from types import SimpleNamespace

    from carpool.core.step_cost import ChunkSizes, StepCostModel, step_time
    from carpool.engine import LLMEngine

    path = tmp_path / "p.csv"
    write_profile(path)
    config = SimpleNamespace(target_tbt_ms=100.0, target_tbt=0.1, cost_profile=str(path), max_num_batched_tokens=512)
    engine = SimpleNamespace(max_model_len=2048)  # all _step_cost_args reads of the engine
    args = LLMEngine._step_cost_args(engine, config)
    assert args["target_tbt"] == pytest.approx(0.1) and args["strict"]  # a given target is an SLO
    fit, sizes = args["cost"], args["chunk_sizes"]
    assert isinstance(fit, StepCostModel) and fit.ready and isinstance(sizes, ChunkSizes)
    probe = BatchShape(prefills=((128, 512),), decode_contexts=(512,) * 8, num_sampled=8)
    assert fit.predict(probe) == pytest.approx(step_time(ProfiledCostModel.load(path), probe), rel=0.2)
    unseeded = LLMEngine._step_cost_args(engine, SimpleNamespace(**{**vars(config), "cost_profile": None}))
    assert unseeded["cost"].num_observations == 0 and unseeded["chunk_sizes"] is None

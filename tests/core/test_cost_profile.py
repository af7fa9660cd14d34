"""`carpool profile` files: the format, its errors, and the cost model fitted to them."""

from __future__ import annotations

import json

import pytest

from carpool.core.cost_profile import FittedCostModel, Profile
from carpool.core.step_cost import FEATURES, BatchShape, StepCostModel, features

SHAPES = [BatchShape(decode_contexts=(c,) * d, num_sampled=d) for d in (1, 4, 16, 32) for c in (128, 1024)] + \
         [BatchShape(((n, p),), (300,) * d, d + 1) for n in (16, 64, 256, 1024, 2000) for p in (0, 512) for d in (0, 8)]


def linear_cost(weights: list[float]):
    """A step time that the fit's features span exactly."""
    return lambda shape: sum(w * x for w, x in zip(weights, features(shape)))


WEIGHTS = [4e-3, 0.6, 0.2, 0.1, 0.05, 0.3, 0.5, 0.2, 0.01, 2e-3, 0.4, 8e-3, 0.0, 0.1, 0.2]


def write_profile(path, cost=linear_cost(WEIGHTS)) -> Profile:
    profile = Profile(meta={"cpu": "test"})
    for shape in SHAPES:
        profile.add(shape, cost(shape))
    profile.write(path)
    return profile


def test_a_profile_round_trips(tmp_path):
    written = write_profile(tmp_path / "p.json")
    read = Profile.load(tmp_path / "p.json")
    assert read.steps == written.steps and read.meta == {"cpu": "test"}


def test_the_fit_of_an_exactly_linear_profile_reproduces_it(tmp_path):
    write_profile(tmp_path / "p.json")
    model = FittedCostModel.load(tmp_path / "p.json")
    cost = linear_cost(WEIGHTS)
    probe = BatchShape(prefills=((300, 200),), decode_contexts=(100, 700), num_sampled=3)
    assert model.stage_time(probe, 0) == pytest.approx(cost(probe), rel=1e-2)  # the ridge term pulls a little
    two = FittedCostModel.load(tmp_path / "p.json", num_stages=2)
    assert two.stage_time(probe, 0) + two.stage_time(probe, 1) == pytest.approx(model.stage_time(probe, 0))


def step(**overrides) -> dict:
    return {"prefills": [[16, 0]], "decode_contexts": [100], "num_sampled": 2, "seconds": 0.01, **overrides}


@pytest.mark.parametrize("content, message", [
    ("op,x,y,seconds\nlinear,1,0,0.1\n", "not a carpool profile"),
    (json.dumps({"format": "other", "steps": []}), "not a carpool-profile/2"),
    (json.dumps({"format": "carpool-profile/2", "steps": []}), "holds no steps"),
    (json.dumps({"format": "carpool-profile/2", "steps": [step(seconds="fast")]}), "step 0 is malformed"),
    (json.dumps({"format": "carpool-profile/2", "steps": [step(), step(prefills=[[1]])]}), "step 1 is malformed"),
    (json.dumps({"format": "carpool-profile/2", "steps": [step(seconds=-1)]}), "bad time"),
    (json.dumps({"format": "carpool-profile/2", "steps": [step(prefills=[], decode_contexts=[])]}), "no tokens"),
])
def test_bad_profile_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        Profile.load(path)


def test_missing_profile_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="carpool profile"):
        FittedCostModel.load(tmp_path / "none.json")


def test_the_engine_seeds_its_step_time_fit_from_a_profile(tmp_path):
    """--cost-profile: the SLO policy's fit starts from the profile's fit, not empty."""
    from types import SimpleNamespace

    from carpool.core.step_cost import ChunkSizes, StepCostModel, step_time
    from carpool.engine import LLMEngine

    path = tmp_path / "p.json"
    write_profile(path)
    config = SimpleNamespace(target_tbt_ms=100.0, target_tbt=0.1, cost_profile=str(path), max_num_batched_tokens=512)
    engine = SimpleNamespace(max_model_len=2048)  # all _step_cost_args reads of the engine
    args = LLMEngine._step_cost_args(engine, config)
    assert args["target_tbt"] == pytest.approx(0.1) and args["strict"]  # a given target is an SLO
    fit, sizes = args["cost"], args["chunk_sizes"]
    assert isinstance(fit, StepCostModel) and fit.ready and isinstance(sizes, ChunkSizes)
    probe = BatchShape(prefills=((128, 512),), decode_contexts=(512,) * 8, num_sampled=8)
    assert fit.predict(probe) == pytest.approx(step_time(FittedCostModel.load(path), probe), rel=0.05)
    unseeded = LLMEngine._step_cost_args(engine, SimpleNamespace(**{**vars(config), "cost_profile": None}))
    assert unseeded["cost"].num_observations == 0 and unseeded["chunk_sizes"] is None


def test_a_noisy_profile_is_scaled_to_its_median_step():
    """Relative least squares on noisy steps comes out low; the model is scaled so the median
    profiled step runs at its prediction, and keeps the ratios (median 1) for simulated jitter."""
    import random
    import statistics

    rng = random.Random(0)
    cost = linear_cost(WEIGHTS)
    profile = Profile()
    for _ in range(40):
        for shape in SHAPES:
            profile.add(shape, cost(shape) * rng.lognormvariate(0.0, 0.2))  # median ratio 1
    model = FittedCostModel.from_profile(profile)
    # for this noise the relative fit's optimum is exp(-1.5 * 0.2^2) = 0.94x the median step
    assert statistics.median(model.fit.predict_by_weights(s) / cost(s) for s in SHAPES) < 0.97
    assert statistics.median(model.stage_time(s, 0) / cost(s) for s in SHAPES) == pytest.approx(1.0, abs=0.02)
    assert len(model.residuals) == len(profile.steps)
    assert statistics.median(model.residuals) == pytest.approx(1.0)


def test_an_online_fit_is_frozen_at_its_steps_median():
    """The online fit after a run (steps observed one by one, drifting weights) is scaled the
    same way, over the steps it saw: its frozen model is not low by the relative fit's bias."""
    import random
    import statistics

    assert len(WEIGHTS) == len(FEATURES)
    rng = random.Random(1)
    cost = linear_cost(WEIGHTS)
    fit = StepCostModel()
    steps = [(shape, cost(shape) * rng.lognormvariate(0.0, 0.2)) for _ in range(20) for shape in SHAPES]
    for shape, seconds in steps:
        fit.observe(shape, seconds)
    frozen = FittedCostModel.from_fit(fit, steps)
    assert statistics.median(fit.predict_by_weights(s) / cost(s) for s in SHAPES) < 0.97
    assert statistics.median(frozen.stage_time(s, 0) / cost(s) for s in SHAPES) == pytest.approx(1.0, abs=0.03)
    assert statistics.median(seconds / frozen.stage_time(shape, 0) for shape, seconds in steps) == pytest.approx(1.0)

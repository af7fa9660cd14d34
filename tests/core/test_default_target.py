"""Sarathi's default step-time target: on for sarathi alone, off with 0, a comfort level that
shrinks chunks as steps get dearer and yields to a model too slow for it."""

from __future__ import annotations

import argparse
from dataclasses import replace
from types import SimpleNamespace

import pytest

from carpool.args import add_engine_args, engine_config_from_args
from carpool.config import DEFAULT_TARGET_TBT_MS, SCHEDULER_NAMES, EngineConfig
from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import SarathiScheduler, SloSarathiScheduler, make_scheduler
from carpool.core.step_cost import FEATURES, BatchShape, StepCostModel
from carpool.engine import LLMEngine
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams

BUDGET = 512


@pytest.fixture(autouse=True)
def the_default(monkeypatch):
    """The suite runs with CARPOOL_TARGET_TBT_MS=0 (tests/conftest.py); these tests see the default."""
    monkeypatch.delenv("CARPOOL_TARGET_TBT_MS", raising=False)


def config(**kw) -> EngineConfig:
    return EngineConfig(model="m.gguf", **kw)


def scheduler_for(cfg: EngineConfig, num_blocks: int = 4000):
    """The scheduler `LLMEngine` builds for `cfg` (its _step_cost_args, without a model)."""
    args = LLMEngine._step_cost_args(SimpleNamespace(max_model_len=num_blocks * 16), cfg)
    return make_scheduler(cfg.scheduler, BlockManager(num_blocks, 16), cfg.max_num_batched_tokens, 256,
                          num_blocks * 16, **args)


def synthetic(fixed: float, per_token: float) -> StepCostModel:
    """A fit that does not learn: `fixed` seconds a step plus `per_token` seconds a token."""
    m = StepCostModel()
    m.weights = [0.0] * len(FEATURES)
    m.weights[FEATURES.index("fixed")] = fixed
    m.weights[FEATURES.index("tokens")] = per_token * 1e3  # the tokens feature is scaled by 1e-3
    m.max_tokens_seen = 10_000
    m.observe = lambda shape, seconds: None  # type: ignore[method-assign]
    return m


def request(i: int, prompt: int, out: int) -> Request:
    return Request(f"r{i}", [10 + (i * 31 + j) % 900 for j in range(prompt)], SamplingParams(max_tokens=out))


def step(sched) -> tuple:
    """One iteration; every sampled request gets a token, and leaves at its max_tokens."""
    batch = sched.schedule()
    for r in sched.commit(batch):
        r.append_token(7, 0.0)
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            sched.finish(r, RequestStatus.FINISHED_LENGTH)
    return batch


def burst_with_decodes(sched, cost: StepCostModel, num_decodes: int = 16) -> None:
    """`num_decodes` short requests decoding (started on a cheap model), then a 2000-token
    prompt waiting, and `cost` the step-time fit from here on."""
    sched.cost = synthetic(0.001, 1e-5)
    for i in range(num_decodes):
        sched.add_request(request(i, 8, 1000))
    while not all(r.is_decode for r in sched.running) or len(sched.running) < num_decodes:
        step(sched)
    sched.add_request(request(99, 2000, 4))
    sched.cost = cost


def test_the_default_config_targets_sarathi_and_no_other_scheduler():
    assert config().target_tbt_ms is None and config().target_tbt == DEFAULT_TARGET_TBT_MS / 1e3
    assert isinstance(scheduler_for(config()), SloSarathiScheduler)
    for name in set(SCHEDULER_NAMES) - {"sarathi"}:
        cfg = config(scheduler=name)  # the default is no error for them
        assert cfg.target_tbt is None and type(scheduler_for(cfg)).name == name
        assert replace(config(), scheduler=name).target_tbt is None
    with pytest.raises(ValueError, match="sarathi"):
        config(scheduler="vllm", target_tbt_ms=300)


def test_the_default_is_a_comfort_level_and_a_given_target_an_slo():
    default, given = scheduler_for(config()), scheduler_for(config(target_tbt_ms=250))
    assert default.target_tbt == pytest.approx(DEFAULT_TARGET_TBT_MS / 1e3) and not default.strict
    assert given.target_tbt == pytest.approx(0.25) and given.strict
    assert default.max_num_batched_tokens == given.max_num_batched_tokens == BUDGET  # still the cap


@pytest.mark.parametrize("off", ["0", "none", "off"])
def test_zero_none_or_off_restores_the_fixed_budget(off, monkeypatch):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m.gguf", "--target-tbt-ms", off]))
    assert cfg.target_tbt_ms == 0 and cfg.target_tbt is None
    monkeypatch.setenv("CARPOOL_TARGET_TBT_MS", off)
    for c in (cfg, config()):
        sched = scheduler_for(c)
        assert type(sched) is SarathiScheduler
        sched.add_request(request(0, 2000, 2))
        assert sched.schedule().num_tokens == [BUDGET]  # the whole budget, whatever a step costs


def test_bad_targets_are_errors(monkeypatch):
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="target_tbt_ms"):
            config(target_tbt_ms=bad)
    monkeypatch.setenv("CARPOOL_TARGET_TBT_MS", "fast")
    with pytest.raises(ValueError, match="CARPOOL_TARGET_TBT_MS"):
        config()


@pytest.mark.parametrize("per_token_ms", [0.3, 1.0, 3.1, 6.0])
def test_a_granted_chunk_shrinks_as_tokens_get_dearer(per_token_ms):
    """16 decodes and a long prompt waiting, under the default target: where a token is cheap
    (the embedded model on a fast CPU) the chunk takes the whole budget; where it is dear (a 1B
    model: ~3.1 ms) the step is held to the target."""
    sched = scheduler_for(config())
    burst_with_decodes(sched, synthetic(0.01, per_token_ms / 1e3))
    batch = step(sched)
    chunk = batch.num_prefill_tokens
    assert batch.num_decode_tokens == 16
    if sched.cost.upper(BatchShape(((BUDGET - 16, 0),), (9,) * 16, 16)) <= sched.target_tbt:
        assert chunk == BUDGET - 16
    else:
        assert 0 < chunk < BUDGET - 16
        assert sched.cost.upper(batch.shape) <= sched.target_tbt
        one_more = BatchShape(((chunk + 1, 0),), batch.shape.decode_contexts, batch.shape.num_sampled)
        assert sched.cost.upper(one_more) > sched.target_tbt
    expected = min(BUDGET - 16, int((sched.target_tbt - 0.01 - 16 * per_token_ms / 1e3) / (per_token_ms / 1e3)))
    assert abs(chunk - expected) <= 1


def test_a_model_too_slow_for_the_default_still_prefills():
    """Decodes alone over the target: held as an SLO the step runs them alone; the default lets
    a chunk take as long as they do, so the prompt still advances."""
    strict, default = scheduler_for(config(target_tbt_ms=DEFAULT_TARGET_TBT_MS)), scheduler_for(config())
    for sched in (strict, default):
        burst_with_decodes(sched, synthetic(0.4, 0.003))  # 16 decodes: 0.448 s, over the 0.3 s target
    held, yielded = step(strict), step(default)
    assert held.num_prefill_tokens == 0 and held.slo_unreachable and held.num_decode_tokens == 16
    decodes = default.cost.upper(BatchShape(decode_contexts=yielded.shape.decode_contexts))
    assert yielded.num_decode_tokens == 16 and yielded.slo_unreachable
    assert yielded.num_prefill_tokens == int(decodes / 0.003)  # as long as the decodes, to the token
    assert default.cost.upper(yielded.shape) <= 2 * decodes + 1e-9


def test_a_model_too_slow_for_the_default_finishes_a_burst_sooner():
    """16 prompts at once on a model whose decodes fill the target (a large model on a small
    CPU): held strictly, prompts wait for decodes and then creep in 16-token chunks."""
    def steps(sched) -> int:
        sched.cost = synthetic(0.25, 0.004)
        for i in range(16):
            sched.add_request(request(i, 300 + 40 * i, 32))
        n = 0
        while sched.has_unfinished_requests():
            batch = step(sched)
            decodes = sched.cost.upper(BatchShape(decode_contexts=batch.shape.decode_contexts))
            if batch.num_decode_tokens and not sched.strict:
                assert sched.cost.upper(batch.shape) <= max(sched.target_tbt, 2 * decodes) + 1e-9
            n += 1
        return n
    strict, default = steps(scheduler_for(config(target_tbt_ms=300))), steps(scheduler_for(config()))
    assert default < strict / 3


def test_a_default_engine_runs_the_target_with_a_fitted_cost(model_path, monkeypatch):
    """The default engine: sarathi under the default target, its step-time fit timed at start-up
    on the model it serves (not seeded from another model's profile)."""
    monkeypatch.setattr(LLMEngine, "CALIBRATION_PROMPTS", (16, 48, 96))  # fewer tokens than start-up's
    engine = LLMEngine(model=model_path, kv_cache_memory=64 << 20)
    sched = engine.scheduler
    assert isinstance(sched, SloSarathiScheduler) and not sched.strict
    assert sched.target_tbt == pytest.approx(DEFAULT_TARGET_TBT_MS / 1e3)
    assert sched.cost.ready and sched.cost.num_observations >= 8
    assert sched.cost.predict(BatchShape(((256, 0),))) > 0
    req = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(req.output_token_ids) == 4


@pytest.mark.parametrize("strict", [False, True])
def test_a_step_without_decodes_takes_the_whole_budget_under_the_default(strict):
    """Nothing is decoding, so no stream waits on the step: the default target lets a lone prompt
    take the whole token budget, however dear; a target given explicitly still bounds it."""
    sched = scheduler_for(config(**({"target_tbt_ms": DEFAULT_TARGET_TBT_MS} if strict else {})))
    assert sched.strict == strict
    sched.cost = synthetic(0.01, 3e-3)  # 512 tokens: 1.5 s, five times the target
    sched.add_request(request(0, 2000, 4))
    batch = step(sched)
    assert batch.total_tokens == (sched.max_num_batched_tokens if not strict else int((0.3 - 0.01) / 3e-3))
    assert batch.slo_unreachable == (batch.predicted_time > sched.target_tbt and strict)

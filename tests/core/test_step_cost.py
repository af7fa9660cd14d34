"""The online step-time fit: it converges, stays non-negative, and snaps chunks on staircases."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.step_cost import (
    FEATURES,
    SMALL_STEP_TOKENS,
    BatchShape,
    ChunkSizes,
    StepCostModel,
    features,
    nonnegative_least_squares,
)
from tests.helpers import examples


def true_time(shape: BatchShape) -> float:
    """A machine with a fixed cost, per-token GEMMs, per-row work, padded decode attention and
    chunk attention (the shape of this CPU's profile, rounded)."""
    d = shape.decode_contexts
    attn = sum(n * (p + (n + 1) / 2) for n, p in shape.prefills)
    return (0.008 + 2.7e-4 * shape.num_tokens + 1e-4 * (len(d) + len(shape.prefills))
            + 4e-7 * len(d) * max(d, default=0) + 6e-8 * attn)


def random_shape(rng: random.Random) -> BatchShape:
    decodes = tuple(rng.randint(16, 2048) for _ in range(rng.choice([0, 1, 4, 12, 30])))
    prefills = tuple((rng.randint(1, 512), rng.choice([0, 0, 256, 1024])) for _ in range(rng.choice([0, 1, 1, 2])))
    if not decodes and not prefills:
        decodes = (rng.randint(16, 512),)
    return BatchShape(prefills, decodes, len(decodes))


def test_fit_converges_on_synthetic_step_times():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(600):
        shape = random_shape(rng)
        model.observe(shape, true_time(shape) * rng.uniform(0.97, 1.03))
    errors = sorted(abs(model.predict(s) / true_time(s) - 1) for s in (random_shape(rng) for _ in range(300)))
    assert errors[len(errors) // 2] < 0.02  # median
    assert errors[int(0.9 * len(errors))] < 0.05
    assert all(w >= 0 for w in model.weights)
    assert 1.0 <= model.margin < 1.06  # the 95th percentile of +-3% noise


def test_a_poor_early_fit_does_not_hold_the_margin():
    """The margin is measured against the fit as it stands: a fit that first saw decodes alone
    under-predicts its first prefill chunks by far, and that must not pad every later plan."""
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(30):
        shape = BatchShape(decode_contexts=(rng.randint(16, 64),), num_sampled=1)
        model.observe(shape, true_time(shape))
    for _ in range(200):  # then chunks arrive, exactly as the machine times them
        shape = random_shape(rng)
        model.observe(shape, true_time(shape))
    assert model.margin < 1.02


def test_fit_learns_the_jump_past_small_steps():
    """Steps past the fused path's size pay a fixed cost more (a jump of 10 ms at 32 tokens):
    the fit predicts both sides of it, where tokens alone would smear it over every size."""
    rng = random.Random(2)
    jump = lambda s: true_time(s) + (0.010 if s.num_tokens >= SMALL_STEP_TOKENS else 0.0)
    model = StepCostModel()
    for _ in range(600):
        shape = random_shape(rng)
        model.observe(shape, jump(shape) * rng.uniform(0.98, 1.02))
    for n in (SMALL_STEP_TOKENS - 8, SMALL_STEP_TOKENS - 1, SMALL_STEP_TOKENS, SMALL_STEP_TOKENS + 8):
        probe = BatchShape(((n - 4, 300),), (500,) * 4, 4)
        assert model.predict(probe) == pytest.approx(jump(probe), rel=0.05)


def test_fit_follows_a_machine_that_slows_down():
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, true_time(shape))
    for _ in range(1500):  # the machine is now 30% slower (another process, thermal limits)
        shape = random_shape(rng)
        model.observe(shape, 1.3 * true_time(shape))
    probe = BatchShape(((256, 512),), (700,) * 10, 10)
    assert model.predict(probe) == pytest.approx(1.3 * true_time(probe), rel=0.03)


def test_seeded_model_predicts_before_any_step():
    model = StepCostModel()
    shapes = [random_shape(random.Random(i)) for i in range(200)]
    model.seed(true_time, shapes)
    probe = BatchShape(((128, 0),), (300,) * 5, 5)
    assert model.predict(probe) == pytest.approx(true_time(probe), rel=0.03)
    assert model.trusted_tokens() >= 2 * max(s.num_tokens for s in shapes)


def test_an_empty_model_trusts_only_small_batches():
    model = StepCostModel()
    assert model.predict(BatchShape(((512, 0),))) == 0.0
    assert model.trusted_tokens() == 64
    model.observe(BatchShape(((100, 0),)), 0.05)
    assert model.trusted_tokens() == 200


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(st.lists(st.floats(0, 10), min_size=3, max_size=3), min_size=3, max_size=20),
       st.lists(st.floats(-5, 5), min_size=20, max_size=20))
def test_nonnegative_least_squares_is_nonnegative_and_no_worse_than_zero(rows, ys):
    ys = ys[:len(rows)]
    a, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    ata, atb = a.T @ a, a.T @ y
    for start in (None, [0], [1, 2]):  # a refit starts from the last fit's nonzero weights
        w = np.array(nonnegative_least_squares(ata, atb, 1e-9, start))
        assert all(w >= 0)
        loss = float(np.sum((a @ w - y) ** 2))
        assert loss <= float(y @ y) + 1e-6
        # Optimal (the KKT conditions): no weight could move to lower the loss.
        gradient = atb - (ata + 1e-9 * np.eye(3)) @ w
        tol = 1e-6 * (1 + np.abs(atb).max())
        assert np.all(gradient[w == 0] <= tol) and np.all(np.abs(gradient[w > 0]) <= tol)


def test_features_grow_with_a_chunk():
    base = BatchShape((), (500,) * 8, 8)
    prev = features(base.with_chunk(1, 300))
    for n in range(2, 400, 7):
        cur = features(base.with_chunk(n, 300))
        assert all(c >= p for c, p in zip(cur, prev)) and len(cur) == len(FEATURES)
        prev = cur


def test_chunk_sizes_snap_on_a_staircase_and_not_on_a_line():
    stairs = ChunkSizes.from_sweep([(n, 0.4 * -(-n // 128)) for n in range(8, 1025, 8)])
    assert stairs.snap(300) == 256  # 300 tokens cost as much as 384
    assert stairs.snap(256) == 256 and stairs.snap(384) == 384
    assert stairs.snap(130) == 128
    assert stairs.snap(180) == 180  # 128 would lose more than the allowed 25% of the chunk
    line = ChunkSizes.from_sweep([(n, 0.01 + 2.7e-4 * n) for n in (1, 16, 64, 128, 256, 512, 1024)])
    assert line.slow_sizes() == []
    assert all(line.snap(n) == n for n in range(1, 1100, 13))


def test_the_margin_comes_from_long_steps_when_there_are_enough():
    """Short steps jitter by a larger share of their time than long ones; a margin for plans
    near a target is taken from steps near it."""
    rng = random.Random(4)
    model = StepCostModel(margin_from=0.1)
    for i in range(400):
        if i % 2:
            shape = BatchShape(((rng.randint(300, 500), 0),), (300,) * 4, 4)  # ~0.1-0.15 s
            seconds = true_time(shape) * rng.uniform(0.99, 1.01)
        else:
            shape = BatchShape(((rng.randint(1, 8), 0),), (rng.randint(16, 64),), 1)  # ~8 ms
            seconds = true_time(shape) * rng.uniform(1.0, 1.8)  # a few ms of wake-up latency
        model.observe(shape, seconds)
    planned = BatchShape(((400, 0),), (300,) * 4, 4)
    assert model.margin_for(planned) < 1.05
    model.margin_from = 0.0
    model.refit()
    assert model.margin_for(planned) > 1.3


def test_steps_with_and_without_a_chunk_get_their_own_margin():
    """A few chunk steps among many decode steps hold under 1% of the token gaps, so a margin
    over all steps leaves out their overruns, and those steps are the longest gaps of all: each
    kind's plans get the margin of its own kind's steps."""
    rng = random.Random(6)
    model = StepCostModel()
    for i in range(600):
        if i % 30 == 0:  # chunk steps beside one decode, running up to 40% over
            shape = BatchShape(((rng.randint(100, 400), 0),), (200,), 1)
            seconds = true_time(shape) * rng.uniform(1.0, 1.4)
        else:
            shape = BatchShape(decode_contexts=(200,) * rng.randint(1, 16), num_sampled=1)
            seconds = true_time(shape) * rng.uniform(0.99, 1.01)
        model.observe(shape, seconds)
    with_chunk = BatchShape(((300, 0),), (200,), 1)
    decodes = BatchShape(decode_contexts=(200,) * 8, num_sampled=8)
    assert model.upper(decodes) < 1.05 * true_time(decodes)
    assert model.upper(with_chunk) > 1.25 * true_time(with_chunk)
    assert model.margin == model.margin_for(with_chunk)


def test_predictions_follow_the_host_speed_within_a_few_steps():
    """A shared host's speed drifts by 10% over minutes (BENCHMARKS.md "Simulator fidelity"); the
    weights, which remember ~500 steps, follow slowly, and the recent steps' median ratio follows
    within SPEED_STEPS (chunk steps: half as many), each kind on its own."""
    rng = random.Random(7)
    model = StepCostModel()
    for i in range(600):
        slow = 1.15 if i >= 560 else 1.0
        if i % 4 == 0:
            shape = BatchShape(((rng.randint(100, 400), 0),), (200,) * 2, 2)
        else:
            shape = BatchShape(decode_contexts=(rng.randint(100, 300),) * rng.randint(1, 16), num_sampled=1)
        model.observe(shape, true_time(shape) * slow * rng.uniform(0.99, 1.01))
    for shape in (BatchShape(((300, 0),), (200,) * 2, 2), BatchShape(decode_contexts=(200,) * 8, num_sampled=8)):
        assert model.predict(shape) == pytest.approx(1.15 * true_time(shape), rel=0.03)


def test_the_margin_counts_a_step_once_per_stream_it_delays():
    """A P99 TBT is over token gaps: a step of 40 decodes that runs over its plan delays 40
    streams. Here one step in 128 is such a step, under the 1% a quantile over steps leaves out,
    but it holds 19% of the token gaps, so the margin must cover it."""
    rng = random.Random(5)
    model = StepCostModel()
    for i in range(512):
        if i % 64 == 0:  # crowded steps, every other one 10% slower than the rest
            shape = BatchShape(((rng.randint(300, 500), 0),), (400,) * 40, 40)
            seconds = true_time(shape) * (1.1 if i % 128 == 0 else 1.0)
        else:
            shape = BatchShape(((rng.randint(300, 500), 0),), (400,), 1)
            seconds = true_time(shape)
        model.observe(shape, seconds)
    assert model.margin > 1.03  # the slow crowded steps' ratio, against a fit between the two kinds


def test_short_steps_refit_once_per_tenth_of_a_second():
    """A refit waits for refit_every steps and refit_seconds of them: 5 ms steps refit every 20th,
    30 ms ones every 4th (what a solve costs stays near 1% of the steps' time)."""
    for seconds, every in ((0.005, 20), (0.030, 4)):
        model, refits = StepCostModel(), []
        model.refit = lambda refit=model.refit: (refits.append(model.num_observations), refit())[1]
        shape = BatchShape(decode_contexts=(200,), num_sampled=1)
        for _ in range(8 + 5 * every):
            model.observe(shape, seconds)
        steady = [n for n in refits if n > 8]
        assert len(steady) == 5 and all(b - a == every for a, b in zip(steady, steady[1:]))

"""`carpool fidelity`'s column that follows the host's speed (the run itself: tests/sim/test_profile.py)."""

import pytest
from hypothesis import given, settings, strategies as st

from carpool.core.step_cost import SPEED_STEPS, BatchShape
from carpool.sim.cost_model import FormulaCostModel
from carpool.sim.fidelity import AtRunSpeed, speed_followed

DECODE = BatchShape(decode_contexts=(100,), num_sampled=1)
CHUNK = BatchShape(prefills=((256, 0),), num_sampled=1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=120), st.floats(0.5, 2.0), st.floats(0.5, 2.0),
       st.integers(0, 119))
def test_a_speed_change_is_followed_within_its_kinds_window(kinds, before, after, change):
    """The host runs `before` times the prediction, then `after` from step `change`: once a
    kind's last window holds only steps at the new speed, its predictions are exact; until a
    kind has 4 steps, the profile's own."""
    shapes = [CHUNK if k else DECODE for k in kinds]
    predicted = [0.01 * (3 if k else 1) for k in kinds]
    speeds = [before if i < change else after for i in range(len(kinds))]
    measured = [p * v for p, v in zip(predicted, speeds)]
    out = speed_followed(predicted, measured, shapes)
    for i, kind in enumerate(kinds):
        earlier = [j for j in range(i) if kinds[j] == kind]
        window = earlier[-(SPEED_STEPS // 2 if kind else SPEED_STEPS):]
        if len(window) < 4:
            assert out[i] == predicted[i]
        elif all(speeds[j] == speeds[window[0]] for j in window):
            assert abs(out[i] - predicted[i] * speeds[window[0]]) <= 1e-12
        else:  # a median of two speeds lies between them
            assert min(before, after) * predicted[i] - 1e-12 <= out[i] <= max(before, after) * predicted[i] + 1e-12


def test_a_step_never_sees_its_own_time():
    shapes, predicted = [DECODE] * 10, [1.0] * 10
    measured = [1.0] * 9 + [100.0]
    assert speed_followed(predicted, measured, shapes)[-1] == 1.0


def test_a_run_speed_scales_each_kind_by_its_own_median():
    cost = FormulaCostModel(fixed=0.01, per_token=0.001)
    shapes = [DECODE, CHUNK, DECODE, CHUNK, DECODE]
    predicted = [cost.stage_time(sh, 0) for sh in shapes]
    speeds = [0.9, 1.2, 0.8, 1.3, 1.0]  # decodes' median 0.9, chunks' 1.25
    at_speed = AtRunSpeed.of_run(cost, predicted, [p * v for p, v in zip(predicted, speeds)], shapes)
    assert at_speed.stage_time(DECODE, 0) == pytest.approx(0.9 * cost.stage_time(DECODE, 0))
    assert at_speed.stage_time(CHUNK, 0) == pytest.approx(1.25 * cost.stage_time(CHUNK, 0))

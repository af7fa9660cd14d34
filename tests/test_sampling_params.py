"""SamplingParams validation: each bad value raises a ValueError that names its field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers import examples

BAD = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("max_tokens", "8"),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("temperature", -0.1),
    ("temperature", -1e-9),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", 2),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", -100),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -3),
    ("frequency_penalty", math.nan),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("seed", 1.5),
    ("seed", "7"),
    ("stop", 5),
    ("stop", ["ok", 3]),
    ("stop", [None]),
    ("stop", {"a": 1}),
    ("stop", ""),
    ("stop", ["a", ""]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    # Values that would turn sampling into NaNs or noise, or slow every step down.
    ("temperature", math.inf),
    ("temperature", 1e30),
    ("temperature", 100.5),
    ("repetition_penalty", 1e-45),
    ("repetition_penalty", 1e30),
    ("repetition_penalty", math.inf),
    ("presence_penalty", math.inf),
    ("top_p", math.inf),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("stop", ["x"] * 33),
    ("stop", ["y" * 257]),
    ("stop_token_ids", list(range(257))),
    ("output_kind", "final"),
    ("logprobs", -2),
    ("prompt_logprobs", -2),
    ("spaces_between_special_tokens", "no"),
    ("extra_args", ["not", "a", "dict"]),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_raises_naming_field(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    # "stop" is a prefix of "stop_token_ids"; check the message names the right one.
    msg = str(exc.value)
    assert field in msg
    if field == "stop":
        assert "stop_token_ids" not in msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_defaults_are_valid():
    sp = SamplingParams()
    assert sp.max_tokens == 16 and sp.min_tokens == 0
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == -1 and sp.min_p == 0.0
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.logprobs is None and sp.seed is None
    assert not sp.greedy and not sp.has_penalties


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1),
    dict(temperature=0.0),
    dict(top_p=1.0), dict(top_p=1e-6),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=50_000),
    dict(min_p=0.0), dict(min_p=1.0),
    dict(repetition_penalty=0.01), dict(repetition_penalty=100.0), dict(temperature=100.0),
    dict(presence_penalty=-2.0), dict(presence_penalty=2.0),
    dict(frequency_penalty=-2), dict(frequency_penalty=2),
    dict(logprobs=0), dict(logprobs=20),
    dict(seed=0), dict(seed=-5), dict(seed=2**63 - 1), dict(seed=-(2**63)),
    dict(stop_token_ids=[0, 5]), dict(stop_token_ids=list(range(256))),
    dict(stop=["s" * 256] * 32), dict(output_kind="delta"),
    dict(logprobs=-1), dict(prompt_logprobs=-1), dict(output_kind="final_only"),
    dict(spaces_between_special_tokens=False), dict(extra_args={"tag": [1, 2]}),
])
def test_boundary_values_are_accepted(kwargs):
    sp = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(sp, k) == v


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    sp = SamplingParams(stop=("a", "bc"))
    assert sp.stop == ["a", "bc"] and isinstance(sp.stop, list)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(top_k=1, temperature=0.8).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


@settings(max_examples=examples(100), deadline=None)
@given(
    max_tokens=st.integers(-5, 50),
    min_tokens=st.integers(-5, 60),
    temperature=st.floats(-2, 5, allow_nan=False),  # the cap (100) is tested above
    top_p=st.floats(-0.5, 1.5, allow_nan=False),
    top_k=st.integers(-5, 100),
    logprobs=st.one_of(st.none(), st.integers(-3, 25)),
)
def test_validation_accepts_exactly_the_valid_region(max_tokens, min_tokens, temperature, top_p, top_k, logprobs):
    valid = (max_tokens >= 1 and 0 <= min_tokens <= max_tokens and temperature >= 0
             and 0 < top_p <= 1 and top_k >= -1 and (logprobs is None or -1 <= logprobs <= 20))
    kwargs = dict(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p,
                  top_k=top_k, logprobs=logprobs)
    if valid:
        SamplingParams(**kwargs)
    else:
        with pytest.raises(ValueError) as exc:
            SamplingParams(**kwargs)
        # The error names one of the fields that is actually out of range.
        bad = {f for f, ok in [("max_tokens", max_tokens >= 1),
                               ("min_tokens", max_tokens < 1 or 0 <= min_tokens <= max_tokens),
                               ("temperature", temperature >= 0), ("top_p", 0 < top_p <= 1),
                               ("top_k", top_k >= -1),
                               ("logprobs", logprobs is None or -1 <= logprobs <= 20)] if not ok}
        msg = str(exc.value)
        assert any(f in msg for f in bad), (msg, bad)


def test_output_kind_is_vllms_enum():
    for kind in (RequestOutputKind.DELTA, "delta"):
        assert SamplingParams(output_kind=kind).output_kind is RequestOutputKind.DELTA
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == "final_only"
    assert [k.name for k in RequestOutputKind] == ["CUMULATIVE", "DELTA", "FINAL_ONLY"]


def test_clone_is_a_deep_copy():
    sp = SamplingParams(stop=["a"], logit_bias={5: 1.0}, extra_args={"tags": ["x"]}, seed=7)
    copy = sp.clone()
    assert copy == sp and copy is not sp
    copy.stop.append("b")
    copy.logit_bias[6] = 2.0
    copy.extra_args["tags"].append("y")
    assert sp.stop == ["a"] and sp.logit_bias == {5: 1.0} and sp.extra_args == {"tags": ["x"]}


def test_extra_args_are_carried_untouched():
    extra = {"anything": object()}
    assert SamplingParams(extra_args=extra).extra_args is extra
    assert SamplingParams().extra_args is None

"""A request's record of its drafts: what it learns from each verification, and what it predicts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.spec.acceptance import MIN_REACH, PROBE_EVERY, RATE, SpecState, next_draft_kept, reachable
from tests.helpers import examples


def test_the_first_draft_and_the_ones_after_a_kept_one_are_learnt_apart():
    spec = SpecState(acceptance=0.5, continuation=0.5)
    spec.observe(5, 5)  # all kept: first kept, four continuations kept
    assert spec.acceptance == 0.5 + RATE * 0.5
    c = 0.5
    for _ in range(4):
        c += RATE * (1 - c)
    assert spec.continuation == pytest.approx(c)
    before = spec.continuation
    spec.observe(5, 0)  # the first rejected: nothing is known about the rest
    assert spec.acceptance == pytest.approx((0.5 + RATE * 0.5) * (1 - RATE)) and spec.continuation == before
    spec.observe(3, 2)  # first kept, second kept, third rejected
    after = (before + RATE * (1 - before)) * (1 - RATE)
    assert spec.continuation == pytest.approx(after)
    spec.observe(0, 0)  # a step without drafts says nothing
    assert spec.continuation == pytest.approx(after)


def test_the_token_after_the_scored_drafts_judges_the_first_unscored_one():
    proposal = [5, 6, 7]
    assert next_draft_kept(proposal, 1, 1, last_token=6) is True  # draft 5 kept, then 6 sampled
    assert next_draft_kept(proposal, 1, 1, last_token=9) is False
    assert next_draft_kept(proposal, 0, 0, last_token=5) is True  # none scored: the first draft
    assert next_draft_kept(proposal, 2, 1, last_token=7) is None  # a scored one failed: unknown
    assert next_draft_kept(proposal, 3, 3, last_token=8) is None  # nothing was left unscored
    spec = SpecState(acceptance=0.5, continuation=0.5)
    spec.observe(1, 1, next_kept=True)  # one draft scored and kept: the second would have been
    assert spec.acceptance == 0.5 + RATE * 0.5 and spec.continuation == 0.5 + RATE * 0.5
    spec.observe(0, 0, next_kept=False)  # an unscored proposal teaches the first draft's rate
    assert spec.acceptance == pytest.approx((0.5 + RATE * 0.5) * (1 - RATE))
    spec.observe(2, 1, next_kept=True)  # ignored: verification stopped before the proposal's end
    assert spec.continuation == pytest.approx((0.5 + RATE * 0.5) * (1 - RATE))


def test_a_request_scored_one_draft_a_step_learns_that_its_copies_go_on():
    """Steps that score only each request's first draft (a busy batch) still raise the later
    drafts' price when the copies go on, so a later step takes more of them."""
    spec = SpecState()
    for _ in range(10):
        spec.observe(1, 1, next_kept=True)
    assert spec.continuation > 0.95 and reachable(spec, 5) == 5


def test_copied_text_prices_later_drafts_above_one_rate_for_all():
    """A request whose copies, once started, go on: its fifth draft is still likely."""
    spec = SpecState()
    for _ in range(12):
        spec.observe(5, 5)
        spec.observe(5, 0)  # alternately: a copy run, then an edit point
    assert spec.continuation > 0.95 and 0.3 < spec.acceptance < 0.7
    assert spec.keep_chance(4) > spec.acceptance ** 5 * 2
    assert reachable(spec, 5) == 5  # one rate for all (a^5 < 0.1) would have stopped at one or two


@settings(max_examples=examples(100), deadline=None)
@given(verifications=st.lists(st.integers(0, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
                              max_size=40),
       limit=st.integers(0, 10))
def test_the_record_stays_a_probability_and_reachable_is_the_run_above_min_reach(verifications, limit):
    spec = SpecState()
    for n, k in verifications:
        spec.observe(n, k)
        assert 0.0 <= spec.acceptance <= 1.0 and 0.0 <= spec.continuation <= 1.0
    chances = [spec.keep_chance(j) for j in range(limit)]
    assert all(a >= b for a, b in zip(chances, chances[1:]))  # a later draft is never likelier
    k = reachable(spec, limit)
    assert all(c >= MIN_REACH for c in chances[:k]) and (k == limit or chances[k] < MIN_REACH)


def test_a_request_whose_first_drafts_fail_asks_for_one_probe_every_few_steps():
    spec = SpecState()
    for _ in range(6):
        spec.observe(5, 0)
    assert spec.acceptance < MIN_REACH
    asks = [spec.draft_limit(5) for _ in range(3 * PROBE_EVERY)]
    assert asks.count(1) == 3 and set(asks) == {0, 1}

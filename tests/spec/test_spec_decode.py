"""Speculative decoding in the engine: the same tokens as without it, for greedy and seeded
sampling, through chunked prefill, preemption and the prefix cache; every block freed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.request import RequestStatus
from carpool.sampling_params import SamplingParams
from carpool.spec.acceptance import PRIOR
from tests.helpers import examples, nan_in_unwritten_blocks, scheduler_config
from tests.spec.helpers import speculating

# Prompts whose continuations repeat what they have seen, so that n-gram drafts get accepted.
REPEATING = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
    "Once upon a time",
]


def generate(engine, prompts, params: SamplingParams | list[SamplingParams]):
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    return reqs


def outputs(reqs):
    return [(r.output_token_ids, r.status, r.stop_reason) for r in reqs]


def both_ways(engine, prompts, params, k: int = 4):
    """Outputs without speculation, then with it (and the spec counters of that run)."""
    off = outputs(generate(engine, prompts, params))
    with speculating(engine, k):
        on = outputs(generate(engine, prompts, params))
        stats = engine.spec_stats
    return off, on, stats


def test_greedy_equals_no_speculation_with_chunked_prefill(engine_fp32):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with scheduler_config(engine_fp32, budget=24), nan_in_unwritten_blocks(engine_fp32):
        off, on, stats = both_ways(engine_fp32, REPEATING, sp)
        assert engine_fp32.block_manager.holders() == {}
    assert on == off
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:]))


@pytest.mark.slow  # ~10 s; the property test below also runs with a 12-block KV cache
def test_greedy_equals_no_speculation_through_preemption(engine_fp32):
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    with scheduler_config(engine_fp32, budget=64, num_blocks=14) as engine:
        off, on, _ = both_ways(engine, REPEATING, sp)
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.holders() == {}
    assert on == off


def test_greedy_equals_no_speculation_with_prefix_cache_hits(engine_fp32):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = REPEATING[1] * 3
    with scheduler_config(engine_fp32, prefix_caching=True) as engine:
        off = outputs(generate(engine, [prompt], sp))
        with speculating(engine, 5):
            first = outputs(generate(engine, [prompt], sp))
            again = generate(engine, [prompt], sp)
        assert again[0].num_cached_tokens > 0
        assert first == off and outputs(again) == off


def test_seeded_sampling_penalties_logprobs_and_stops_equal_no_speculation(engine_fp32):
    """The request's generator draws once per output token with or without drafts, and every
    position is sampled with the tokens before it in place (penalties, stop strings)."""
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=7, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=1, repetition_penalty=1.3,
                             frequency_penalty=0.2, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, stop=["7, 8"], ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, min_tokens=5, ignore_eos=False)]
    prompts = [REPEATING[0], REPEATING[2], REPEATING[0], REPEATING[1]]
    off_reqs = generate(engine_fp32, prompts, params)
    with speculating(engine_fp32, 4):
        on_reqs = generate(engine_fp32, prompts, params)
        assert engine_fp32.spec_stats.num_accepted_tokens > 0
    assert outputs(on_reqs) == outputs(off_reqs)
    assert on_reqs[2].status is RequestStatus.FINISHED_STOPPED and on_reqs[2].stop_reason == "7, 8"
    for a, b in zip(on_reqs[0].output_logprobs, off_reqs[0].output_logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)


def test_grammar_constrained_requests_do_not_speculate(engine_fp32):
    sp = SamplingParams(max_tokens=20, temperature=0, structured_outputs={"regex": "(ab)+"})
    with speculating(engine_fp32, 4):
        req, = generate(engine_fp32, ["abababababab"], sp)
        assert engine_fp32.spec_stats.num_draft_tokens == 0
    assert set(req.output_token_ids) and req.status.finished


@settings(max_examples=examples(12))
@given(data=st.data())
def test_random_requests_match_no_speculation_and_free_every_block(engine_fp32, data):
    n = data.draw(st.integers(1, 4))
    prompts = data.draw(st.lists(st.sampled_from(REPEATING), min_size=n, max_size=n))
    params = [SamplingParams(max_tokens=data.draw(st.integers(1, 24)), temperature=0,
                             ignore_eos=data.draw(st.booleans()),
                             stop=data.draw(st.sampled_from([[], ["mat"], [", 5"], ["a + b"]])))
              for _ in prompts]
    budget = data.draw(st.sampled_from([8, 17, 64, 512]))
    k = data.draw(st.integers(1, 6))
    with scheduler_config(engine_fp32, budget=budget, num_blocks=data.draw(st.sampled_from([12, 40]))) as engine:
        off, on, _ = both_ways(engine, prompts, params, k)
        assert engine.block_manager.holders() == {}
    assert on == off
    for (tokens, _, _), sp in zip(on, params):
        assert len(tokens) <= sp.max_tokens


def test_suffix_drafts_from_earlier_outputs_keep_greedy_outputs(engine_fp32):
    """Suffix decoding drafts from the outputs of requests that finished before: asked again,
    the same prompts find their continuations in the tree, and the outputs stay the same."""
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "Write a haiku about the sea."]
    off = outputs(generate(engine_fp32, prompts, sp))
    with speculating(engine_fp32, 4, method="suffix") as engine:
        first = outputs(generate(engine, prompts, sp))
        accepted_first = engine.spec_stats.num_accepted_tokens
        again = outputs(generate(engine, prompts, sp))
        accepted_again = engine.spec_stats.num_accepted_tokens - accepted_first
        assert engine.block_manager.holders() == {}
    assert first == off and again == off
    assert accepted_again > accepted_first and accepted_again >= len(prompts) * 12


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_unsupported_methods_are_refused_by_name(engine_fp32, method):
    from carpool.config import SpeculativeConfig

    with pytest.raises(ValueError, match=method):
        SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 3})


def test_a_request_priced_out_of_drafts_still_learns_from_its_proposals(engine_fp32, monkeypatch):
    """Under load the scheduler may score none of a request's drafts; its record then follows
    its proposals' first tokens against what was sampled, so it can earn drafts back."""
    monkeypatch.setattr(engine_fp32.scheduler, "schedule_drafts", lambda batch: None)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with speculating(engine_fp32, 4):
        req, = generate(engine_fp32, [REPEATING[0]], sp)
        assert engine_fp32.spec_stats.num_draft_tokens == 0
    assert req.spec is not None and req.spec.acceptance > PRIOR  # the count goes on: its proposals were right
    assert req.spec.continuation == PRIOR  # nothing scored, nothing known past the first draft


def test_a_request_scored_one_draft_a_step_learns_the_price_of_the_next(engine_fp32, monkeypatch):
    """A step that scores only the first draft of each proposal and keeps it also samples the
    token after it: the record counts that against the proposal's second draft, so the later
    drafts' price follows the text (a copy goes on) and not the prior alone."""
    schedule_drafts = engine_fp32.scheduler.schedule_drafts

    def first_draft_only(batch):
        schedule_drafts(batch)
        for i, drafts in enumerate(batch.drafts):
            batch.set_drafts(i, drafts[:1])

    monkeypatch.setattr(engine_fp32.scheduler, "schedule_drafts", first_draft_only)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with speculating(engine_fp32, 4):
        req, = generate(engine_fp32, [REPEATING[0]], sp)
        stats = engine_fp32.spec_stats
        assert stats.num_draft_tokens == stats.num_drafts > 0  # one draft per verification
    assert req.spec is not None and req.spec.continuation > PRIOR  # its copies went on

"""Prompt logprobs: every prompt token after the first is scored once, during prefill chunks,
whatever the budget, preemptions or prefix cache; the scores equal transformers'."""

from __future__ import annotations

import math

import pytest
import torch

from carpool.llm import LLM
from carpool.sampling_params import SamplingParams
from tests.helpers import scheduler_config

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " The capital of France is Paris, a city on the Seine."


def score(engine, prompt_ids: list[int], num_top: int = 0):
    req = engine.add_request(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=num_top))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(req.prompt_logprobs) == len(prompt_ids)
    return [o for o in outputs if o.request_id == req.request_id][-1].prompt_logprobs


@pytest.fixture(scope="module")
def long_prompt(engine_fp32):
    text = " ".join(f"Item {i}: the {i % 7}th colour of a list of things to remember." for i in range(12))
    return engine_fp32.tokenizer.encode(text + CONTEXT + CONTINUATION)


def test_continuation_loglikelihood_equals_transformers(engine_fp32, hf_model, long_prompt):
    """What lm-evaluation-harness sums for a loglikelihood task, with the prompt in 32-token chunks."""
    num_context = len(engine_fp32.tokenizer.encode(CONTEXT + CONTINUATION)) - 8
    with scheduler_config(engine_fp32, budget=32):
        lps = score(engine_fp32, long_prompt)
    assert len(long_prompt) > 3 * 32 and lps[0] is None
    with torch.no_grad():
        ref = hf_model(torch.tensor([long_prompt])).logits[0].float().log_softmax(-1)
    ids = torch.tensor(long_prompt)
    ref_tokens = ref[:-1].gather(1, ids[1:, None])[:, 0]
    ours = torch.tensor([lps[i][t].logprob for i, t in enumerate(long_prompt) if i > 0])
    torch.testing.assert_close(ours, ref_tokens, atol=2e-4, rtol=1e-4)
    cont = slice(len(long_prompt) - num_context, None)
    assert math.isclose(ours[cont.start - 1:].sum().item(), ref_tokens[cont.start - 1:].sum().item(),
                        abs_tol=1e-3)


def test_ranks_and_top_alternatives(engine_fp32, long_prompt):
    lps = score(engine_fp32, long_prompt[:40], num_top=3)
    for i, entry in enumerate(lps[1:], 1):
        token = entry[long_prompt[i]]
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3] and token.decoded_token is not None
        assert [lp.logprob for lp in top] == sorted((lp.logprob for lp in top), reverse=True)
        assert token.rank == 1 + sum(lp.logprob > token.logprob for lp in top) or token.rank > 3


@pytest.mark.parametrize("budget, num_blocks", [(64, 20), *(pytest.param(*p, marks=pytest.mark.slow) for p in [(16, None), (512, None)])])
def test_same_scores_under_any_budget_preemption_and_cache(engine_fp32, long_prompt, budget, num_blocks):
    """Chunks of 16, whole prompts, and a KV cache so small that requests are preempted (their
    recomputed positions must not be scored twice); a cached prefix must not skip scoring."""
    reference = score(engine_fp32, long_prompt)
    assert len(long_prompt) + 24 <= 20 * 16  # fits 20 blocks alone, not beside the others
    others = [long_prompt[:50] + [t] for t in range(100, 104)]
    with scheduler_config(engine_fp32, budget=budget, num_blocks=num_blocks, prefix_caching=True) as engine:
        score(engine, long_prompt)  # now the whole prompt is cached
        before = engine.scheduler.num_preemptions
        reqs = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                     prompt_logprobs=0)) for p in [long_prompt, *others]]
        while engine.has_unfinished_requests():
            engine.step()
        preempted = engine.scheduler.num_preemptions - before
    assert (preempted > 0) == (num_blocks is not None)
    got = reqs[0].prompt_logprobs
    assert len(got) == len(long_prompt) and got[0] is None
    for mine, ref in zip(got[1:], reference[1:]):
        (t, lp), = mine.items()
        assert math.isclose(lp.logprob, ref[t].logprob, abs_tol=1e-4)
    for req, prompt in zip(reqs[1:], others):
        assert [next(iter(e)) for e in req.prompt_logprobs[1:]] == prompt[1:]


def test_delta_stream_carries_prompt_logprobs_once(engine_fp32, long_prompt):
    req = engine_fp32.add_request(long_prompt[:20], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                                   prompt_logprobs=1, output_kind="delta"))
    seen = []
    while engine_fp32.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine_fp32.step() if o.request_id == req.request_id]
    assert len(seen) == 4 and len(seen[0]) == 20 and seen[1:] == [None] * 3


def test_llm_generate_with_n_scores_the_prompt(engine_fp32, long_prompt):
    llm = LLM.__new__(LLM)  # reuse the loaded engine
    llm.llm_engine, llm.tokenizer = engine_fp32, engine_fp32.tokenizer
    out = llm.generate([long_prompt[:12]], SamplingParams(n=2, max_tokens=2, prompt_logprobs=0))[0]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == 12


@pytest.mark.parametrize("value", [-2, 21, True, 1.5])  # -1 is the whole vocabulary, as in vLLM
def test_bad_prompt_logprobs_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)

"""Sampling with drafts keeps the target's distribution: a chi-square test over a three-token
vocabulary (allowed_token_ids), against the model's own conditional probabilities."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from carpool.harness.synthetic import SyntheticBatches
from carpool.sampling_params import SamplingParams
from tests.spec.helpers import speculating

TEMPERATURE = 2.0  # flatter than the model's own, so that every outcome is seen often enough
NUM_SAMPLES = 600


def next_token_probs(engine, ids: list[int], allowed: list[int]) -> torch.Tensor:
    manual = SyntheticBatches(engine)
    try:
        r = manual.new(ids)
        logits = manual.run([(r, len(ids))])[0].float()
    finally:
        manual.close()
    return (logits[allowed] / TEMPERATURE).softmax(-1)


@pytest.mark.slow  # 600 requests through the fp32 model: ~1 min on 2 idle cores
def test_sampled_outputs_keep_the_target_distribution(engine_fp32):
    tok = engine_fp32.tokenizer
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" a", " b", " c")]
    assert len(set(allowed)) == 3
    prompt = tok.encode(" a b c" * 6, add_special_tokens=False)
    sp = SamplingParams(max_tokens=3, temperature=TEMPERATURE, allowed_token_ids=allowed, ignore_eos=True)
    with speculating(engine_fp32, 2):
        reqs = [engine_fp32.add_request(prompt, sp) for _ in range(NUM_SAMPLES)]
        while engine_fp32.has_unfinished_requests():
            engine_fp32.step()
        stats = engine_fp32.spec_stats
    # The n-gram drafts (the pattern's next letter) were scored and some kept: the third token
    # then came from the second row of a verification step.
    assert stats.num_accepted_tokens > NUM_SAMPLES // 10
    observed = Counter(tuple(r.output_token_ids) for r in reqs)

    outcomes, expected = [], []
    p0 = next_token_probs(engine_fp32, prompt, allowed)
    for i, a in enumerate(allowed):
        p1 = next_token_probs(engine_fp32, prompt + [a], allowed)
        for j, b in enumerate(allowed):
            p2 = next_token_probs(engine_fp32, prompt + [a, b], allowed)
            for k, c in enumerate(allowed):
                outcomes.append((a, b, c))
                expected.append(float(p0[i] * p1[j] * p2[k]) * NUM_SAMPLES)
    assert sum(observed.values()) == NUM_SAMPLES and set(observed) <= set(outcomes)
    # Cells expected fewer than 5 times are pooled (the chi-square approximation needs it).
    order = sorted(range(len(outcomes)), key=lambda i: expected[i])
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for i in order:
        if expected[i] < 5 or pool_e and pool_e < 5:
            pool_o, pool_e = pool_o + observed[outcomes[i]], pool_e + expected[i]
        else:
            obs.append(observed[outcomes[i]])
            exp.append(expected[i])
    if pool_e:
        obs.append(pool_o)
        exp.append(pool_e)
    assert len(obs) >= 5  # enough cells for the test to have power
    exp = [e * sum(obs) / sum(exp) for e in exp]  # float rounding of the probabilities
    # 1e-4: a correct sampler fails this once in 10,000 runs; sampling from the wrong row or
    # keeping a draft without sampling shifts the third token's law far beyond it.
    assert chisquare(obs, exp).pvalue > 1e-4, list(itertools.zip_longest(obs, exp))

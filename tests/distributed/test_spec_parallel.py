"""Speculative decoding over TP / PP: the single-process engine's outputs without speculation."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.sampling_params import SamplingParams
from tests.distributed.test_equivalence import TINY, single  # noqa: F401 -- the module's fixture
from tests.helpers import run_greedy
from tests.spec.helpers import speculating

# Prompts that repeat a random run of tokens, so the n-gram proposer always has drafts to offer.
PROMPTS = [(np.random.default_rng(n).integers(3, 49152, n).tolist() * 3)[:-1] for n in (4, 9, 15, 30)]
MAX_TOKENS = 16
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=3, ignore_eos=True)


def run_seeded(engine) -> list[list[int]]:
    reqs = [engine.add_request(p, SEEDED) for p in PROMPTS]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_speculation_over_tp_and_pp_keeps_the_outputs(parallel_engine, tiny_llama, single, tp, pp):  # noqa: F811
    greedy, seeded = run_greedy(single, PROMPTS, MAX_TOKENS), run_seeded(single)
    engine = parallel_engine(model=tiny_llama, tensor_parallel_size=tp, pipeline_parallel_size=pp, **TINY)
    with speculating(engine, 3):
        assert run_greedy(engine, PROMPTS, MAX_TOKENS) == greedy
        assert run_seeded(engine) == seeded
        assert engine.spec_stats.num_draft_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

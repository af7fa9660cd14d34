"""The runner picks each step's path by its token count; and it reads only KV it wrote: NaN in
every not-yet-written block changes no output.

The cache is allocated uninitialised and freed blocks keep old KV; attention reads whole blocks
(masked), so a slot read before it is written is harmless only while it holds something finite
(0 x NaN is NaN). `clear_fresh_tails` zeroes the tail of each block a step starts; these tests
poison everything else that holds no KV yet and compare greedy outputs with a clean run.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.model.paths import COMPILE_MIN_TOKENS, FUSED_MAX_TOKENS, Path, choose_path
from carpool.model_runner import ModelRunner
from carpool.sampling_params import SamplingParams
from tests.conftest import PROMPTS
from tests.helpers import examples, nan_in_unwritten_blocks, run_greedy, scheduler_config


def test_paths_by_token_count():
    """Fused up to FUSED_MAX_TOKENS, compiled from COMPILE_MIN_TOKENS, eager where the faster
    path is missing (or the fused one cannot attend the step: fused_max_tokens 0)."""
    assert COMPILE_MIN_TOKENS <= FUSED_MAX_TOKENS + 1  # no size falls between the two
    for n in (1, 8, COMPILE_MIN_TOKENS, FUSED_MAX_TOKENS):
        assert choose_path(n, FUSED_MAX_TOKENS, compiled=True) is Path.FUSED
    for n in (1, COMPILE_MIN_TOKENS - 1):
        assert choose_path(n, 0, compiled=True) is Path.EAGER
    for n in (COMPILE_MIN_TOKENS, FUSED_MAX_TOKENS):
        assert choose_path(n, 0, compiled=True) is Path.COMPILED  # a model the fused path cannot run
    for n in (FUSED_MAX_TOKENS + 1, 512):
        assert choose_path(n, FUSED_MAX_TOKENS, compiled=True) is Path.COMPILED
        assert choose_path(n, FUSED_MAX_TOKENS, compiled=False) is Path.EAGER
    assert choose_path(9, 8, compiled=True) is Path.EAGER  # a fused path built for smaller steps


@pytest.fixture(scope="module")
def pieces(engine_fp32):
    return [engine_fp32.tokenizer.encode(p) for p in PROMPTS]


def generate(engine, prompts, max_tokens, prompt_logprobs=None):
    """Greedy outputs (and prompt logprobs) of the prompts, twice: the second round starts
    from the prefix cache the first one filled."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    outs = []
    for _ in range(2):
        reqs = [engine.add_request(p, sp) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        outs.append([(r.output_token_ids, r.prompt_logprobs) for r in reqs])
    return outs


@settings(max_examples=examples(3), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), budget=st.sampled_from([16, 40]), num_blocks=st.sampled_from([6, 32]),
       decode_kernel=st.booleans(), prompt_logprobs=st.sampled_from([None, 1]))
def test_nan_in_unwritten_blocks_changes_no_output(engine_fp32, pieces, data, budget, num_blocks, decode_kernel,
                                                   prompt_logprobs):
    """Prompts built from shared pieces (prefix-cache hits at block boundaries and inside
    blocks), chunked by a small budget, in a KV cache small enough to evict and preempt
    (6 blocks of 16: 96 tokens), decoded by the C kernel or by SDPA over gathered blocks."""
    piece = st.sampled_from(range(len(pieces)))
    prompts = [sum((pieces[i] for i in ids), [])[:n] for ids, n in data.draw(
        st.lists(st.tuples(st.lists(piece, min_size=1, max_size=3), st.integers(1, 48)), min_size=2, max_size=4))]
    runner = engine_fp32.runner
    saved = runner.decode_kernel
    runner.decode_kernel = decode_kernel and saved
    try:
        with scheduler_config(engine_fp32, budget=budget, num_blocks=num_blocks, prefix_caching=True) as engine:
            clean = generate(engine, prompts, 6, prompt_logprobs)
        with scheduler_config(engine_fp32, budget=budget, num_blocks=num_blocks, prefix_caching=True) as engine:
            with nan_in_unwritten_blocks(engine):
                poisoned = generate(engine, prompts, 6, prompt_logprobs)
    finally:
        runner.decode_kernel = saved
    assert poisoned == clean


def test_the_poison_reaches_a_read_of_an_unzeroed_tail(engine_fp32, pieces, monkeypatch):
    """Without `clear_fresh_tails` the NaN shows, so the test above can fail."""
    with scheduler_config(engine_fp32, budget=16, num_blocks=8) as engine:
        clean = run_greedy(engine, pieces[6:7], 4)
    monkeypatch.setattr(ModelRunner, "clear_fresh_tails", lambda self, plan: None)
    with scheduler_config(engine_fp32, budget=16, num_blocks=8) as engine:
        with nan_in_unwritten_blocks(engine):
            assert run_greedy(engine, pieces[6:7], 4) != clean


def test_the_engines_prefix_cache_is_dropped_after_scheduler_config(engine_fp32, pieces):
    """`scheduler_config` writes the engine's KV blocks through a second block manager; the
    engine's own cached prefixes must not survive it (they would read other tokens' KV)."""
    chat = pieces[6]  # 17 tokens: its first block is cached, and taken by the second run
    want = run_greedy(engine_fp32, [chat], 8)
    with scheduler_config(engine_fp32) as engine, nan_in_unwritten_blocks(engine):
        run_greedy(engine, pieces[:1], 1)  # every block but this request's is NaN now
    assert run_greedy(engine_fp32, [chat], 8) == want


def _config(num_layers: int, sliding: list[int], window: int | None = 512):
    from carpool.config import ModelConfig
    return ModelConfig("Gemma3ForCausalLM", 64, 16, 32, num_layers, 2, 1, 8, 1e-6, 1e4, 4096, True,
                       sliding_window=window, sliding_layers=sliding)


def test_kv_layout_groups_sliding_layers_by_the_global_ones():
    """A block holds the global layers' count of layers; the sliding ones fill window tables of
    that many, in order (Gemma 3 1B: 26 layers, every sixth global; Gemma 2: every other)."""
    from carpool.model_runner import KVLayout
    gemma3 = KVLayout.of(_config(26, [i for i in range(26) if (i + 1) % 6]))
    assert (gemma3.num_slices, gemma3.window_tables, gemma3.window) == (4, 6, 512)
    assert gemma3.tables == (1, 1, 1, 1, 2, 0, 2, 2, 2, 3, 3, 0, 3, 3, 4, 4, 4, 0, 4, 5, 5, 5, 5, 0, 6, 6)
    assert gemma3.slices == (0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 1, 2, 3, 0, 1, 2, 2, 3, 0, 1, 2, 3, 3, 0, 1)
    # each (table, slice) is one layer's own
    assert len(set(zip(gemma3.tables, gemma3.slices))) == 26
    gemma2 = KVLayout.of(_config(4, [0, 2]))
    assert (gemma2.num_slices, gemma2.tables, gemma2.slices) == (2, (1, 0, 1, 0), (0, 0, 1, 1))
    for plain in (_config(4, [0, 1, 2, 3]), _config(4, []), _config(4, [0, 2], window=None)):
        assert KVLayout.of(plain) == KVLayout.plain(4)

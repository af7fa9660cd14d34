"""LLMEngine behaviour on the embedded model: batching, preemption, stops, bad input."""

from __future__ import annotations

import pytest

from carpool.engine import LLMEngine
from carpool.llm import LLM
from carpool.sampling_params import SamplingParams
from tests.helpers import run_greedy, scheduler_config

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def varied_prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts of different lengths (5..~110 tokens)."""
    return [tokenizer.encode(f"Story {i}: " + " ".join(WORDS[j % len(WORDS)] for j in range(3 + 7 * i)))
            for i in range(n)]


@pytest.fixture(scope="module")
def prompts(engine_fp32):
    return varied_prompts(engine_fp32.tokenizer, 16)


ALONE_TOKENS = 8  # greedy tokens per prompt in `alone`, and in every run compared with it


@pytest.fixture(scope="module")
def alone(engine_fp32, prompts):
    return [run_greedy(engine_fp32, [p], ALONE_TOKENS)[0] for p in prompts]


@pytest.mark.parametrize("budget", [32, pytest.param(128, marks=pytest.mark.slow), pytest.param(512, marks=pytest.mark.slow)])
def test_batch_invariance(engine_fp32, prompts, alone, budget):
    with scheduler_config(engine_fp32, budget=budget):
        together = run_greedy(engine_fp32, prompts, ALONE_TOKENS)
        stats = list(engine_fp32.iteration_stats)[-10:]
    assert together == alone
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in stats)
    assert engine_fp32.block_manager.num_free_blocks == engine_fp32.block_manager.num_blocks


def test_preemption_keeps_outputs(engine_fp32, prompts, alone):
    before = engine_fp32.scheduler.num_preemptions
    with scheduler_config(engine_fp32, budget=128, num_blocks=24) as engine:  # 384 tokens for ~1.8k needed
        out = run_greedy(engine, prompts, ALONE_TOKENS)
        preemptions = engine.scheduler.num_preemptions
        assert engine.block_manager.num_free_blocks == 24
    assert out == alone
    assert preemptions > 0
    assert engine_fp32.scheduler.num_preemptions == before


def test_seeded_sampling_is_batch_invariant(engine_fp32, prompts):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    solo = engine_fp32.add_request(prompts[3], sp)
    while engine_fp32.has_unfinished_requests():
        engine_fp32.step()
    crowd = [engine_fp32.add_request(p, SamplingParams(max_tokens=12, temperature=1.0)) for p in prompts[:6]]
    again = engine_fp32.add_request(prompts[3], sp)
    while engine_fp32.has_unfinished_requests():
        engine_fp32.step()
    assert again.output_token_ids == solo.output_token_ids
    assert len(crowd) == 6


def test_stop_conditions(engine_fp32):
    tok = engine_fp32.tokenizer
    prompt = tok.encode("Count: 1, 2, 3, 4, 5,")
    free = run_greedy(engine_fp32, [prompt], 20)[0]
    free_text = tok.decode(free)
    llm_like = engine_fp32
    # A stop string that occurs in the greedy continuation truncates the text before it.
    stop = free_text.strip().split()[2]
    r = llm_like.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, stop=[stop]))
    # A stop token id ends generation and is the stop reason.
    r2 = llm_like.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[free[4]]))
    # min_tokens suppresses the stop token until reached.
    r3 = llm_like.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                     stop_token_ids=[free[0]], min_tokens=3))
    texts = {}
    while llm_like.has_unfinished_requests():
        for o in llm_like.step():
            texts.setdefault(o.request_id, "")
            texts[o.request_id] += o.new_text
            if o.finished:
                texts[o.request_id + "/final"] = o
    final = texts[r.request_id + "/final"]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert stop not in final.text and free_text.startswith(final.text)
    assert texts[r.request_id] == final.text  # the streamed deltas never showed the stop string
    assert r2.stop_reason == free[4] and r2.output_token_ids[-1] == free[4]
    assert len(r2.output_token_ids) == free.index(free[4]) + 1
    assert r3.num_output_tokens >= 3 and r3.output_token_ids[0] != free[0]


def test_max_tokens_and_logprobs(engine_fp32):
    r = engine_fp32.add_request("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))
    outs = []
    while engine_fp32.has_unfinished_requests():
        outs += engine_fp32.step()
    assert r.finish_reason == "length" and r.num_output_tokens == 5
    final = outs[-1]
    assert len(final.logprobs) == 5
    for tok_id, lp in zip(final.token_ids, final.logprobs):
        assert tok_id in lp and 2 <= len(lp) <= 4
        assert lp[tok_id].rank == 1 and lp[tok_id].logprob == max(v.logprob for v in lp.values())  # greedy
        assert lp[tok_id].decoded_token == engine_fp32.tokenizer.decode([tok_id])
    choice = final.outputs[0]  # vLLM's shape
    assert choice.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(choice.token_ids,
                                                                                         choice.logprobs)))
    m = final.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.token_times[0] <= m.token_times[-1] <= m.finished_time


def test_eos_stops_unless_ignored(engine_fp32):
    chat = engine_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                     add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    stopped = engine_fp32.add_request(chat, SamplingParams(max_tokens=64, temperature=0))
    while engine_fp32.has_unfinished_requests():
        engine_fp32.step()
    assert stopped.finish_reason == "stop" and stopped.output_token_ids[-1] in engine_fp32.eos_token_ids
    n = stopped.num_output_tokens
    ignored = engine_fp32.add_request(chat, SamplingParams(max_tokens=n + 3, temperature=0, ignore_eos=True))
    while engine_fp32.has_unfinished_requests():
        engine_fp32.step()
    assert ignored.finish_reason == "length" and ignored.num_output_tokens == n + 3


def test_utf8_streaming_never_splits_characters(engine_fp32):
    prompt = engine_fp32.tokenizer.encode("Emoji and CJK: 🚗🚕🚙 汽车共享 🚗🚕🚙 汽车")
    r = engine_fp32.add_request(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))
    pieces = []
    while engine_fp32.has_unfinished_requests():
        pieces += [o.new_text for o in engine_fp32.step()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == engine_fp32.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)


def test_abort_frees_blocks_and_others_continue(engine_fp32, prompts):
    bm = engine_fp32.block_manager
    idle = bm.num_free_blocks
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with scheduler_config(engine_fp32, budget=32):
        reqs = [engine_fp32.add_request(p, sp) for p in prompts[8:12]]
        for _ in range(3):
            engine_fp32.step()
        assert engine_fp32.abort_request(reqs[0].request_id).finish_reason == "abort"  # running
        assert engine_fp32.abort_request(reqs[3].request_id)  # still waiting
        assert engine_fp32.abort_request("no-such-request") is None
        while engine_fp32.has_unfinished_requests():
            engine_fp32.step()
    assert reqs[0].finish_reason == "abort" and reqs[3].finish_reason == "abort"
    assert reqs[1].num_output_tokens == 8 and reqs[2].num_output_tokens == 8
    assert bm.num_free_blocks == idle


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"), (dict(stop=5), "stop"), (dict(stop=["a", 3]), "stop"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_alone(engine_fp32):
    too_long = [100] * (engine_fp32.max_model_len + 5)
    with pytest.raises(ValueError, match="empty"):
        engine_fp32.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="tokens"):
        engine_fp32.add_request(too_long, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary|token ids"):
        engine_fp32.add_request([10**9], SamplingParams())
    assert not engine_fp32.has_unfinished_requests()
    assert engine_fp32.block_manager.num_free_blocks == engine_fp32.block_manager.num_blocks


@pytest.mark.slow
def test_prompt_larger_than_kv_cache(model_path):
    small = LLM(model_path, dtype="float32", kv_cache_memory=4 * 16 * 2 * 30 * 3 * 64 * 4)  # 4 blocks
    assert small.engine.max_model_len == 64
    outs = small.generate(["hi " * 100, "Hello"], SamplingParams(max_tokens=200, temperature=0), use_tqdm=False)
    assert outs[0].finish_reason == "error" and "KV cache" in outs[0].error
    assert outs[1].finish_reason in ("stop", "length") and outs[1].token_ids
    assert small.engine.block_manager.num_free_blocks == 4


def test_step_exception_fails_batch_and_engine_goes_on(engine_fp32, monkeypatch):
    real = engine_fp32.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(engine_fp32.runner, "execute", flaky)
    bad = engine_fp32.add_request("first", SamplingParams(max_tokens=4))
    outs = engine_fp32.step()
    assert outs[0].finish_reason == "error" and "injected fault" in outs[0].error and bad.is_finished
    good = engine_fp32.add_request("second", SamplingParams(max_tokens=4, ignore_eos=True))
    while engine_fp32.has_unfinished_requests():
        engine_fp32.step()
    assert good.num_output_tokens == 4
    assert engine_fp32.block_manager.num_free_blocks == engine_fp32.block_manager.num_blocks


def test_a_request_that_cannot_be_sampled_fails_alone(engine_fp32, prompts, alone):
    """Sampling parameters that turn its row into NaNs fail that request, not its batch."""
    poisoned = SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)
    poisoned.repetition_penalty = 0.0  # past validation: x / 0 is inf, inf - inf is NaN
    bad = engine_fp32.add_request(prompts[1], poisoned)
    good = engine_fp32.add_request(prompts[0], SamplingParams(max_tokens=ALONE_TOKENS, temperature=0, ignore_eos=True))
    failed = []
    while engine_fp32.has_unfinished_requests():
        failed += [o for o in engine_fp32.step() if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == [bad.request_id] and "sampling failed" in bad.error
    assert good.output_token_ids == alone[0]
    assert engine_fp32.num_consecutive_failed_steps == 0
    assert engine_fp32.block_manager.num_free_blocks == engine_fp32.block_manager.num_blocks


def test_delta_outputs_carry_only_the_new_tokens(engine_fp32, prompts, alone):
    greedy = dict(max_tokens=ALONE_TOKENS, temperature=0, ignore_eos=True)
    cumulative = engine_fp32.add_request(prompts[0], SamplingParams(**greedy))
    delta = engine_fp32.add_request(prompts[0], SamplingParams(**greedy, output_kind="delta"))
    pieces, texts, last_cumulative = [], [], None
    while engine_fp32.has_unfinished_requests():
        for out in engine_fp32.step():
            if out.request_id == delta.request_id:
                assert out.token_ids == out.new_token_ids and len(out.token_ids) <= 1
                pieces += out.token_ids
                texts.append(out.text)
            elif out.request_id == cumulative.request_id:
                last_cumulative = out
    assert pieces == alone[0] == last_cumulative.token_ids
    assert "".join(texts) == last_cumulative.text


def test_llm_chat(engine_fp32, model_path):
    llm = LLM.__new__(LLM)  # reuse the loaded engine
    llm.llm_engine, llm.tokenizer = engine_fp32, engine_fp32.tokenizer
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=24, temperature=0),
                   use_tqdm=False)
    assert "4" in out[0].text


# ------------------------------------------------------------------ prefix caching
def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    """A ~70-token system prompt before different questions, one question twice, and the system
    prompt cut to exactly three blocks (all of it cached, yet its last token is computed)."""
    system = tokenizer.encode("You are a terse assistant who knows the NATO alphabet: " + " ".join(WORDS * 2))
    questions = [tokenizer.encode(f" Question {i}: what follows " + " ".join(WORDS[i:i + 2 + i]) + "?")
                 for i in range(6)]
    return [system + q for q in questions] + [system + questions[2], system[:48]]


def run_requests(engine, prompts, max_tokens: int):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [r.output_token_ids for r in reqs], [finals[r.request_id] for r in reqs]


@pytest.mark.parametrize("policy, budget, num_blocks", [
    ("sarathi", 64, 20), *(pytest.param(*p, marks=pytest.mark.slow)
                           for p in [("sarathi", 512, None), ("sarathi", 32, None), ("orca", 512, None), ("vllm", 128, None)])])
def test_prefix_cache_keeps_outputs(engine_fp32, policy, budget, num_blocks):
    """fp32 greedy: cache off, then cache on (a first request warms it, the rest share its
    prefix), whole prompts and chunks, with and without preemption: the same tokens."""
    prompts = shared_prefix_prompts(engine_fp32.tokenizer)
    with scheduler_config(engine_fp32, budget=budget, num_blocks=num_blocks, policy=policy, prefix_caching=False):
        off, _ = run_requests(engine_fp32, prompts, 10)
    with scheduler_config(engine_fp32, budget=budget, num_blocks=num_blocks, policy=policy,
                          prefix_caching=True) as engine:
        warm, _ = run_requests(engine, prompts[:1], 10)
        on, outs = run_requests(engine, prompts, 10)
        sched, bm = engine.scheduler, engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        if num_blocks:
            assert sched.num_preemptions > 0
        hits, queries = sched.prefix_cache_hits, sched.prefix_cache_queries
    assert warm == off[:1] and on == off
    assert [o.num_cached_tokens for o in outs][-1] == 32  # 3 cached blocks, the last recomputed
    assert queries == sum(map(len, prompts[:1] + prompts))
    assert hits == sum(o.num_cached_tokens for o in outs)
    if not num_blocks:  # with room to keep it, every prompt found the system prompt
        assert all(o.num_cached_tokens >= 64 for o in outs[:-1])


def test_prefix_cache_multi_turn(engine_fp32):
    """Each turn = the previous prompt + its answer + a new message: the answer's blocks hit too."""
    tok = engine_fp32.tokenizer
    messages = [tok.encode(f" Turn {i}: " + " ".join(WORDS[3 * i:3 * i + 6])) for i in range(3)]

    def converse(caching: bool):
        with scheduler_config(engine_fp32, budget=48, prefix_caching=caching) as engine:
            prompt, answers, cached = [], [], []
            for m in messages:
                prompt = prompt + m
                out, finals = run_requests(engine, [prompt], 12)
                answers.append(out[0])
                cached.append(finals[0].num_cached_tokens)
                prompt = prompt + out[0]
            return answers, cached

    off, cached_off = converse(False)
    on, cached_on = converse(True)
    assert on == off and cached_off == [0, 0, 0]
    length = 0
    for i, m in enumerate(messages):
        if i:  # everything computed before: the previous prompt and all but the last answer token
            assert cached_on[i] == (length - 1) // 16 * 16
        length += len(m) + 12


def test_a_latency_target_starts_with_a_fitted_step_cost(engine_fp32, monkeypatch):
    """With --target-tbt-ms the engine times a few throwaway requests at start-up (this method,
    from its constructor), so the first users' chunks are planned from a fit; nothing of those
    requests is left behind."""
    from carpool.core.step_cost import BatchShape

    monkeypatch.setattr(engine_fp32, "CALIBRATION_PROMPTS", (16, 48, 96))  # fewer tokens: fp32 is slow
    # A target far above any of these steps: the chunks follow the fit's trust region alone, not
    # how busy the host is while the fit is young.
    with scheduler_config(engine_fp32, budget=512, target_tbt=5.0) as engine:
        engine._calibrate_step_cost()
        cost = engine.scheduler.cost
        assert cost.ready and cost.max_tokens_seen >= 64
        assert cost.predict(BatchShape(((256, 0),))) > cost.predict(BatchShape(decode_contexts=(64,), num_sampled=1)) > 0
        assert not engine.iteration_stats and not engine.requests and not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.scheduler.num_slo_unreachable == 0
        (out,) = run_greedy(engine, [[1, 2, 3, 4]], 4)
        assert len(out) == 4


def test_the_last_calibration_prompt_shrinks_on_a_slow_model():
    """Its step stays near CALIBRATION_STEP_SECONDS, between twice the prompt before it and the
    configured last one."""
    before, last = LLMEngine.CALIBRATION_PROMPTS[-2:]
    per_token = LLMEngine.CALIBRATION_STEP_SECONDS / last
    assert LLMEngine.last_calibration_prompt(per_token / 10) == last  # the embedded model
    assert LLMEngine.last_calibration_prompt(per_token * 2) == max(2 * before, last // 2)
    assert LLMEngine.last_calibration_prompt(0.012) == 2 * before  # a 1B model on 2 Zen 3 cores
    assert LLMEngine.last_calibration_prompt(0.0) == last


def test_a_restart_replays_the_cached_calibration(engine_fp32, monkeypatch, tmp_path):
    """The calibration's steps are kept on disk (core/step_cache.py): a second start with the same
    model and settings runs no request and comes to the very same fit."""
    monkeypatch.setattr(engine_fp32, "CALIBRATION_PROMPTS", (16, 48))
    monkeypatch.setenv("CARPOOL_STEP_CACHE", str(tmp_path))
    batches = []
    stop = engine_fp32.add_batch_observer(batches.append)
    try:
        fits, ran = [], []
        for _ in range(2):
            with scheduler_config(engine_fp32, budget=512, target_tbt=5.0) as engine:
                engine._calibrate_step_cost()
                fits.append((list(engine.scheduler.cost.weights), engine.scheduler.cost.num_observations))
                ran.append(len(batches))
    finally:
        stop()
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert ran[0] == ran[1] > 0  # the second start ran nothing
    assert fits[0] == fits[1] and fits[0][1] == ran[0]

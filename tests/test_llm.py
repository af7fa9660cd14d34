"""A script written against vLLM's documented offline API runs unchanged."""

from __future__ import annotations

import logging
import math

import pytest

from carpool import LLM, RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt
from carpool.args import engine_config
from carpool.outputs import CompletionOutput, Logprob


@pytest.fixture(scope="module")
def llm(model_path):
    # Arguments a vLLM user passes: honoured, mapped or ignored with a warning, never a TypeError.
    return LLM(model=model_path, dtype="float32", gpu_memory_utilization=0.9, max_model_len=512,
               enforce_eager=True, trust_remote_code=False, tokenizer=model_path, seed=0,
               kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=True)


def test_vllm_script(llm):
    prompts = ["Hello, my name is", "The capital of France is"]
    outputs = llm.generate(prompts, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, logprobs=2,
                                                   ignore_eos=True))
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1]
        for c in output.outputs:
            assert isinstance(c, CompletionOutput) and len(c.token_ids) == 8 and c.text
            assert c.finish_reason == "length"
            first = c.logprobs[0][c.token_ids[0]]
            assert isinstance(first, Logprob) and first.rank >= 1 and first.decoded_token is not None
            assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
        assert output.outputs[0].token_ids != output.outputs[1].token_ids  # seed + j per choice
    again = llm.generate(prompts[0], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True))
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outputs[0].outputs]
    chat = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=6, temperature=0))
    assert chat[0].outputs[0].text
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer


def test_chat_options(llm):
    conversation = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue is"}]
    cont = llm.apply_chat_template(conversation, continue_final_message=True)
    assert llm.tokenizer.decode(cont).rstrip().endswith("Blue is")
    custom = llm.apply_chat_template([{"role": "user", "content": "hi"}],
                                     chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert llm.tokenizer.decode(custom) == "<hi>"


def test_chat_passes_tools_to_the_template(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    ids = llm.apply_chat_template(conversation, tools=tools)
    assert '"get_weather"' in llm.tokenizer.decode(ids)  # SmolLM2's template ignores tools: they go into the system turn
    out = llm.chat(conversation, SamplingParams(max_tokens=2, temperature=0), tools=tools, use_tqdm=False)
    assert out[0].prompt_token_ids == ids


def test_token_controls(llm):
    base = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate("The capital of France is", base)[0].outputs[0]
    first = plain.token_ids[0]
    banned = llm.generate("The capital of France is",
                          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={first: -100}))
    assert banned[0].outputs[0].token_ids[0] != first
    allowed = [11, 12, 13]
    only = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0.9, seed=1, allowed_token_ids=allowed))
    assert set(only[0].outputs[0].token_ids) <= set(allowed)
    word = plain.text.split()[0]
    without = llm.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                                     bad_words=[word]))
    assert word not in without[0].outputs[0].text.split()
    short = llm.generate("one two three four five six seven eight", SamplingParams(
        max_tokens=2, temperature=0, truncate_prompt_tokens=3))
    assert len(short[0].prompt_token_ids) == 3


def test_bad_params_fail_their_prompt_only(llm):
    outs = llm.generate(["ok", "bad"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, stop_token_ids=[10**9])])
    assert outs[0].outputs[0].finish_reason in ("stop", "length") and outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"


def test_prompt_dicts(llm):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    expected = llm.generate(text, sp, use_tqdm=False)[0].token_ids
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt=text), ids, text,
                         {"prompt_token_ids": ids, "prompt": "shown"}], sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected] * 5 and not any(o.error for o in outs)
    assert [o.prompt for o in outs] == [None, text, None, text, "shown"]
    assert all(o.prompt_token_ids == ids for o in outs)
    single = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == expected


def test_unknown_prompt_key_raises_before_anything_runs(llm):
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate(["ok", {"prompt": "hi", "multi_modal_data": {}}], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": "hi"}, SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_template_kwargs_and_rendered_prompt(llm):
    template = "{% for m in messages %}<{{ m.content }}>{% endfor %}{% if shout %}!{% endif %}"
    conversation = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(max_tokens=2, temperature=0)
    quiet, loud = (llm.chat(conversation, sp, use_tqdm=False, chat_template=template, chat_template_kwargs=kwargs)[0]
                   for kwargs in (None, {"shout": True}))
    assert (quiet.prompt, loud.prompt) == ("<hi>", "<hi>!")
    assert loud.prompt_token_ids == llm.tokenizer.encode("<hi>!", add_special_tokens=False)
    assert llm.apply_chat_template(conversation, template, chat_template_kwargs={"shout": True}) == loud.prompt_token_ids
    default = llm.chat(conversation, sp, use_tqdm=False)[0]
    assert default.prompt.endswith("hi<|im_end|>\n<|im_start|>assistant\n")  # SmolLM2's template
    assert default.prompt_token_ids == llm.apply_chat_template(conversation)


def test_prefix_cache_reset_and_default_params(llm):
    prompt = "one two three four five six seven eight nine ten " * 4  # several whole blocks
    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompt, sp, use_tqdm=False)
    assert llm.generate(prompt, sp, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, sp, use_tqdm=False)[0].num_cached_tokens == 0
    defaults = llm.get_default_sampling_params()
    assert defaults == llm.llm_engine.default_sampling_params() and defaults is not llm.get_default_sampling_params()


def test_logprobs_of_the_whole_vocabulary(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0, logprobs=-1), use_tqdm=False)[0]
    entry = out.outputs[0].logprobs[0]
    assert len(entry) == llm.llm_engine.model_config.vocab_size
    assert entry[out.token_ids[0]].rank == 1
    assert math.fsum(math.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0, abs=1e-3)


def test_output_kinds_and_carried_fields(llm):
    extra = {"tag": "mine"}
    runs = [llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, output_kind=kind,
                                                 spaces_between_special_tokens=spaces, extra_args=extra),
                         use_tqdm=False)[0]
            for kind, spaces in [(RequestOutputKind.CUMULATIVE, True), (RequestOutputKind.FINAL_ONLY, False)]]
    assert runs[0].text == runs[1].text and len(runs[1].token_ids) == 3
    request = llm.llm_engine.add_request({"prompt": "Hello"}, SamplingParams(extra_args=extra), request_id="extra")
    assert request.sampling_params.extra_args is extra and request.prompt == "Hello"
    llm.llm_engine.abort_request("extra")
    assert extra == {"tag": "mine"} and not llm.llm_engine.has_unfinished_requests()


def test_engine_arguments_are_mapped_or_ignored_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="carpool")
    config = engine_config("m.gguf", kv_cache_memory_bytes=1 << 20, swap_space=4, no_such_argument=1,
                           max_num_seqs=8)
    assert config.kv_cache_memory == 1 << 20 and config.max_num_seqs == 8
    assert any("swap_space" in m for m in caplog.messages) and any("no_such_argument" in m for m in caplog.messages)


def test_kv_cache_memory_takes_the_command_lines_sizes():
    assert engine_config("m.gguf", kv_cache_memory="256MiB").kv_cache_memory == 256 << 20
    with pytest.raises(ValueError, match="not a size in bytes"):
        engine_config("m.gguf", kv_cache_memory="lots")


REPEATING = ", ".join(map(str, range(1, 41))) + "\n" + ", ".join(map(str, range(1, 21))) + ","


@pytest.mark.slow  # its own fp32 engine: ~9 s (tests/spec and tests/server/test_server_spec.py cover the same in the default tier)
def test_speculative_config_keeps_greedy_output(llm, model_path):
    """vLLM's `LLM(speculative_config=...)`: n-gram drafts from the prompt's own repetition are
    scored and kept, and greedy output is the output of the same engine without them."""
    spec = LLM(model=model_path, dtype="float32", max_model_len=512, seed=0, kv_cache_memory_bytes=64 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    prompts = [REPEATING, "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = spec.generate(prompts, params, use_tqdm=False)
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].outputs[0].text.startswith(" 21, 22, 23")
    stats = spec.llm_engine.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert llm.llm_engine.spec_stats.num_drafts == 0


@pytest.mark.parametrize("bad", ['{"method": "eagle"}', {"method": "eagle"}, "{not json",
                                 {"num_speculative_tokens": 0}])
def test_a_bad_speculative_config_is_a_value_error(bad, model_path):
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(model=model_path, speculative_config=bad)

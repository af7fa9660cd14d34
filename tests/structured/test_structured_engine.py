"""Structured outputs through LLM / LLMEngine: outputs obey their constraint, other rows are
untouched, bad constraints are refused at add_request, matchers go with their requests."""

from __future__ import annotations

import gc
import json
import re

import jsonschema
import pytest

from carpool import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", kv_cache_memory=64 << 20, num_threads=2)


def chat_prompt(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def constrained(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def test_each_kind_of_constraint_holds(llm):
    prompt = chat_prompt(llm, "Describe a user of our site as JSON.")
    cases = {
        "json": constrained(json=PERSON),
        "json_text": constrained(json=json.dumps(PERSON), disable_any_whitespace=True),
        "choice": constrained(choice=["admin", "user", "guest"]),
        "regex": constrained(regex=r"[A-Z][a-z]{2,8} \d{2}"),
        "grammar": constrained(grammar='root ::= "yes" | "no" | "maybe"'),
    }
    prompts = [prompt] * len(cases) + [chat_prompt(llm, "What is the capital of France? Answer in JSON.")]
    cases["json_object"] = constrained(json_object=True)
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=c) for c in cases.values()]
    outs = dict(zip(cases, llm.generate(prompts, params, use_tqdm=False)))
    for name, out in outs.items():
        assert out.finish_reason == "stop", (name, out.text)
    for name in ("json", "json_text"):
        jsonschema.validate(json.loads(outs[name].text), PERSON)
    compact = json.dumps(json.loads(outs["json_text"].text), separators=(",", ":"), ensure_ascii=False)
    assert outs["json_text"].text == compact  # disable_any_whitespace: no optional whitespace
    assert isinstance(json.loads(outs["json_object"].text), dict)
    assert outs["choice"].text in ("admin", "user", "guest")
    assert re.fullmatch(r"[A-Z][a-z]{2,8} \d{2}", outs["regex"].text)
    assert outs["grammar"].text in ("yes", "no", "maybe")


@pytest.mark.slow
def test_sampled_outputs_hold_too(llm):
    prompt = chat_prompt(llm, "Invent three users as JSON.")
    params = SamplingParams(n=3, max_tokens=120, temperature=1.0, seed=3, structured_outputs=constrained(json=PERSON))
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_unconstrained_rows_are_untouched(llm):
    prompts = [chat_prompt(llm, "Tell me about cats."), chat_prompt(llm, "Give me a user as JSON.")]
    plain = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.generate(prompts[0], plain, use_tqdm=False)[0]
    mixed = llm.generate(prompts, [plain, SamplingParams(max_tokens=60, temperature=0,
                                                         structured_outputs=constrained(json=PERSON))],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids != alone.outputs[0].token_ids


def test_bad_constraint_is_refused_at_add_request(llm):
    engine = llm.llm_engine
    before = engine.num_unfinished_requests
    with pytest.raises(ValueError, match=r"structured_outputs.json: invalid JSON schema.*objekt"):
        engine.add_request("hi", SamplingParams(structured_outputs=constrained(json={"type": "objekt"})))
    with pytest.raises(ValueError, match=r"structured_outputs.regex: invalid regular expression"):
        engine.add_request("hi", SamplingParams(structured_outputs=constrained(regex="(")))
    assert engine.num_unfinished_requests == before
    out = llm.generate(["hi", "hello"], [SamplingParams(structured_outputs=constrained(grammar="start: (")),
                                         SamplingParams(max_tokens=2)], use_tqdm=False)
    assert out[0].finish_reason == "error" and "structured_outputs.grammar" in out[0].error
    assert out[1].finish_reason == "length"


def test_matchers_are_freed_when_requests_finish_or_abort(llm):
    import sys

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=40, temperature=0, structured_outputs=constrained(choice=["cat", "dog"]))
    done, aborted = engine.add_request("Pick one:", sp), engine.add_request("Pick again:", sp)
    matchers = [done.grammar, aborted.grammar]  # (llguidance matchers take no weak references)
    engine.step()
    engine.abort_request(aborted.request_id)
    assert aborted.grammar is None
    while engine.has_unfinished_requests():
        engine.step()
    assert done.finish_reason == "stop" and done.grammar is None
    gc.collect()
    assert [sys.getrefcount(m) for m in matchers] == [3, 3]  # the list, the loop variable, the call


def test_a_row_with_no_allowed_token_fails_alone(llm):
    prompt = chat_prompt(llm, "JSON please.")
    comma = llm.tokenizer.encode(",", add_special_tokens=False)[0]
    outs = llm.generate([prompt, prompt], [
        SamplingParams(max_tokens=8, allowed_token_ids=[comma], structured_outputs=constrained(json_object=True)),
        SamplingParams(max_tokens=8, temperature=0, structured_outputs=constrained(choice=["ok"])),
    ], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "structured output" in outs[0].error
    assert outs[1].text == "ok" and outs[1].finish_reason == "stop"


@pytest.mark.slow
def test_preemption_keeps_the_matcher_in_step(model_path):
    """Recompute drops only KV: outputs stay valid when requests are preempted mid-answer."""
    llm = LLM(model_path, dtype="float32", kv_cache_memory=8 << 20, num_threads=2,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts = [chat_prompt(llm, f"Describe {who}, a user of our site, as JSON.")
               for who in ("Ann", "Bob", "Carla", "Dmitri", "Eve", "Fatima")]
    sp = SamplingParams(max_tokens=100, temperature=0, structured_outputs=constrained(json=PERSON))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)

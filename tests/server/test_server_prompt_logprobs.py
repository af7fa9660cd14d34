"""Prompt logprobs over HTTP: `echo` + `logprobs` on /v1/completions (what lm-evaluation-harness'
local-completions loglikelihood tasks sum) and vLLM's `prompt_logprobs` field, with the official
client, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion

CONTEXT = "Question: Which planet is known as the red planet?\nAnswer:"
CONTINUATION = " Mars, the fourth planet from the Sun."


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key="none")


def reference_logprobs(hf_model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.slow  # loads transformers' model; tests/test_prompt_logprobs.py compares the engine's own
def test_echo_logprobs_score_the_prompt_as_transformers_does(client, served, hf_model):
    ids = served.engine.tokenizer.encode(CONTEXT + CONTINUATION)
    out = client.completions.create(model=served.model_name, prompt=CONTEXT + CONTINUATION, max_tokens=1,
                                    echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs  # (openai's types say list[float]; the first is null, as OpenAI and vLLM send)
    assert out.choices[0].text.startswith(CONTEXT + CONTINUATION)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.tokens[:len(ids)] == [served.engine.tokenizer.decode([t]) for t in ids]
    assert lp.text_offset[len(ids)] == len(CONTEXT + CONTINUATION)
    ref = reference_logprobs(hf_model, ids)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(ref, abs=1e-3)
    # the continuation's log-likelihood, as the harness sums it
    num_cont = len(ids) - len(served.engine.tokenizer.encode(CONTEXT))
    assert sum(lp.token_logprobs[len(ids) - num_cont:len(ids)]) == pytest.approx(sum(ref[-num_cont:]), abs=1e-3)
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])


def test_streamed_echo_logprobs_equal_the_whole_answer(client, served):
    kwargs = dict(model=served.model_name, prompt=CONTEXT, max_tokens=4, echo=True, logprobs=2, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, values = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs_field(served):
    n = len(served.engine.tokenizer.encode(CONTEXT))
    r = httpx.post(served.v1 + "/completions", json={"prompt": CONTEXT, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    Completion.model_validate(r.json())
    scored = r.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == n and scored[0] is None
    assert all(1 <= len(e) <= 3 and {"logprob", "rank", "decoded_token"} <= set(next(iter(e.values())))
               for e in scored[1:])
    r = httpx.post(served.v1 + "/completions", json={"prompt": CONTEXT, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_chat_prompt_logprobs(client, served):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model=served.model_name, messages=messages, max_tokens=2,
                                         extra_body={"prompt_logprobs": 0})
    ChatCompletion.model_validate(out.model_dump())
    scored = out.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == out.usage.prompt_tokens
    chunks = [c for c in client.chat.completions.create(model=served.model_name, messages=messages, max_tokens=2,
                                                        stream=True, extra_body={"prompt_logprobs": 0})
              if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(chunks) == 1
    streamed = chunks[0].model_extra["prompt_logprobs"]
    assert [list(e) if e else e for e in streamed] == [list(e) if e else e for e in scored]

"""Tool calling on /v1/chat/completions.

The response shapes (a call whole and streamed, its id, name and arguments, finish_reason
"tool_calls", content beside a call) are checked on the scripted engine, which writes the call's
text as a model would. On the real engine (the slow suite), through the official `openai`
client: the embedded 135M model does not call tools by itself, so calls come from tool_choice
"required" and named functions, whose output is decoded under the call's JSON schema; the
parsing of free text ("auto") is checked against the same model's raw text, and tests/tools/
check the parser on crafted text."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from carpool.server.chat import AUTO_NEEDS_FLAGS
from carpool.tools import HermesToolParser
from carpool.tools.forced import named_schema, required_schema
from tests.server.scripted import serve
from tests.tools.templates import TOOLS_TEMPLATE

CITIES = ["Paris", "Rome", "Tokyo"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY = dict(temperature=0, max_tokens=40)
TOOL_OPTIONS = dict(enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=TOOLS_TEMPLATE)
HERMES_CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'

pytestmark = pytest.mark.anyio


def stream_chunks(r: httpx.Response) -> list[ChatCompletionChunk]:
    return [ChatCompletionChunk.model_validate_json(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: {")]


@pytest.fixture(scope="module")
def tool_server(server_factory):
    return server_factory(**TOOL_OPTIONS)


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.v1, api_key="unused", max_retries=0)


def post(served, **body) -> httpx.Response:
    return httpx.post(served.v1 + "/chat/completions", json={"messages": ASK, **GREEDY, **body}, timeout=120)


def assemble(chunks: list[ChatCompletionChunk]) -> tuple[str, list[dict], str | None]:
    """What a streaming client builds from the chunks: content, calls, finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # a call's first piece: id, type and name
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert list(calls) == list(range(len(calls)))
    return content, list(calls.values()), finish


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),  # not a list
    ({"tools": [{"type": "function"}]}, "tools"),  # no function
    ({"tools": [{"type": "code_interpreter", "function": WEATHER["function"]}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),  # the same name twice
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),  # parameters that are no schema, found when they are enforced
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 5,
                                                                             "maximum": 2}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]}, "messages"),
])
async def test_bad_tools_are_refused_naming_the_field(http, body, param):
    r = await http.post("/v1/chat/completions", json={"messages": ASK, **GREEDY, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_auto_needs_the_server_flags(http):
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):  # "auto" is the default with tools
        r = await http.post("/v1/chat/completions", json={"messages": ASK, **GREEDY, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert r.json()["error"]["message"] == AUTO_NEEDS_FLAGS
    # tools shown to the model, nothing parsed
    r = await http.post("/v1/chat/completions", json={"messages": ASK, **GREEDY, "tools": TOOLS,
                                                      "tool_choice": "none", "max_tokens": 3})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


# ------------------------------------------------------------------ shapes, on the scripted engine
async def ask_scripted(http, reply: str, **body) -> tuple[ChatCompletion, list[ChatCompletionChunk]]:
    """The whole answer and the streamed one, to a model that writes `reply`."""
    http.scripted.reply = lambda prompt, params: reply
    whole = await http.post("/v1/chat/completions", json={"messages": ASK, **GREEDY, **body})
    assert whole.status_code == 200, whole.text
    streamed = await http.post("/v1/chat/completions", json={"messages": ASK, **GREEDY, **body, "stream": True})
    return ChatCompletion.model_validate(whole.json()), stream_chunks(streamed)


@pytest.fixture
async def tools_http(scripted, anyio_backend):
    async with serve(scripted, **TOOL_OPTIONS) as http:
        http.scripted = scripted
        yield http


async def test_named_function_call_shape(tools_http):
    body, chunks = await ask_scripted(tools_http, '{"city": "Tokyo"}', tools=TOOLS, tool_choice=NAMED)
    assert tools_http.scripted.added[0][1].structured_outputs.json == named_schema(TOOLS, "get_weather")
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Tokyo"})
    content, calls, finish = assemble(chunks)  # its name first, then the arguments in pieces
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2


async def test_required_call_shape(tools_http):
    reply = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                        {"name": "get_time", "parameters": {"zone": "UTC"}}])
    body, chunks = await ask_scripted(tools_http, reply, tools=TOOLS, tool_choice="required")
    assert tools_http.scripted.added[0][1].structured_outputs.json == required_schema(TOOLS)
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    _, calls, finish = assemble(chunks)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in choice.message.tool_calls]
    await ask_scripted(tools_http, reply, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert tools_http.scripted.added[-1][1].structured_outputs.json == required_schema(TOOLS, parallel=False)


async def test_auto_call_shape_whole_and_streamed(tools_http):
    body, chunks = await ask_scripted(tools_http, HERMES_CALL, tools=TOOLS, max_tokens=64)
    assert tools_http.scripted.added[0][1].structured_outputs is None  # "auto" decodes freely
    message = body.choices[0].message
    assert body.choices[0].finish_reason == "tool_calls" and message.content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})]
    content, calls, finish = assemble(chunks)
    assert (content, finish) == ("Checking.\n", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in message.tool_calls]
    plain, _ = await ask_scripted(tools_http, "Sunny.", tools=TOOLS, tool_choice="auto")
    assert plain.choices[0].message.content == "Sunny." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


async def test_multi_turn_prompt(tools_http):
    """The assistant's calls and the tool's result go back through the template."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}
    history = ASK + [{"role": "assistant", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    tools_http.scripted.reply = lambda prompt, params: "It is sunny."
    final = (await tools_http.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS,
                                                                  "tool_choice": "auto", "max_tokens": 8})).json()
    assert final["choices"][0]["message"]["content"] == "It is sunny."
    ids = (await tools_http.post("/tokenize", json={"messages": history, "tools": TOOLS})).json()["tokens"]
    assert final["usage"]["prompt_tokens"] == len(ids) and tools_http.scripted.added[0][0] == ids
    prompt = (await tools_http.post("/detokenize", json={"tokens": ids})).json()["prompt"]
    assert json.dumps(TIME) in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Tokyo"}}' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt


# ------------------------------------------------------------------ the real model's calls


@pytest.mark.slow  # the shapes: the scripted tests above
def test_named_function_is_called(tool_server, client):
    r = post(tool_server, tools=TOOLS, tool_choice=NAMED)
    body = ChatCompletion.model_validate(r.json())
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in CITIES
    # Streamed: the same call (greedy), its name first, then the arguments in pieces.
    chunks = list(client.chat.completions.create(model=tool_server.model_name, messages=ASK, tools=TOOLS,
                                                 tool_choice=NAMED, stream=True, **GREEDY))
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump())
    content, calls, finish = assemble(chunks)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2


@pytest.mark.slow  # the shapes: the scripted tests above
def test_required_makes_at_least_one_call(tool_server, client):
    made = {}
    for parallel in (True, False):
        r = client.chat.completions.create(model=tool_server.model_name, messages=ASK, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=parallel, **GREEDY)
        calls = made[parallel] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        for call in calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time")
            assert args == {"city": args["city"]} if call.function.name == "get_weather" else {"zone": args["zone"]}
    stream = client.chat.completions.create(model=tool_server.model_name, messages=ASK, tools=TOOLS,
                                            tool_choice="required", stream=True, **GREEDY)
    _, streamed, finish = assemble(list(stream))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments)
                                                               for c in made[True]]


@pytest.mark.slow  # the shapes: the scripted tests above
def test_auto_parses_the_models_own_text(tool_server, client):
    """With "none" the text comes back as written; with "auto" it is that text, parsed."""
    def ask(choice, stream=False):
        return client.chat.completions.create(model=tool_server.model_name, messages=ASK, tools=TOOLS,
                                              tool_choice=choice, stream=stream, **GREEDY)

    raw = ask("none").choices[0].message.content
    expected = HermesToolParser().parse(raw)
    auto = ask("auto").choices[0].message
    assert auto.content == expected.content
    assert [(c.function.name, c.function.arguments) for c in auto.tool_calls or []] == [
        (c.name, c.arguments) for c in expected.tool_calls]
    content, calls, _ = assemble(list(ask("auto", stream=True)))
    assert content == (expected.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in expected.tool_calls]


@pytest.mark.slow  # the shapes: the scripted tests above
def test_auto_call_streams_like_the_whole_answer(tool_server, client):
    """A model that writes a Hermes call (held to that text by a regex constraint): the server
    parses it out, whole and streamed alike, and the text before it stays content."""
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text)
    r = post(tool_server, tools=TOOLS, structured_outputs={"regex": regex}, max_tokens=64)
    if r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs":
        pytest.skip("this server does not take structured_outputs in requests yet")
    message = ChatCompletion.model_validate(r.json()).choices[0].message
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert message.content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})]
    r = httpx.post(tool_server.v1 + "/chat/completions", timeout=120, json={
        "messages": ASK, **GREEDY, "max_tokens": 64, "tools": TOOLS, "structured_outputs": {"regex": regex},
        "stream": True})
    chunks = [ChatCompletionChunk.model_validate_json(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    content, calls, finish = assemble(chunks)
    assert (content, finish) == ("Checking.\n", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in message.tool_calls]


@pytest.mark.slow  # the shapes: the scripted tests above
def test_multi_turn_exchange(tool_server, client):
    """A call, its result, then the final answer: the assistant's calls and the tool's result go
    back through the template."""
    first = client.chat.completions.create(model=tool_server.model_name, messages=ASK, tools=TOOLS,
                                           tool_choice=NAMED, **GREEDY)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    final = client.chat.completions.create(model=tool_server.model_name, messages=history, tools=TOOLS,
                                           tool_choice="auto", temperature=0, max_tokens=8)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    # The prompt held the tools, the call with its arguments as an object, and the result.
    ids = httpx.post(tool_server.url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    assert final.usage.prompt_tokens == len(ids)
    prompt = httpx.post(tool_server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert json.dumps(TIME) in prompt
    assert f'{{"name": "get_weather", "arguments": {json.dumps(json.loads(call.function.arguments))}}}' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt


async def test_a_named_call_cut_by_max_tokens_is_still_a_call(tools_http):
    """As vLLM answers it: the call with the arguments decoded so far, finish_reason "length"."""
    reply = '{"city": "Tokyo", "days": 3, "unit": "celsius"}'
    body, chunks = await ask_scripted(tools_http, reply, tools=TOOLS, tool_choice=NAMED, max_tokens=5)
    choice = body.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert reply.startswith(call.function.arguments) and len(call.function.arguments) < len(reply)
    content, calls, finish = assemble(chunks)
    assert (content, finish) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    calls = json.dumps([{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}])
    body, _ = await ask_scripted(tools_http, calls, tools=TOOLS, tool_choice="required", max_tokens=12)
    choice = body.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and '{"city": "Tokyo", "days": 3}'.startswith(call.function.arguments)

"""OpenAI request bodies as pydantic models, and the OpenAI-style error bodies for bad ones.

Every way a request can be wrong ends in `APIError`, which the server turns into
`{"error": {"message", "type", "param", "code"}}` with an HTTP status, so clients built for the
OpenAI API (the official `openai` package included) see the errors they expect.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from carpool.sampling_params import (MAX_LOGPROBS, MAX_N, MAX_REPETITION_PENALTY, MAX_STOP_STRING_CHARS,
                                     MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                                     MIN_REPETITION_PENALTY, SEED_MAX, SEED_MIN, StructuredOutputsParams)



class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 415: "invalid_request_error", 500: "server_error",
             503: "service_unavailable"}

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error's body (OpenAI's shape), as error_body writes it."""

    error: ErrorDetail


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": APIError.TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


# ---------------------------------------------------------------- request models
# Strict: a string is not a number, a bool is not an int, 1.5 is not an int; and no number is
# infinite or NaN (JSON `Infinity` and `1e400` are refused, never turned into inf).
StrictInt = Annotated[int, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0)]
TokenIds = list[TokenId]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
# A logit_bias key: a token id written in ASCII decimal digits. The pattern (also in the OpenAPI
# schema) is what makes `int(key)` safe: str.isdigit() also passes "²" and 5,000-digit numbers.
LogitBiasKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
MAX_TOOLS = 128  # OpenAI's limit on tools per request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Fields that vLLM or OpenAI define and that would change the output, but that carpool does not
# implement: a request that sets one gets a 400 naming it, never text that ignored it. Fields
# nobody here knows (vendor extras such as llama.cpp's `cache_prompt`) are ignored, as vLLM does,
# and logged once by name. Only undeclared fields are checked: chat declares `tool_choice`, so it
# is refused on /v1/completions alone.
UNSUPPORTED_FIELDS = frozenset({
    "guided_decoding_backend", "use_beam_search", "length_penalty",
    "logits_processors", "functions", "function_call", "tool_choice",
    "prediction", "vllm_xargs",
})
HARMLESS_VALUES = (None, False, "none", "auto")  # e.g. tool_choice "none" changes nothing


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (SamplingParams.structured_outputs' shape)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


# Where a request may ask for structured outputs; at most one of them per request.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extras included)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    min_tokens: StrictInt = Field(0, ge=0)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: Annotated[dict[LogitBiasKey, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # token id (as text) -> bias
    allowed_token_ids: Annotated[TokenIds, Field(min_length=1)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: score the prompt
    # Structured outputs (carpool/structured): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    _structured: StructuredOutputsParams | None = PrivateAttr(None)
    # Accepted for compatibility; any value that would change the result is refused below.
    best_of: StrictInt | None = None

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids (the key pattern has checked they are)."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @model_validator(mode="after")
    def _check_common(self):
        for name, value in sorted((self.model_extra or {}).items()):
            if name in UNSUPPORTED_FIELDS and value not in HARMLESS_VALUES and value != [] and value != {}:
                raise ValueError(f"{name}: not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must not exceed max_tokens")
        given = [name for name in STRUCTURED_FIELDS if self._structured_given(name)]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one structured output per request (also got {given[0]})")
        if self.response_format and self.response_format.type == "json_schema" and (
                self.response_format.json_schema is None or self.response_format.json_schema.schema_ is None):
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        self._structured = None
        if given:
            try:
                self._structured = self._structured_params(given[0])
            except ValueError as e:
                raise ValueError(f"{given[0]}: {str(e).removeprefix('structured_outputs.')}") from None
        return self

    def _structured_given(self, name: str) -> bool:
        value = getattr(self, name)
        if name == "response_format":
            return value is not None and value.type != "text"
        return value is not None

    def _structured_params(self, name: str) -> StructuredOutputsParams:
        ws = dict(whitespace_pattern=self.guided_whitespace_pattern)
        if name == "response_format":
            rf = self.response_format
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True, **ws)
            return StructuredOutputsParams(json=rf.json_schema.schema_, **ws)
        if name == "structured_outputs":
            so = self.structured_outputs
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                                           whitespace_pattern=so.whitespace_pattern or ws["whitespace_pattern"])
        kind = name.removeprefix("guided_")
        return StructuredOutputsParams(**{kind: getattr(self, name)}, **ws)

    @property
    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's structured output and the field it came in, or None."""
        if self._structured is None:
            return None
        return self._structured, next(n for n in STRUCTURED_FIELDS if self._structured_given(n))


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix: not supported")
        p = self.prompt
        if isinstance(p, str):
            if not p:
                raise ValueError("prompt: must not be empty")
        elif not p:
            raise ValueError("prompt: must not be empty")
        elif isinstance(p[0], str):
            if any(not s for s in p):
                raise ValueError("prompt: prompts must not be empty")
        elif isinstance(p[0], list):
            if any(not ids for ids in p):
                raise ValueError("prompt: token-id prompts must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = ""  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str) -> str:
        if v.strip():
            json.loads(v)  # a ValueError names messages.N.tool_calls.M.function.arguments
        return v


class ToolCallParam(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    @model_validator(mode="after")
    def _check(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages make tool calls")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it (carpool/tools/template.py parses the arguments)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables, e.g. enable_thinking

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: needs tools; none were given")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: function {self.tool_choice.function.name!r} is not among the tools")
        return self

    @property
    def effective_tool_choice(self) -> str | dict:
        """"none", "auto", "required", or the named choice as a dict."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    @property
    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None  # with messages, as chat does
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: TokenIds


# ---------------------------------------------------------------- parsing
def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Validate a raw JSON body, or raise APIError(400) naming the offending field."""
    if not body.strip():
        raise APIError("the request body is empty; send a JSON object", param=None)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    kind = err.get("type", "")
    loc = [str(x) for x in err.get("loc", ())]
    msg = err.get("msg", "invalid value")
    if kind == "json_invalid":
        return APIError(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}")
    if kind == "model_type" and not loc:
        return APIError("the request body must be a JSON object")
    if kind == "value_error" and not loc:
        # Our own model validators: "field: message".
        text = msg.removeprefix("Value error, ")
        field, sep, rest = text.partition(": ")
        if sep and field.replace("_", "").isalnum():
            return APIError(f"{field}: {rest}", param=field)
        return APIError(text)
    # Union members add their type names to the location; keep the real path only.
    path = [x for x in loc if not _is_type_tag(x)]
    param = path[0] if path else None
    where = ".".join(path) or "body"
    if kind == "missing":
        return APIError(f"{where}: field required", param=param)
    return APIError(f"{where}: {msg}", param=param)


def _is_type_tag(x: str) -> bool:
    return x in ("str", "int", "float", "bool") or x.startswith(("list[", "function-", "constrained-"))

"""How one request wants its tokens chosen and when it wants to stop.

Every field is range-checked here, so that no value can make sampling produce NaNs or make one
request slow down the steps it shares with others; the server's request models use the same
limits, so the HTTP API and the Python API refuse the same things."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Beyond these, sampling is uniform noise or numerically unsafe (1/penalty overflows bf16/fp32
# logits into inf), so they are refused rather than silently clipped.
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Stop strings are searched after every token of the request: bound the work per step.
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 32, 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_N = 128
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator seeds are 64-bit


class RequestOutputKind(str, Enum):
    """What each output of a request holds (vLLM's names). A str enum, so the plain strings
    "cumulative", "delta" and "final_only" are accepted and compare equal.

    CUMULATIVE: text and token_ids hold everything generated so far (every step copies them).
    DELTA: they hold only what this step added, as `new_text` / `new_token_ids` do; streaming
    consumers use it so that a long generation costs O(length), not O(length^2).
    FINAL_ONLY: only the finished output matters, as in LLM.generate, which returns nothing else;
    LLMEngine.step() still reports the request each step, cumulatively."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"

    def __str__(self) -> str:
        return self.value


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's shape): exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a regular expression,
    a list of `choice` strings, or a `grammar` (Lark or GBNF). Only the shape is checked here; the
    engine compiles it against the tokenizer at add_request and raises ValueError naming what is
    wrong (carpool/structured)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without optional whitespace (compact output)
    whitespace_pattern: str | None = None  # regex for the whitespace JSON may hold

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {kinds or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint this is: 'json', 'json_object', 'regex', 'choice' or 'grammar'."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return beside the sampled token; -1: the whole vocabulary
    skip_special_tokens: bool = True
    # vLLM's flag for slow tokenizers. Accepted for compatibility; carpool detokenizes with the
    # fast (Rust) tokenizer, which writes special tokens with nothing between them either way.
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    n: int = 1  # choices per prompt: LLM.generate and the server run one engine request per choice
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # words never generated (each also with a leading space)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    prompt_logprobs: int | None = None  # score every prompt token after the first, with this many top alternatives (-1: all)
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (JSON, regex, ...)
    extra_args: dict[str, Any] | None = None  # carried along untouched, for the caller's own use

    def __post_init__(self) -> None:
        for name in ("max_tokens", "min_tokens", "top_k", "logprobs", "seed"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be an integer, not a bool")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop: stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not -1 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be -1 (the whole vocabulary) or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            if any(not -100 <= v <= 100 for v in self.logit_bias.values()) or any(k < 0 for k in self.logit_bias):
                raise ValueError("logit_bias must map token ids >= 0 to values in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or not all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if self.bad_words is not None and not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < 1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not -1 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be -1 (the whole vocabulary) or an integer in "
                             f"[0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {[k.value for k in RequestOutputKind]}, "
                             f"got {self.output_kind!r}") from None
        if not isinstance(self.spaces_between_special_tokens, bool):
            raise ValueError("spaces_between_special_tokens must be a bool")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")

    def clone(self) -> SamplingParams:
        """A deep copy: changing the copy's lists or dicts leaves this one as it was."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def edits_logits(self) -> bool:
        """Whether a penalty or a token control may change this request's logits before sampling."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words) or self.min_tokens > 0)

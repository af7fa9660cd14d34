"""A request's state as it moves through the engine.

There are no prefill and decode phases: a request has `num_tokens` (prompt plus what it has
generated) and `num_computed_tokens` (those whose KV is cached). Each step grants it some of the
difference; when a step brings the two level, the model's output at the last position is sampled.
A prefill chunk, a decode and a recompute after preemption are all this one rule.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from carpool.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)  # identity semantics: two requests are never 'equal'
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()

    token_ids: list[int] = field(init=False)  # prompt + output, grows by one per sampled token
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    # Sliding-window layers' tables, parallel to block_ids (core/block_manager.py); [] without.
    window_block_ids: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    output_logprobs: list[dict] = field(default_factory=list)  # per token: {token id: Logprob}
    cumulative_logprob: float = 0.0  # of the sampled tokens (kept when logprobs are asked for)
    generator: torch.Generator | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # set by the engine (tokenizer)
    grammar: Any = None  # structured outputs: the request's llguidance matcher (carpool/structured)
    # With prompt_logprobs: entry i scores prompt token i (vLLM's layout: entry 0 is None, as
    # nothing precedes the first token). Grows as prefill chunks compute the positions before.
    prompt_logprobs: list[dict | None] | None = None
    # Speculative decoding (carpool/spec): the proposer's guesses at the tokens after token_ids,
    # offered to the next step, and how the request's guesses have fared (SpecState).
    spec_token_ids: list[int] = field(default_factory=list)
    spec: Any = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.sampling_params.seed is not None:
            import torch  # here: the scheduler and simulator need no torch (nor `carpool serve`'s parser)

            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """One new token whose KV is missing: the steady state after the prompt is in cache."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens whose KV may come from the prefix cache instead of being computed: all
        but the last (its logits are sampled), and with prompt logprobs only the positions whose
        logits were already taken (position p scores prompt token p + 1)."""
        if self.prompt_logprobs is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 1, len(self.prompt_logprobs) - 1)

    def prompt_logprob_positions(self, num_tokens: int) -> range:
        """Positions of a grant of `num_tokens` whose logits score prompt tokens not scored yet
        (after a preemption the recomputed positions are not scored twice)."""
        if self.prompt_logprobs is None:
            return range(0)
        start = max(self.num_computed_tokens, len(self.prompt_logprobs) - 1)
        return range(start, min(self.num_computed_tokens + num_tokens, self.num_prompt_tokens - 1))

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(now)

"""After sampling: detokenize, check stop conditions, and package what callers see."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from carpool.request import Request, RequestStatus
from carpool.sampling_params import RequestOutputKind
from carpool.tokenizer import IncrementalDetokenizer


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of one request. `token_times` is the request's live list,
    not a copy (copying it every step would cost O(tokens^2)): copy it to keep a snapshot."""

    arrival_time: float
    first_scheduled_time: float | None
    token_times: list[float]
    finished_time: float | None
    num_preemptions: int

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass
class Logprob:
    """A candidate token's log-probability, as vLLM reports it: `rank` 1 is the most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per generated token: the sampled one and the top-N


@dataclass
class CompletionOutput:
    """One choice of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's progress after one step, in vLLM's shape: `outputs[i]` is choice i, whose
    `text`, `token_ids` and `logprobs` are everything generated so far, or, with
    `output_kind="delta"`, only what this step added (so that no step copies a whole output);
    "final_only" outputs are cumulative.

    `new_text`, `new_token_ids` and `new_logprobs` are what this step added to choice 0 whatever
    the output kind (the engine runs one choice per request; `LLM.generate` merges choices), and
    `text`, `token_ids`, `logprobs`, `finish_reason`, `stop_reason` read choice 0."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: SampleLogprobs = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @classmethod
    def failed(cls, request_id: str, prompt: str | None, error: str, n: int = 1) -> RequestOutput:
        """The output of a request refused before it ran."""
        return cls(request_id, prompt, [], [CompletionOutput(i, "", [], None, None, "error") for i in range(n)],
                   True, error=error)


class OutputProcessor:
    """Owns each live request's detokenizer and the text it has already handed out."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._text: dict[str, str] = {}
        self._sent: dict[str, tuple[int, int, int]] = {}  # chars, tokens, logprobs handed out
        self._token_text = lru_cache(maxsize=1 << 16)(
            lambda tid: tokenizer.decode([tid], skip_special_tokens=False))

    def add(self, request: Request) -> None:
        sp = request.sampling_params
        self._detok[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, sp.skip_special_tokens)
        self._text[request.request_id] = ""
        self._sent[request.request_id] = (0, 0, 0)

    def append_logprobs(self, request: Request, token: int, entry: dict[int, Logprob]) -> None:
        for tid, lp in entry.items():
            lp.decoded_token = self._token_text(tid)
        request.cumulative_logprob += entry[token].logprob
        request.output_logprobs.append(entry)

    def append_prompt_logprobs(self, request: Request, entries: list[dict[int, Logprob]]) -> None:
        for entry in entries:
            for tid, lp in entry.items():
                lp.decoded_token = self._token_text(tid)
        request.prompt_logprobs.extend(entries)

    def append_token(self, request: Request, token: int, now: float) -> RequestStatus | None:
        """Record a sampled token; return the finished status if it ends the request."""
        request.append_token(token, now)
        sp = request.sampling_params
        rid = request.request_id
        new_text = self._detok[rid].add(token)
        self._text[rid] += new_text
        can_stop = request.num_output_tokens >= sp.min_tokens
        if can_stop and token in sp.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if can_stop and not sp.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if can_stop and sp.stop and new_text:
            text = self._text[rid]
            window = len(new_text) + max(len(s) for s in sp.stop) - 1
            search_from = max(0, len(text) - window)
            hits = [(text.find(s, search_from), s) for s in sp.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self._text[rid] = text[:i + len(s)] if sp.include_stop_str_in_output else text[:i]
                request.stop_reason = s
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= sp.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_output(self, request: Request) -> RequestOutput:
        rid = request.request_id
        text = self._text.get(rid, "")
        sent_chars, sent_tokens, sent_lp = self._sent.get(rid, (0, 0, 0))
        visible = len(text)
        if not request.is_finished and request.sampling_params.stop:
            # Hold back a tail that might still become a stop string, so it is never streamed.
            visible = max(sent_chars, len(text) - (max(len(s) for s in request.sampling_params.stop) - 1))
        self._sent[rid] = (visible, request.num_output_tokens, len(request.output_logprobs))
        wants_lp = request.sampling_params.logprobs is not None
        new_text = text[sent_chars:visible]
        new_ids = request.token_ids[request.num_prompt_tokens + sent_tokens:]
        new_lp = request.output_logprobs[sent_lp:]
        delta = request.sampling_params.output_kind == RequestOutputKind.DELTA
        choice = CompletionOutput(
            index=0,
            text=new_text if delta else text[:visible],
            token_ids=new_ids if delta else request.output_token_ids,
            cumulative_logprob=request.cumulative_logprob if wants_lp else None,
            logprobs=(new_lp if delta else request.output_logprobs) if wants_lp else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        output = RequestOutput(
            request_id=rid,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[choice],
            finished=request.is_finished,
            new_text=new_text,
            new_token_ids=new_ids,
            new_logprobs=new_lp,
            metrics=RequestMetrics(request.arrival_time, request.first_scheduled_time,
                                   request.token_times, request.finished_time, request.num_preemptions),
            error=request.error,
            num_cached_tokens=request.num_cached_tokens,
            # Complete once the prompt is (each output comes after a sampled token); a delta
            # stream carries them once, in its first output.
            prompt_logprobs=request.prompt_logprobs if not (delta and sent_tokens) else None,
        )
        if request.is_finished:
            self._detok.pop(rid, None)
            self._text.pop(rid, None)
            self._sent.pop(rid, None)
        return output

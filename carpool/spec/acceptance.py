"""How a request's drafts have fared, how many to ask for and to score; and the counters.

A request keeps two exponential averages over the drafts verification saw (kept: 1, the first
rejected: 0; those after it say nothing): `acceptance`, over its first drafts, and `continuation`,
over the drafts whose previous one was kept. Its j-th draft (0-based) is then kept with chance
acceptance * continuation^j. One rate for every position (a^(j+1)) under-prices the later drafts
of copied text, where a kept draft says the copy goes on: on the editing burst of `carpool bench
spec` the kept share was 0.84 for the first two positions and 0.94-0.96 for the next three.
A request is asked for the full `num_speculative_tokens` while its first draft is worth it
(acceptance >= MIN_REACH); the scheduler decides how many of them a step scores: under the
step-time target, those worth their predicted cost (core/scheduler.py); with a fixed budget, the
run whose last one still has MIN_REACH chance (`reachable`). A step also learns about the
first draft of the proposal it did not score (`next_draft_kept`): when every scored draft was
kept, the token sampled after them is that draft's verdict. Without this, a step that scores
one draft a request never shows whether a second would pay, and a request priced out under load
never shows that its drafts got good again. A request whose drafts keep failing asks for
none, but for one every PROBE_EVERY steps, so it notices when its output starts repeating.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.request import Request

MIN_REACH = 0.25
PRIOR = 0.6  # a new request's acceptance and continuation
RATE = 0.3  # weight of each new observation in the averages
PROBE_EVERY = 8


@dataclass
class SpecState:
    """One request's record of its drafts."""

    acceptance: float = PRIOR
    continuation: float = PRIOR
    steps_without: int = 0

    def keep_chance(self, j: int) -> float:
        """The chance its j-th draft (0-based) is kept: it and every one before it."""
        return self.acceptance * self.continuation ** j

    def draft_limit(self, num_speculative_tokens: int) -> int:
        """Drafts to ask the proposer for, before the next step."""
        if self.acceptance >= MIN_REACH:
            self.steps_without = 0
            return num_speculative_tokens
        self.steps_without += 1
        if self.steps_without >= PROBE_EVERY:
            self.steps_without = 0
            return 1
        return 0

    def observe(self, num_drafts: int, num_accepted: int, next_kept: bool | None = None) -> None:
        """A verification of `num_drafts` that kept `num_accepted`; `next_kept`: how the first
        unscored draft of the proposal would have fared (None: unknown, see next_draft_kept)."""
        outcomes = [1.0] * num_accepted + [0.0] * (num_accepted < num_drafts)
        if num_accepted == num_drafts and next_kept is not None:
            outcomes.append(float(next_kept))
        if not outcomes:
            return
        self.acceptance += RATE * (outcomes[0] - self.acceptance)
        for kept in outcomes[1:]:
            self.continuation += RATE * (kept - self.continuation)


def next_draft_kept(proposal: list[int], num_scored: int, num_kept: int, last_token: int) -> bool | None:
    """Whether the proposal's first unscored draft would have been kept: known only when every
    scored draft was, as it then had to equal the token the step sampled after them."""
    if num_kept < num_scored or len(proposal) <= num_scored:
        return None
    return proposal[num_scored] == last_token


def reachable(spec: SpecState, limit: int) -> int:
    """The most drafts (at most `limit`) whose last one is kept with chance MIN_REACH or more."""
    k = 0
    while k < limit and spec.keep_chance(k) >= MIN_REACH:
        k += 1
    return k


@dataclass
class SpecDecodeStats:
    """Totals since start, as vLLM's spec_decode counters count them: verifications that had
    drafts, draft tokens scored, drafts kept, and drafts kept at each position (0 = the first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens each verification produced, its own sampled token included (vLLM's measure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def drafts_to_ask(request: Request, num_speculative_tokens: int, max_model_len: int) -> int:
    """How many drafts to ask for, before a request's next step (the engine and the simulator
    ask alike): as many as its record earns, and room for: the step that verifies k drafts adds
    up to k + 1 tokens, which must fit its max_tokens and the context."""
    if request.spec is None:
        request.spec = SpecState()
    room = min(request.sampling_params.max_tokens - request.num_output_tokens,
               max_model_len - request.num_tokens) - 1
    return max(0, min(request.spec.draft_limit(num_speculative_tokens), room))

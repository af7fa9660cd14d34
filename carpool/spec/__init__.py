"""Speculative decoding inside the token budget.

On a CPU a decode step is bound by reading the weights, so scoring a few more tokens in the same
step costs little. After each step a proposer guesses the next tokens of every request that just
sampled (`Request.spec_token_ids`). The scheduler grants those drafts last, from what the step's
budget leaves after every decode's own token and every prefill chunk (core/scheduler.py
`schedule_drafts`): speculation never delays a prefill or breaks the step-time target, and under
load it shrinks to nothing by itself. The model runner scores a decode with k drafts like a
(k + 1)-token chunk over its context; the engine then samples position by position, exactly as
it would without drafts, and keeps each draft only while it equals the token just sampled at its
place (engine.py `_emit`). For a sampled request that is rejection sampling with a draft that is
one token for sure: the draft is kept with the target's probability of it, and on a rejection
the token comes from the target's distribution without the draft's token. Output is the same as
without speculation, token for token, for greedy and for seeded sampling (the request's generator
draws once per output token either way).

- proposers.py: the proposers (n-gram prompt lookup, draft model) behind one interface;
  suffix.py: suffix decoding, drafts from recent requests' outputs too.
- acceptance.py: how many drafts a request is offered, from how its drafts have fared, and the
  counters behind the spec_decode metrics.
"""

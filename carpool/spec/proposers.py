"""Proposers: after a step, guess the next tokens of the requests that just sampled.

A proposer only guesses; verification (engine.py) decides what is kept, so a bad guess costs
its budget tokens and nothing else. Every proposer has the one method `propose`.
"""

from __future__ import annotations

from array import array
from typing import Protocol

from carpool.config import SpeculativeConfig
from carpool.request import Request


class Proposer(Protocol):
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """For each request, up to `limits[i]` tokens guessed to follow its `token_ids`."""
        ...

    def close(self) -> None:
        """Free what the proposer holds (a draft model's KV cache)."""
        ...


def ngram_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The `k` tokens that followed the latest earlier occurrence of the last n tokens, for the
    largest n in [min_n, max_n] that occurs; [] if none does. An occurrence that overlaps the
    last tokens is a repeating run (a loop, a list of the same items): its continuation goes on
    with the run's period past the end."""
    return ngram_match(tokens, k, min_n, max_n)[1]


def ngram_match(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """ngram_lookup's draft with the length n of the match it follows (0 and [] for none).

    The search runs over the tokens as 4-byte words with bytes.rfind (C speed, no copy per n);
    a hit that is not word-aligned is skipped."""
    size = len(tokens)
    if k <= 0 or size <= min_n:
        return 0, []
    words = array("i", tokens)
    data, width = words.tobytes(), words.itemsize
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = data[width * (size - n):]
        end = width * (size - 1)  # the occurrence must end before the last token: something follows
        while (i := data.rfind(suffix, 0, end)) >= 0:
            if i % width == 0:
                start = i // width + n
                out = tokens[start:start + k]
                for j in range(len(out), k):  # it runs into the end: a repeating run, go on repeating
                    out.append(out[start + j - size])
                return n, out
            end = i + len(suffix) - 1
    return 0, []


class NgramProposer:
    """Prompt lookup: what followed the request's last n tokens where they occurred before, in
    its prompt or its output (code edits, quotes and summaries copy long runs of their input)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        return [ngram_lookup(r.token_ids, k, self.min_n, self.max_n) for r, k in zip(requests, limits)]

    def close(self) -> None:
        """Nothing held between steps."""


def make_proposer(config: SpeculativeConfig, engine) -> Proposer:
    """The proposer `config` names, for `engine` (a draft model shares its tokenizer and device)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from carpool.spec.suffix import SuffixProposer

        return SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                              config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    from carpool.spec.draft_model import DraftModelProposer

    return DraftModelProposer(config, engine)

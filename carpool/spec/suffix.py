"""Suffix decoding: drafts from what recent requests wrote, as well as from the request itself.

Requests that resemble each other (an agent's loop, a template filled in again, the same question
asked twice) write the same runs of tokens, which n-gram lookup cannot see: it searches only the
request's own prompt and output. This proposer also keeps a tree of the outputs of the last
`max_cached_requests` finished requests: every run of up to `max_depth` tokens that starts
anywhere in them, with how often each run occurred. A request's context is matched against the
tree by its longest suffix that occurs there, and the draft follows the tree's most frequent
continuation while each next token keeps at least `min_token_prob` of its parent's count, for at
most `max_spec_factor` x the match's length. Its own prompt and output are searched as n-gram
lookup searches them, and the longer of the two matches gives the draft (its own on a tie).

The tree holds Python dicts: a 400-token output of distinct runs takes ~2.6 MB at depth 24, and
adding it 12.5 ms (a 2-core AMD EPYC Zen 3, quiet). Hence a smaller default cache than vLLM's,
and edits spread over the steps that follow: each step adds or removes the runs of at most
EDIT_STARTS_PER_STEP start positions, so a finished request never stalls the others' next token.
"""

from __future__ import annotations

from collections import deque

from carpool.request import Request
from carpool.spec.proposers import ngram_match

Node = dict  # token -> [count, Node]: the runs that continue with that token
EDIT_STARTS_PER_STEP = 16  # ~0.5 ms of tree edits a step at most (the module doc)


class SuffixTree:
    """Every run of up to `max_depth` tokens of the sequences added, with counts; a sequence can
    be removed again (the counts it added come off, and runs no longer seen are dropped)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root: Node = {}

    def update(self, tokens: list[int], delta: int, first: int = 0, stop: int | None = None) -> None:
        """Add (delta 1) or remove (delta -1) the runs of `tokens` that start at first .. stop - 1."""
        for start in range(first, len(tokens) if stop is None else stop):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                entry = node.get(token)
                if entry is None:
                    entry = node[token] = [0, {}]
                entry[0] += delta
                if entry[0] == 0:
                    del node[token]  # nothing below it is left either: its counts were no larger
                    break
                node = entry[1]

    def add(self, tokens: list[int]) -> None:
        self.update(tokens, 1)

    def remove(self, tokens: list[int]) -> None:
        """Undo add(tokens) of the same tokens."""
        self.update(tokens, -1)

    def _find(self, run: list[int]) -> list | None:
        """The entry [count, children] at the end of `run` from the root, or None."""
        node, entry = self.root, None
        for token in run:
            entry = node.get(token)
            if entry is None:
                return None
            node = entry[1]
        return entry

    def longest_match(self, context: list[int]) -> tuple[int, list | None]:
        """The longest suffix of `context` (fewer than max_depth tokens, so that a continuation
        can follow) that the tree holds, as (its length, its entry). A run's suffixes are runs
        too, so the lengths that match are 0 .. m, and a binary search finds m."""
        low, high, found = 0, min(len(context), self.max_depth - 1), None
        while low < high:
            mid = (low + high + 1) // 2
            entry = self._find(context[len(context) - mid:])
            if entry is None:
                high = mid - 1
            else:
                low, found = mid, entry
        return low, found

    @staticmethod
    def continuation(entry: list, limit: int, min_token_prob: float) -> list[int]:
        """The most frequent path below `entry`, token by token, while each token keeps at least
        `min_token_prob` of its parent's count, up to `limit` tokens."""
        out: list[int] = []
        count, node = entry
        while len(out) < limit and node:
            token, (child_count, child) = max(node.items(), key=lambda item: item[1][0])
            if child_count < min_token_prob * count:
                break
            out.append(token)
            count, node = child_count, child
        return out


class SuffixProposer:
    """The longer match of the request's own n-gram lookup and the tree of recent outputs."""

    def __init__(self, min_n: int, max_n: int, max_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float):
        self.min_n, self.max_n = min_n, max_n
        self.tree = SuffixTree(max_depth)
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.cached: deque[list[int]] = deque()
        self.running: dict[str, Request] = {}  # seen, not yet finished: their outputs join when they are
        self.edits: deque[list] = deque()  # [tokens, delta, next start]: tree edits still to make, in order

    def _cache_finished(self) -> None:
        for request_id, request in list(self.running.items()):
            if request.is_finished:
                del self.running[request_id]
                self.cached.append(list(request.output_token_ids))
                self.edits.append([self.cached[-1], 1, 0])
        while len(self.cached) > self.max_cached_requests:
            self.edits.append([self.cached.popleft(), -1, 0])  # after its own adding: edits run in order

    def _edit(self, starts: int) -> None:
        """Make the queued edits of at most `starts` start positions."""
        while starts > 0 and self.edits:
            edit = self.edits[0]
            tokens, delta, first = edit
            stop = min(len(tokens), first + starts)
            self.tree.update(tokens, delta, first, stop)
            starts -= stop - first
            edit[2] = stop
            if stop == len(tokens):
                self.edits.popleft()

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        self._cache_finished()
        self._edit(EDIT_STARTS_PER_STEP)
        drafts = []
        for request, limit in zip(requests, limits):
            self.running[request.request_id] = request
            own_length, own = ngram_match(request.token_ids, limit, self.min_n, self.max_n)
            length, entry = self.tree.longest_match(request.token_ids)
            if entry is None or length < max(self.min_n, own_length + 1):
                drafts.append(own)
                continue
            cap = min(limit, int(self.max_spec_factor * length))
            drafts.append(self.tree.continuation(entry, cap, self.min_token_prob) or own)
        return drafts

    def close(self) -> None:
        self.running.clear()
        self.edits.clear()

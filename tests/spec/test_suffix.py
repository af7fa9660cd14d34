"""Suffix decoding: the tree of recent outputs against a plain reference, its eviction, and the
proposer's choice between the tree and the request's own n-gram lookup."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.spec.suffix import SuffixProposer, SuffixTree
from tests.helpers import examples


def runs(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """How often each run of 1..depth tokens occurs in `sequences` (the tree's counts)."""
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] = counts.get(tuple(seq[start:end]), 0) + 1
    return counts


def tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    out, stack = {}, [((), tree.root)]
    while stack:
        prefix, node = stack.pop()
        for token, (count, child) in node.items():
            out[prefix + (token,)] = count
            stack.append((prefix + (token,), child))
    return out


@settings(max_examples=examples(60))
@given(seqs=st.lists(st.lists(st.integers(0, 4), max_size=12), max_size=5), depth=st.integers(2, 5),
       drop=st.integers(0, 5))
def test_counts_every_run_and_removal_undoes_adding(seqs, depth, drop):
    tree = SuffixTree(depth)
    for s in seqs:
        tree.add(s)
    assert tree_counts(tree) == runs(seqs, depth)
    for s in seqs[:drop]:
        tree.remove(s)
    assert tree_counts(tree) == runs(seqs[drop:], depth)


def test_longest_match_and_most_frequent_continuation():
    tree = SuffixTree(8)
    for s in ([1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 2, 3, 4, 6]):
        tree.add(s)
    length, entry = tree.longest_match([8, 8, 2, 3, 4])
    assert length == 3 and entry[0] == 3  # "2 3 4", seen three times
    assert tree.continuation(entry, 5, 0.1) == [6]  # 6 twice, 5 once; nothing follows 6
    assert tree.continuation(entry, 5, 0.7) == []  # 6 holds 2/3 of the count
    assert tree.longest_match([8, 8]) == (0, None)


def request(rid: str, tokens: list[int], finished: bool = False):
    return SimpleNamespace(request_id=rid, token_ids=tokens, output_token_ids=tokens[2:], is_finished=finished)


def test_proposer_drafts_what_an_earlier_request_wrote():
    proposer = SuffixProposer(1, 4, max_depth=16, max_cached_requests=1, max_spec_factor=2.0, min_token_prob=0.1)
    first = request("a", [50, 51, 10, 11, 12, 13, 14, 15])
    assert proposer.propose([first], [4]) == [[]]  # nothing cached, nothing repeats in it
    first.is_finished = True
    second = request("b", [60, 61, 10, 11])
    assert proposer.propose([second], [3]) == [[12, 13, 14]]  # from a's output (the match: 2 tokens)
    assert proposer.propose([second], [8]) == [[12, 13, 14, 15]]  # at most 2 x the match's length
    own = request("c", [11, 12, 13, 99, 11, 12, 13])  # its own "11 12 13" (3 tokens) beats a's (3): a tie
    assert proposer.propose([own], [2]) == [[99, 11]]
    second.is_finished = True
    proposer.propose([request("d", [1, 2])], [2])  # b replaces a in the cache of one request
    assert proposer.propose([request("e", [70, 14])], [2]) == [[]]  # a's "14 15" is gone; b has no 14


def test_a_long_output_joins_the_tree_a_few_starts_a_step():
    """Tree edits are spread over steps (EDIT_STARTS_PER_STEP starts each), in order: an output
    is added before it can be evicted, and a finished request never stalls a step."""
    from carpool.spec.suffix import EDIT_STARTS_PER_STEP as STARTS

    proposer = SuffixProposer(1, 4, max_depth=4, max_cached_requests=1, max_spec_factor=1.0, min_token_prob=0.1)
    long = request("a", [0, 0] + list(range(100, 100 + 3 * STARTS)))
    proposer.propose([long], [1])
    long.is_finished = True
    every_run = runs([long.output_token_ids], 4)
    for step in range(1, 4):  # the tokens are distinct: a run's first token is where it starts
        proposer.propose([], [])
        started = set(long.output_token_ids[:STARTS * step])
        assert tree_counts(proposer.tree) == {run: n for run, n in every_run.items() if run[0] in started}
    short = request("b", [0, 0, 7, 8])
    proposer.propose([short], [1])
    short.is_finished = True
    proposer.propose([], [])  # b is added, then a's runs start coming off: a one-request cache
    proposer.propose([], [])
    proposer.propose([], [])
    proposer.propose([], [])
    assert tree_counts(proposer.tree) == runs([[7, 8]], 4)

"""n-gram prompt lookup, against a plain reference implementation."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from carpool.spec.proposers import NgramProposer, ngram_lookup


def reference_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; something must follow
            if tokens[start:start + n] == suffix:
                out = list(tokens)
                for j in range(k):  # as if each guess were right: a repeating run goes on
                    out.append(out[start + n + j])
                return out[len(tokens):]
    return []


def test_longest_match_wins_over_a_later_shorter_one():
    tokens = [1, 2, 3, 4, 9, 3, 5, 2, 3]  # "2 3" occurs at 1 (then 4); "3" alone last at 5 (then 5)
    assert ngram_lookup(tokens, 2, 1, 4) == [4, 9]
    assert ngram_lookup(tokens, 2, 1, 1) == [5, 2]


def test_no_match_and_limits():
    assert ngram_lookup([1, 2, 3], 3, 1, 4) == []
    assert ngram_lookup([5, 6, 5], 0, 1, 4) == []
    assert ngram_lookup([5], 3, 1, 4) == []
    assert ngram_lookup([5, 6, 7, 5, 6], 3, 3, 4) == []  # only a 2-gram repeats


def test_ids_that_share_bytes_do_not_match_across_words():
    # 256 = 00 01 00 00 and 1 = 01 00 00 00: a byte search could match inside two words
    assert ngram_lookup([256, 1, 7, 1], 2, 1, 1) == [7, 1]
    assert ngram_lookup([3, 4, 3, 4, 3], 5, 1, 2) == [4, 3, 4, 3, 4]  # a loop goes on looping
    assert ngram_lookup([1 << 16, 1 << 8, 9, 1], 2, 1, 1) == []


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 3),
       st.integers(0, 3))
def test_equals_the_reference(tokens, k, min_n, extra):
    assert ngram_lookup(tokens, k, min_n, min_n + extra) == reference_lookup(tokens, k, min_n, min_n + extra)


def test_proposer_respects_each_limit():
    from carpool.request import Request
    from carpool.sampling_params import SamplingParams

    reqs = [Request(str(i), [1, 2, 3, 4, 1, 2], SamplingParams()) for i in range(2)]
    assert NgramProposer(1, 3).propose(reqs, [1, 3]) == [[3], [3, 4, 1]]

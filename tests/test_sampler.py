"""Sampler: greedy/random choice, top-k/top-p/min-p filtering, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from carpool.request import Request
from carpool.sampler import Sampler, apply_penalties, filter_top_k_top_p_min_p, mask_stops_before_min_tokens
from carpool.sampling_params import SamplingParams
from tests.helpers import examples

VOCAB = 16


def req(rid="r", prompt=(1, 2, 3), output=(), eos=frozenset({2}), **sp) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**sp), eos_token_ids=frozenset(eos))
    for t in output:
        r.append_token(t, 0.0)
    return r


def logits_from_probs(probs) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ------------------------------------------------------------------ greedy


@settings(max_examples=examples(50), deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6))
def test_greedy_is_argmax(seed, rows):
    logits = random_logits(rows, seed=seed)
    requests = [req(f"r{i}", temperature=0.0) for i in range(rows)]
    tokens, logprobs, _ = Sampler()(logits, requests)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * rows


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 10_000))
def test_top_k_one_equals_greedy(seed):
    logits = random_logits(4, seed=seed)
    greedy = Sampler(seed=1)(logits, [req(f"g{i}", temperature=0.0) for i in range(4)])[0]
    topk1 = Sampler(seed=2)(logits, [req(f"k{i}", temperature=1.5, top_k=1) for i in range(4)])[0]
    assert topk1 == greedy
    # The filter alone also leaves only the argmax.
    out = filter_top_k_top_p_min_p(logits, torch.ones(4, dtype=torch.long), torch.ones(4), torch.zeros(4))
    for i in range(4):
        assert kept(out[i]) == {int(logits[i].argmax())}


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 10_000), picked=st.lists(st.integers(0, 7), min_size=1, max_size=5),
       kinds=st.lists(st.sampled_from(["greedy", "random", "logprobs", "penalty"]), min_size=5, max_size=5))
def test_rows_picked_in_place_sample_as_the_gathered_rows(seed, picked, kinds):
    # The engine hands the sampler the step's logits and each request's row in them.
    logits = random_logits(8, seed=seed)
    params = {"greedy": {"temperature": 0.0}, "random": {"temperature": 0.8, "top_k": 5, "seed": 7},
              "logprobs": {"temperature": 0.0, "logprobs": 2}, "penalty": {"repetition_penalty": 1.3}}
    def requests():
        return [req(f"r{i}", output=(4,), **params[kind]) for i, kind in enumerate(kinds[:len(picked)])]
    copy = logits.clone()
    assert Sampler(seed=3)(logits, requests(), rows=picked) == Sampler(seed=3)(logits[picked], requests())
    assert torch.equal(logits, copy)


def test_sampler_does_not_modify_input_logits():
    logits = random_logits(2)
    copy = logits.clone()
    Sampler()(logits, [req("a", output=(4, 4), repetition_penalty=1.5, presence_penalty=1.0, min_tokens=3),
                       req("b", temperature=0.7, top_k=3)])
    assert torch.equal(logits, copy)


def test_half_precision_logits():
    logits = random_logits(3).half()
    tokens, _, _ = Sampler()(logits, [req(f"r{i}", temperature=0.0) for i in range(3)])
    assert tokens == logits.float().argmax(dim=-1).tolist()


# ------------------------------------------------------------------ filtering


def sample_support(logits_row: torch.Tensor, n: int = 400, **sp) -> set[int]:
    """Tokens drawn by the sampler for `n` copies of one row (shared sampler generator)."""
    logits = logits_row.expand(n, -1).clone()
    tokens, _, _ = Sampler(seed=123)(logits, [req(f"r{i}", **sp) for i in range(n)])
    return set(tokens)


def test_top_k_support():
    row = logits_from_probs([0.05, 0.2, 0.01, 0.3, 0.04, 0.25, 0.15])  # ranks: 3, 5, 1, 6, 0, 4, 2
    assert sample_support(row, top_k=3) == {3, 5, 1}
    assert sample_support(row, top_k=2) == {3, 5}
    assert sample_support(row, top_k=-1) == set(range(7))
    assert sample_support(row, top_k=0) == set(range(7))
    assert sample_support(row, top_k=100) == set(range(7))
    assert sample_support(row, top_k=2**70) == set(range(7))  # past int64 too: a client's number, not a crash


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = [0.15, 0.5, 0.05, 0.3]  # sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    row = logits_from_probs(probs)[None]

    def keep(p):
        return kept(filter_top_k_top_p_min_p(row, torch.tensor([-1]), torch.tensor([p]), torch.zeros(1))[0])

    assert keep(0.3) == {1}
    assert keep(0.49) == {1}
    assert keep(0.51) == {1, 3}
    assert keep(0.79) == {1, 3}
    assert keep(0.81) == {1, 3, 0}
    assert keep(0.94) == {1, 3, 0}
    assert keep(0.96) == {0, 1, 2, 3}
    assert keep(1.0) == {0, 1, 2, 3}
    # Sampling respects it too.
    assert sample_support(logits_from_probs(probs), top_p=0.79) == {1, 3}
    # top_k applies first and top_p works on the renormalised distribution: within the top 2
    # (0.5/0.8 = 0.625, 0.3/0.8 = 0.375), p=0.6 keeps only the first, p=0.7 both.
    f = filter_top_k_top_p_min_p(row.expand(2, -1), torch.tensor([2, 2]), torch.tensor([0.6, 0.7]),
                                 torch.zeros(2))
    assert kept(f[0]) == {1} and kept(f[1]) == {1, 3}


def test_default_filters_keep_whole_large_vocab():
    # top_p=1 must be a no-op even where float32 cumsum reaches 1.0 before the vocab's tail.
    logits = torch.randn(2, 32000, generator=torch.Generator().manual_seed(0)) * 8
    logits[1, 0] = 30.0
    out = filter_top_k_top_p_min_p(logits, torch.tensor([-1, 0]), torch.ones(2), torch.zeros(2))
    assert torch.equal(out, logits)


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = [0.15, 0.5, 0.05, 0.3]
    row = logits_from_probs(probs)[None]

    def keep(m):
        return kept(filter_top_k_top_p_min_p(row, torch.tensor([0]), torch.ones(1), torch.tensor([m]))[0])

    assert keep(0.0) == {0, 1, 2, 3}
    assert keep(0.09) == {0, 1, 2, 3}  # threshold 0.045
    assert keep(0.11) == {0, 1, 3}  # threshold 0.055
    assert keep(0.35) == {1, 3}  # threshold 0.175
    assert keep(0.61) == {1}  # threshold 0.305
    assert keep(1.0) == {1}  # the top token always stays
    assert sample_support(logits_from_probs(probs), min_p=0.35) == {1, 3}


def test_filter_keeps_values_of_kept_tokens():
    logits = random_logits(3, seed=5)
    out = filter_top_k_top_p_min_p(logits, torch.tensor([4, 0, 2]), torch.tensor([1.0, 0.7, 1.0]),
                                   torch.tensor([0.0, 0.0, 0.1]))
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])
    assert (out[~finite] == float("-inf")).all()
    assert finite.sum(dim=-1).ge(1).all()


def reference_keep(row: list[float], k: int, p: float, min_p: float) -> tuple[set[int], float]:
    """Float64 reference; also returns how close any decision was to its boundary."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    k = len(row) if k <= 0 else min(k, len(row))
    top = order[:k]
    m = max(row[i] for i in top)
    z = sum(math.exp(row[i] - m) for i in top)
    probs = [math.exp(row[i] - m) / z for i in top]
    keep, margin, before = set(), float("inf"), 0.0
    for rank, (i, q) in enumerate(zip(top, probs)):
        margin = min(margin, abs(before - p), abs(q - min_p * probs[0]))
        if rank == 0 or (before < p and q >= min_p * probs[0]):
            keep.add(i)
        before += q
    return keep, margin


@settings(max_examples=examples(150), deadline=None)
@given(
    vocab=st.integers(2, 24),
    data=st.data(),
    scale=st.floats(0.05, 3.0),
)
def test_filter_matches_reference(vocab, data, scale):
    rows = data.draw(st.integers(1, 4))
    logits, ks, ps, mps = [], [], [], []
    for _ in range(rows):
        perm = data.draw(st.permutations(range(vocab)))
        logits.append([v * scale for v in perm])  # distinct values: no ties in the ranking
        ks.append(data.draw(st.integers(-1, vocab + 2)))
        ps.append(data.draw(st.floats(0.01, 1.0)))
        mps.append(data.draw(st.floats(0.0, 1.0)))
    out = filter_top_k_top_p_min_p(torch.tensor(logits), torch.tensor(ks), torch.tensor(ps), torch.tensor(mps))
    for i in range(rows):
        expected, margin = reference_keep(logits[i], ks[i], ps[i], mps[i])
        assume(margin > 1e-4)  # float32 vs float64 may legitimately differ right at a boundary
        assert kept(out[i]) == expected, (logits[i], ks[i], ps[i], mps[i])


# ------------------------------------------------------------------ seeds


def seeded_sequence(seed: int, position: int, others: int, other_seed: int, steps: int = 15) -> list[int]:
    """Tokens a seeded request draws over `steps` calls, placed at row `position` among
    `others` unseeded (and differently seeded) requests with unrelated logits."""
    target = req("target", seed=seed, temperature=1.0)
    gen = torch.Generator().manual_seed(999)
    row = torch.randn(VOCAB, generator=gen)
    sampler = Sampler(seed=other_seed)
    out = []
    for step in range(steps):
        batch = [req(f"o{j}", temperature=0.8, seed=(other_seed + j if j % 2 else None), top_k=5)
                 for j in range(others)]
        other_logits = torch.randn(others, VOCAB, generator=torch.Generator().manual_seed(other_seed + step))
        batch.insert(position, target)
        logits = torch.cat([other_logits[:position], row[None], other_logits[position:]])
        tokens, _, _ = sampler(logits, batch)
        out.append(tokens[position])
    return out


def test_seed_reproducible_regardless_of_batch():
    alone = seeded_sequence(42, 0, 0, 0)
    assert seeded_sequence(42, 0, 3, 7) == alone
    assert seeded_sequence(42, 2, 3, 11) == alone
    assert seeded_sequence(42, 5, 5, 3) == alone
    assert seeded_sequence(43, 0, 0, 0) != alone  # another seed draws another sequence
    assert len(set(alone)) > 1  # actually random, not a constant


def test_seed_reproducible_with_greedy_rows_in_batch():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))

    def draw(extra_greedy: int) -> int:
        requests = [req(f"g{i}", temperature=0.0) for i in range(extra_greedy)] + [req("s", seed=5)]
        logits = torch.cat([random_logits(extra_greedy, seed=extra_greedy), row[None]])
        return Sampler(seed=extra_greedy)(logits, requests)[0][-1]

    first = draw(0)
    assert all(draw(n) == first for n in (1, 2, 4))


# ------------------------------------------------------------------ penalties


def test_repetition_penalty_hf_style_over_prompt_and_output():
    x = torch.tensor([[1.0, 2.0, -2.0, 4.0, -1.0, 3.0]])
    r = req(prompt=[1, 2, 1], output=[3, 3], repetition_penalty=2.0)
    apply_penalties(x, [r])
    # positive logits divided, negative multiplied, each seen token once; unseen unchanged
    assert x[0].tolist() == [1.0, 1.0, -4.0, 2.0, -1.0, 3.0]


def test_presence_and_frequency_over_output_only():
    x = torch.zeros(1, 6)
    r = req(prompt=[1, 2], output=[2, 3, 3, 3], presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(x, [r])
    expected = [0.0, 0.0, -(0.25 * 1 + 0.5), -(0.25 * 3 + 0.5), 0.0, 0.0]
    assert x[0].tolist() == pytest.approx(expected)


def test_negative_presence_penalty_rewards_and_no_output_no_effect():
    x = torch.zeros(2, 4)
    a = req("a", prompt=[1], output=[2], presence_penalty=-1.0)
    b = req("b", prompt=[1, 2, 3], presence_penalty=2.0, frequency_penalty=2.0)
    apply_penalties(x, [a, b])
    assert x[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert x[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_penalties_only_touch_their_own_row():
    x = torch.ones(3, 5)
    rows = [req("a", output=[4], frequency_penalty=1.0), req("b", output=[4]),
            req("c", prompt=[0], repetition_penalty=4.0)]
    apply_penalties(x, rows)
    assert x[0].tolist() == [1, 1, 1, 1, 0]
    assert x[1].tolist() == [1, 1, 1, 1, 1]
    assert x[2].tolist() == [0.25, 1, 1, 1, 1]


@settings(max_examples=examples(80), deadline=None)
@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    output=st.lists(st.integers(0, 9), max_size=8),
    rep=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    pres=st.sampled_from([0.0, -1.0, 0.7, 2.0]),
    freq=st.sampled_from([0.0, -0.5, 0.3, 1.5]),
    seed=st.integers(0, 1000),
)
def test_penalties_match_reference(prompt, output, rep, pres, freq, seed):
    x = random_logits(1, vocab=10, seed=seed)
    expected = x[0].tolist()
    for t in set(prompt) | set(output):
        expected[t] = expected[t] / rep if expected[t] > 0 else expected[t] * rep
    for t in set(output):
        expected[t] -= freq * output.count(t) + pres
    apply_penalties(x, [req(prompt=prompt, output=output, repetition_penalty=rep, presence_penalty=pres,
                            frequency_penalty=freq)])
    assert x[0].tolist() == pytest.approx(expected, abs=1e-5)


def test_greedy_with_penalty_changes_choice():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    r = req(prompt=[0], output=[1], temperature=0.0, repetition_penalty=1.2)
    assert Sampler()(logits, [r])[0] == [2]
    r = req(prompt=[0], output=[1], temperature=0.0)
    assert Sampler()(logits, [r])[0] == [1]


# ------------------------------------------------------------------ min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.5, 8.0]])  # EOS 2 and stop id 5 dominate
    r = req(prompt=[0], eos={2}, stop_token_ids=[5], min_tokens=2, max_tokens=5, temperature=0.0)
    assert Sampler()(logits, [r])[0] == [3]
    r.append_token(3, 0.0)
    assert Sampler()(logits, [r])[0] == [3]
    r.append_token(3, 0.0)
    assert Sampler()(logits, [r])[0] == [2]  # two outputs: EOS allowed again


def test_min_tokens_with_ignore_eos_still_masks_stop_ids():
    x = torch.zeros(1, 6)
    r = req(eos={2}, stop_token_ids=[5], min_tokens=1, ignore_eos=True)
    mask_stops_before_min_tokens(x, [r])
    assert x[0].tolist() == [0, 0, 0, 0, 0, float("-inf")]
    x = torch.zeros(1, 6)
    r = req(eos={2, 4}, stop_token_ids=[5], min_tokens=1)
    mask_stops_before_min_tokens(x, [r])
    assert kept(x[0]) == {0, 1, 3}


def test_min_tokens_masks_for_random_sampling():
    row = logits_from_probs([0.02, 0.02, 0.9, 0.02, 0.02, 0.02])
    assert 2 not in sample_support(row, min_tokens=1, temperature=1.0)
    assert 2 in sample_support(row, min_tokens=0, temperature=1.0)


# ------------------------------------------------------------------ logprobs


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 6), temperature=st.sampled_from([0.0, 0.7, 1.0]))
def test_logprobs_are_raw_log_softmax(seed, n, temperature):
    logits = random_logits(3, seed=seed)
    requests = [req("a", output=[1, 1], logprobs=n, temperature=temperature, repetition_penalty=1.7,
                    frequency_penalty=0.5),
                req("b", logprobs=None, temperature=temperature),
                req("c", logprobs=n, temperature=temperature, seed=seed)]
    tokens, logprobs, _ = Sampler(seed=seed)(logits, requests)
    raw = logits.log_softmax(dim=-1)
    assert logprobs[1] is None
    for i in (0, 2):
        entry = logprobs[i]
        assert tokens[i] in entry
        top = set(raw[i].topk(n).indices.tolist()) if n else set()
        assert set(entry) == top | {tokens[i]}
        assert len(entry) in (n, n + 1)
        for t, v in entry.items():
            assert v.logprob == pytest.approx(raw[i, t].item(), abs=1e-6)
            assert v.rank == int((raw[i] > raw[i, t]).sum()) + 1  # 1 = the most likely
        assert all(v.logprob <= 0 for v in entry.values())


# ------------------------------------------------------------------ failures stay in their row


@pytest.mark.parametrize("poison", [{"temperature": float("nan")}, {"repetition_penalty": 1e-45},
                                    {"repetition_penalty": 0.0}])
def test_a_row_whose_numbers_go_bad_fails_alone(poison):
    """Parameters past validation (set after construction) must fail only their own row."""
    logits = random_logits(3, seed=5)
    requests = [req("a", temperature=0.7, seed=1), req("bad", temperature=0.7), req("c", temperature=0.0)]
    for name, value in poison.items():
        setattr(requests[1].sampling_params, name, value)
    tokens, _, errors = Sampler(seed=0)(logits, requests)
    assert errors[0] is None and errors[2] is None
    assert tokens[1] is None and "sampling failed" in errors[1]
    assert tokens[2] == int(logits[2].argmax())
    alone = Sampler(seed=0)(logits[[0]], [req("a", temperature=0.7, seed=1)])[0]
    assert tokens[0] == alone[0]  # the seeded neighbour draws what it draws alone


def test_nan_logits_fail_only_their_row():
    logits = random_logits(2, seed=1)
    logits[0, 3] = float("nan")
    tokens, _, errors = Sampler()(logits, [req("x", temperature=0.0), req("y", temperature=0.0)])
    assert tokens[0] is None and errors[0] and tokens[1] == int(logits[1].argmax()) and errors[1] is None

"""Paged attention's SDPA calls against a naive fp64 softmax written out row by row."""

from __future__ import annotations

import pytest
import torch

from carpool.model.attention import (SDPA_ROWS, AttentionMetadata, PrefillChunk, causal_attention, chunk_attention,
                                     decode_attention, decode_runs, paged_attention, query_runs)

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 16, 16


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int, scale: float) -> torch.Tensor:
    """q: [n, heads, D] at positions first_position..; k, v: [>= first_position + n, kv_heads, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    rows = []
    for i in range(q.shape[0]):
        keys = first_position + i + 1  # causal: itself and everything before it
        scores = torch.einsum("hd,chd->hc", q[i].double(), k[:keys]) * scale
        rows.append(torch.einsum("hc,chd->hd", scores.softmax(-1), v[:keys]))
    return torch.stack(rows).to(q.dtype)


@pytest.mark.parametrize("n, cached", [(1, 40), (31, 0), (33, 17), (100, 200), (7, 5)])
def test_chunk_attention_over_a_cached_prefix(n, cached):
    gen = torch.Generator().manual_seed(n + cached)
    width = -(-(cached + n) // BLOCK) * BLOCK  # whole blocks, the tail padded as in the runner
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k, v = torch.randn(width, KV_HEADS, DIM, generator=gen), torch.randn(width, KV_HEADS, DIM, generator=gen)
    mask = torch.arange(width)[None, :] <= torch.arange(cached, cached + n)[:, None]
    got = chunk_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(got, naive(q, k, v, cached, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, SDPA_ROWS - 1, SDPA_ROWS, SDPA_ROWS + 1, 100])
def test_causal_attention_padded_to_whole_row_groups(n):
    """The padding (keys after every real query, queries dropped) changes nothing."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k, v = torch.randn(n, KV_HEADS, DIM, generator=gen), torch.randn(n, KV_HEADS, DIM, generator=gen)
    got = causal_attention(q, k, v, 0.25)
    assert got.shape == q.shape
    torch.testing.assert_close(got, naive(q, k, v, 0, 0.25), rtol=1e-5, atol=1e-5)


def test_decode_attention_over_padded_block_tables():
    """Decodes of different context lengths in one call: tables padded with a zeroed block, the
    mask cutting each row at its own length."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, lens = 12, [1, 16, 17, 45]
    cache = torch.randn(2, (num_blocks + 1) * BLOCK, KV_HEADS, DIM, generator=gen)
    cache[:, num_blocks * BLOCK:] = 0  # the pad block
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in lens:
        used = -(-n // BLOCK)
        tables.append(perm[start:start + used])
        start += used
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [num_blocks] * (width - len(t)) for t in tables])
    mask = (torch.arange(width * BLOCK)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    q = torch.randn(len(lens), HEADS, DIM, generator=gen)
    got = decode_attention(q, cache, padded, mask, 0.25, BLOCK)
    for row, (table, n) in enumerate(zip(tables, lens)):
        slots = (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
        k, v = cache[0, slots], cache[1, slots]
        torch.testing.assert_close(got[row:row + 1], naive(q[row:row + 1], k, v, n - 1, 0.25), rtol=1e-5, atol=1e-5)


def test_decode_runs_group_a_requests_rows():
    a, b = [3, 4], [5]
    assert decode_runs([a, a, a, b, a], [30, 31, 32, 7, 9]) == [(0, 3), (3, 1), (4, 1)]
    assert decode_runs([a, [3, 4]], [30, 30]) == [(0, 1), (1, 1)]  # same table, not consecutive tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_chunk", [False, True])
def test_decodes_with_drafts_as_runs_equal_their_rows_one_by_one(dtype, with_chunk):
    """A decode with k drafts is k + 1 rows over one context: attended as one run (its context
    read once), each row equals what it gets attended alone, bit for bit; the cache gets the same
    k, v either way."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, pad = 40, 40
    contexts, drafts = [37, 5, 100], [3, 0, 5]  # tokens cached before the step; drafts per request
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx, k in zip(contexts, drafts):
        n = -(-(ctx + 1 + k) // BLOCK)
        tables.append(perm[used:used + n])
        used += n
    decode_tables, decode_lens, slots = [], [], []
    for table, ctx, k in zip(tables, contexts, drafts):
        for j in range(k + 1):
            decode_tables.append(table)
            decode_lens.append(ctx + 1 + j)
            slots.append(table[(ctx + j) // BLOCK] * BLOCK + (ctx + j) % BLOCK)
    nd = len(decode_lens)
    prefills, chunk = [], []
    if with_chunk:  # a 12-token chunk over 20 cached tokens, after the decodes
        table = perm[used:used + 2]
        mask = torch.arange(len(table) * BLOCK)[None, :] <= torch.arange(20, 32)[:, None]
        prefills = [PrefillChunk(nd, nd + 12, torch.tensor(table), mask)]
        chunk = [(nd, nd + 12, 20, table)]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(20, 32)]
    tokens = len(slots)
    cache = torch.randn(2, (num_blocks + 1) * BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    cache[:, pad * BLOCK:] = 0
    q = torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    width = max(len(t) for t in decode_tables)

    def meta(as_runs: bool) -> AttentionMetadata:
        m = AttentionMetadata(torch.tensor(slots), BLOCK, nd,
                              torch.tensor([t + [pad] * (width - len(t)) for t in decode_tables]),
                              torch.tensor(decode_lens), None, prefills)
        if as_runs:
            runs = decode_runs(decode_tables, decode_lens)
            assert len(runs) == len(contexts)
            m.runs = query_runs(decode_tables, decode_lens, chunk, pad, torch.device("cpu"), runs)
            m.num_decode_runs = len(runs)
        return m

    one_by_one, grouped = cache.clone(), cache.clone()
    want = paged_attention(q, k, v, one_by_one, meta(False), 0.25)
    got = paged_attention(q, k, v, grouped, meta(True), 0.25)
    assert torch.equal(got, want)
    assert torch.equal(grouped, one_by_one)

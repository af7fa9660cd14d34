"""Paged attention's SDPA calls against a naive fp64 softmax written out row by row."""

from __future__ import annotations

import pytest
import torch

from carpool.model.attention import chunk_attention, decode_attention

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

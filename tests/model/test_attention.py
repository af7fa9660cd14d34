"""Chunk attention over a cached prefix (tiled grouped-head matmuls) against SDPA with a mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from carpool.model.attention import chunk_attention


@pytest.mark.parametrize("n, cached, tile", [(1, 40, 32), (31, 0, 32), (33, 17, 32), (100, 200, 32), (100, 5, 7)])
def test_chunk_attention_equals_masked_sdpa(n, cached, tile):
    heads, kv_heads, dim, block = 9, 3, 16, 16
    gen = torch.Generator().manual_seed(n + cached)
    width = -(-(cached + n) // block) * block  # whole blocks, the tail padded as in the runner
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = torch.randn(width, kv_heads, dim, generator=gen), torch.randn(width, kv_heads, dim, generator=gen)
    mask = torch.arange(width)[None, :] <= torch.arange(cached, cached + n)[:, None]
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], attn_mask=mask, scale=0.25,
                                              enable_gqa=True)[0].transpose(0, 1)
    got = chunk_attention(q, k, v, mask, cached, 0.25, tile=tile)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

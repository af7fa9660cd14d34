"""Paged attention over a block-addressed KV cache.

The batch's tokens are laid out decodes first (one token each), then one chunk per prefilling
sequence. Decodes share one batched attention over their gathered contexts; each prefill chunk
runs one SDPA call with a causal mask offset by the tokens already cached. Block tables and
masks are built once per step and shared by every layer.

Contexts are gathered whole blocks at a time (a 16-token block is one contiguous run of memory;
gathering slot by slot was 15x slower), and decode attention is two batched matmuls with the
query heads grouped per KV head: for one query token that is ~5x faster on CPU than SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat token matrix
    end: int
    block_table: torch.Tensor | None  # blocks holding cached + chunk tokens; None if nothing cached
    mask: torch.Tensor | None  # [chunk, blocks * block_size] bool; None: plain causal over the chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot written by each token
    block_size: int
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with a zeroed block
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache: [num_slots, kv_heads, D]; block_table: [..., n] -> [..., n * block_size, kv_heads, D]."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])
    out = blocks.index_select(0, block_table.reshape(-1))
    return out.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, *cache.shape[1:])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [B, heads, D]; k, v: [B, ctx, kv_heads, D]; mask: [B, 1, 1, ctx] -> [B, heads, D]."""
    b, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.view(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(qg, k.transpose(1, 2).contiguous().transpose(-1, -2)).float()
    scores.mul_(scale).masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2).contiguous()).view(b, heads, dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D] for this step's tokens; cache: [2, slots,
    kv_heads, D]. Writes k, v into the cache and returns [T, heads, D]."""
    cache[0].index_copy_(0, meta.slot_mapping, k)
    cache[1].index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd, bs = meta.num_decodes, meta.block_size
    if nd:
        kc = gather_blocks(cache[0], meta.decode_block_tables, bs)
        vc = gather_blocks(cache[1], meta.decode_block_tables, bs)
        out[:nd] = decode_attention(q[:nd], kc, vc, meta.decode_mask, scale)
    for p in meta.prefills:
        qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.block_table is None:
            ks, vs = k[p.start:p.end], v[p.start:p.end]
        else:
            ks, vs = gather_blocks(cache[0], p.block_table, bs), gather_blocks(cache[1], p.block_table, bs)
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True,
        )
        out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
    return out

"""Paged attention over a flat slot-addressed KV cache.

The batch's tokens are laid out decodes first (one token each), then one chunk per prefilling
sequence. Decodes share one batched SDPA call over their gathered, padded contexts; each prefill
chunk runs its own SDPA call with a causal mask offset by the tokens already cached. The gather
indices and masks are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat token matrix
    end: int
    num_cached: int  # tokens of this sequence whose KV was already in the cache
    context_slots: torch.Tensor | None  # slots of all num_cached + chunk tokens; None if nothing cached
    mask: torch.Tensor | None  # [chunk, context] bool, None when plain causal suffices


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot written by each token
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] slots to gather (padded)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool
    prefills: list[PrefillChunk]


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """cache: [2, num_slots, kv_heads, head_dim]."""
    cache[0].index_copy_(0, slot_mapping, k)
    cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D] for this step's tokens. Returns [T, heads, D]."""
    write_kv(cache, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        kc = cache[0][meta.decode_slots].transpose(1, 2)  # [nd, kvh, ctx, D]
        vc = cache[1][meta.decode_slots].transpose(1, 2)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), kc, vc, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        ).squeeze(2)
    for p in meta.prefills:
        qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.context_slots is None:
            ks, vs = k[p.start:p.end], v[p.start:p.end]
        else:
            ks, vs = cache[0][p.context_slots], cache[1][p.context_slots]
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True,
        )
        out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
    return out

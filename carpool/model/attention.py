"""Paged attention over a block-addressed KV cache.

The batch's tokens are laid out decodes first (one token each), then one chunk per prefilling
sequence. On CPU the decodes are one call of a C kernel that writes their new k, v to the cache
and reads their blocks in place (model/csrc/cpu_kernels.c: 1.5-3.7x faster than SDPA over
gathered blocks, which remains the path elsewhere: one masked SDPA call over the decodes'
gathered contexts). A prefill chunk
with nothing cached is one causal SDPA call, and one with a cached prefix one SDPA call over
the prefix and itself, with a causal mask offset by the tokens already cached. Block tables and
masks are built once per step and shared by every layer.

Contexts are gathered whole blocks at a time (a 16-token block is one contiguous run of memory;
gathering slot by slot was 15x slower). torch 2.13's CPU SDPA (flash, GQA in the kernel) beat
the two batched matmuls with the query heads grouped per KV head that carpool used before, at
every shape measured: 1.4-2.0x for decodes, 3.5-4.5x for chunks over a cached prefix in bf16
(1.3-2.3x in fp32), timed call against call on the same gathered blocks. Its time jumps
between neighbouring query counts, so chunks are padded to a multiple of SDPA_ROWS queries
(`padded_rows`).

Gemma's layers need what neither the C kernel nor SDPA's causal flag gives: a sliding window
(a query sees only its last `window` keys) and tanh soft-capped logits (Gemma 2).
`masked_paged_attention` does both with torch ops over gathered blocks, every sequence under an
explicit mask; its masks are built once per step (per window) and shared by every layer. A
sliding layer gathers only the blocks its window reaches, so its cost stays that of the window
however long the context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from carpool.model.cpu_kernels import paged_attention_runs, paged_decode_attention

# torch 2.13's CPU flash attention runs some query counts far slower than the next multiple of 16:
# a causal chunk of the embedded model's heads (9 x 64, bf16, 2 threads) took 1.29 ms at 511
# queries and 0.86 ms at 512, 1.83 at 501 and 0.91 at 504; over a 512-token prefix 2.72 ms at 511
# queries and 2.12 at 512. A chunk of 511 is common: a 512-token budget with one decode beside it.
SDPA_ROWS = 16


def padded_rows(n: int) -> int:
    return -(-n // SDPA_ROWS) * SDPA_ROWS


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat token matrix
    end: int
    block_table: torch.Tensor | None  # blocks holding cached + chunk tokens; None if nothing cached
    mask: torch.Tensor | None  # [chunk, blocks * block_size] bool; None: plain causal over the chunk


@dataclass
class QueryRuns:
    """A step's tokens as runs of consecutive queries of one sequence, each over its sequence's
    context (csrc/cpu_kernels.c `paged_attention_runs`, which reads each cached K and V row once
    for all of a run's queries): a decode is a run of one, a decode with k drafts a run of
    k + 1; a prefill chunk is split into runs of up to RUN_TOKENS, so its queries spread over the
    threads."""

    block_tables: torch.Tensor  # [runs, max_blocks] int64, padded with a zeroed block
    context_lens: torch.Tensor  # [runs] int64: tokens the run's last query sees, itself included
    query_starts: torch.Tensor  # [runs + 1] int64: run r is tokens query_starts[r]..query_starts[r + 1] - 1


RUN_TOKENS = 8


def decode_runs(decode_tables: list[list[int]], decode_lens: list[int]) -> list[tuple[int, int]]:
    """(first row, rows) of each sequence's decode rows: a decode with drafts is rows over one
    block table whose contexts grow by one (runner.plan lays them out so)."""
    runs: list[tuple[int, int]] = []
    for i, (table, length) in enumerate(zip(decode_tables, decode_lens)):
        if runs and length == decode_lens[i - 1] + 1 and table == decode_tables[i - 1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def query_runs(decode_tables: list[list[int]], decode_lens: list[int],
               prefills: list[tuple[int, int, int, list[int]]], pad_block: int, device: torch.device,
               decodes: list[tuple[int, int]] | None = None) -> QueryRuns:
    """QueryRuns of a step laid out decodes first, then chunks (row, end row, cached tokens, table).
    decodes: `decode_runs` of the decodes, where the caller has it."""
    tables, lens, starts = [], [], []
    for first, rows in decode_runs(decode_tables, decode_lens) if decodes is None else decodes:
        tables.append(decode_tables[first])
        lens.append(decode_lens[first + rows - 1])
        starts.append(first)
    for row, end, cached, table in prefills:
        for first in range(row, end, RUN_TOKENS):
            tables.append(table)
            lens.append(cached + min(end, first + RUN_TOKENS) - row)
            starts.append(first)
    starts.append(prefills[-1][1] if prefills else len(decode_tables))
    width = max(len(t) for t in tables)
    padded = [t + [pad_block] * (width - len(t)) for t in tables]
    return QueryRuns(torch.tensor(padded, device=device), torch.tensor(lens, device=device),
                     torch.tensor(starts, device=device))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot written by each token
    block_size: int
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with a zeroed block
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64, each one's new token included
    # [num_decodes, 1, 1, max_blocks * block_size] bool, for SDPA over gathered blocks; None when
    # the C kernel (model/cpu_kernels.py) reads the blocks in place instead.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    longest_context: int = 0  # the most keys any query of the step sees, its own included
    # The whole step as query runs, for the fused layers (model/fused_layers.py) and, where
    # decodes carry drafts, for every path's decode attention (so a request's k + 1 rows read
    # its context once, not k + 1 times); None where the runner did not build them (decodes of
    # one row each need none, nor hybrid steps the fused path skips).
    runs: QueryRuns | None = None
    num_decode_runs: int = 0  # the first runs of `runs`: the decodes'
    # masked_paged_attention's masks by window (None: causal only), built at the first layer.
    masks: dict[int | None, StepMasks] = field(default_factory=dict, repr=False)
    # Each local layer's metadata where sliding-window layers read tables of their own
    # (model_runner.KVLayout); None: this one for every layer.
    per_layer: list[AttentionMetadata] | None = field(default=None, repr=False)


@dataclass
class StepMasks:
    """The blocks a step's queries read under one window and their masks, True where a query may
    look: decodes over their tables' blocks from the first their window reaches, prefill chunks
    likewise (or over themselves, with nothing cached)."""

    decode_tables: torch.Tensor | None  # [num_decodes, blocks]
    decodes: torch.Tensor | None  # [num_decodes, 1, 1, blocks * block_size]
    chunk_tables: list[torch.Tensor | None]  # per prefill chunk; None: the chunk alone
    chunks: list[torch.Tensor]  # [chunk, keys] per prefill chunk


# An attention kernel: (q, k, v, one layer's cache, metadata, scale) -> [T, heads, D]. The model
# runs `paged_attention`; the profiler (sim/profile.py) passes a stand-in to time the rest.
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float],
                    torch.Tensor]


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache: [num_slots, kv_heads, D]; block_table: [..., n] -> [..., n * block_size, kv_heads, D]."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])
    out = blocks.index_select(0, block_table.reshape(-1))
    return out.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, *cache.shape[1:])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One prefill chunk with nothing cached before it. q: [n, heads, D]; k, v: [n, kv_heads, D]
    -> [n, heads, D]. Padded at the end to `padded_rows(n)`: a padded key comes after every real
    query, so causality hides it."""
    n = len(q)
    if (pad := padded_rows(n) - n):
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o[0, :, :n].transpose(0, 1)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """One prefill chunk over its cached prefix and itself. q: [n, heads, D]; k, v: [ctx,
    kv_heads, D]; mask: [n, ctx] bool -> [n, heads, D]. Padded to `padded_rows(n)` queries, which
    see every key (a row with none would be NaN) and are dropped."""
    n = len(q)
    if (pad := padded_rows(n) - n):
        q, mask = F.pad(q, (0, 0, 0, 0, 0, pad)), F.pad(mask, (0, 0, 0, pad), value=True)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask[None, None], scale=scale, enable_gqa=True)
    return o[0, :, :n].transpose(0, 1)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor,
                     scale: float, block_size: int) -> torch.Tensor:
    """Decodes over their cached contexts. q: [B, heads, D]; cache: [2, slots, kv_heads, D];
    block_tables: [B, max_blocks]; mask: [B, 1, 1, max_blocks * block_size] -> [B, heads, D]."""
    k = gather_blocks(cache[0], block_tables, block_size).transpose(1, 2)  # [B, kv_heads, ctx, D]
    v = gather_blocks(cache[1], block_tables, block_size).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def slide(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """A causal mask ([..., queries, keys], a query's row True for keys 0..its position) cut to
    each query's last `window` keys, itself included (transformers' and llama.cpp's sliding window)."""
    if window is None:
        return mask
    position = mask.sum(-1, keepdim=True) - 1
    return mask & (torch.arange(mask.shape[-1], device=mask.device) > position - window)


def step_masks(meta: AttentionMetadata, window: int | None) -> StepMasks:
    if window not in meta.masks:
        bs, device = meta.block_size, meta.slot_mapping.device
        tables = decodes = None
        if meta.num_decodes:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            first = torch.zeros_like(lens)  # each decode's first block read
            if window is not None:  # a window of w keys spans at most ceil(w / bs) + 1 blocks
                first = (lens - window).clamp(min=0) // bs
                width = min(tables.shape[1], -(-window // bs) + 1)
                # Columns past a row's table repeat its last block (its own or the zeroed pad
                # block): finite, and past the row's length, so masked.
                cols = (first[:, None] + torch.arange(width, device=device)).clamp(max=tables.shape[1] - 1)
                tables = tables.gather(1, cols)
            keys = first[:, None] * bs + torch.arange(tables.shape[1] * bs, device=device)  # key positions
            decodes = keys < lens[:, None]
            if window is not None:
                decodes &= keys >= lens[:, None] - window
            decodes = decodes[:, None, None, :]
        chunk_tables, chunks = [], []
        for p in meta.prefills:
            if p.mask is None:
                n = p.end - p.start
                chunk_tables.append(None)
                chunks.append(slide(torch.ones(n, n, dtype=torch.bool, device=device).tril(), window))
                continue
            mask = slide(p.mask, window)
            first = 0 if window is None else max(0, int(p.mask[0].sum()) - window) // bs  # the chunk's first query
            chunk_tables.append(p.block_table[first:])
            chunks.append(mask[:, first * bs:])
        meta.masks[window] = StepMasks(tables, decodes, chunk_tables, chunks)
    return meta.masks[window]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float | None) -> torch.Tensor:
    """q: [B, heads, n, D]; k, v: [B, kv_heads, ctx, D]; mask: [B or 1, 1, n, ctx] bool ->
    [B, heads, n, D]. With a soft-cap, transformers' eager arithmetic (fp32 softmax)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def masked_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None
                           ) -> torch.Tensor:
    """paged_attention with a sliding window and/or soft-capped logits, over the same cache and
    metadata (decodes' masks are built here: the C decode kernel's steps come without one)."""
    cache[0].index_copy_(0, meta.slot_mapping, k)
    cache[1].index_copy_(0, meta.slot_mapping, v)
    masks = step_masks(meta, window)
    out = torch.empty_like(q)
    nd, bs = meta.num_decodes, meta.block_size
    if nd:
        ks = gather_blocks(cache[0], masks.decode_tables, bs).transpose(1, 2)  # [B, kv_heads, ctx, D]
        vs = gather_blocks(cache[1], masks.decode_tables, bs).transpose(1, 2)
        out[:nd] = masked_attention(q[:nd, :, None], ks, vs, masks.decodes, scale, softcap)[:, :, 0]
    for p, table, mask in zip(meta.prefills, masks.chunk_tables, masks.chunks):
        if table is None:  # nothing cached: the chunk over itself
            ks, vs = k[p.start:p.end], v[p.start:p.end]
        else:
            ks, vs = gather_blocks(cache[0], table, bs), gather_blocks(cache[1], table, bs)
        o = masked_attention(q[p.start:p.end].transpose(0, 1)[None], ks.transpose(0, 1)[None],
                             vs.transpose(0, 1)[None], mask[None, None], scale, softcap)
        out[p.start:p.end] = o[0].transpose(0, 1)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D] for this step's tokens; cache: [2, slots,
    kv_heads, D]. Writes k, v into the cache and returns [T, heads, D]."""
    nd, bs = meta.num_decodes, meta.block_size
    in_place = nd and meta.decode_mask is None  # the C kernels: they read the decodes' blocks in place
    if in_place and meta.num_decode_runs:  # decodes with drafts: a run per request
        runs, r = meta.runs, meta.num_decode_runs
        decoded = paged_attention_runs(q[:nd], k[:nd], v[:nd], cache, runs.block_tables[:r], runs.context_lens[:r],
                                       runs.query_starts[:r + 1], meta.slot_mapping[:nd], scale, bs)
        if nd == len(q):
            return decoded
    elif in_place and nd == len(q):  # decodes only: no slicing (each slice costs ~1 us)
        out = torch.empty_like(q)
        paged_decode_attention(q, cache, meta.decode_block_tables, meta.decode_context_lens, scale, bs, out,
                               (k, v, meta.slot_mapping))
        return out
    out = torch.empty_like(q)
    if in_place:  # the kernels write the decodes' k, v themselves
        cache[0].index_copy_(0, meta.slot_mapping[nd:], k[nd:])
        cache[1].index_copy_(0, meta.slot_mapping[nd:], v[nd:])
        if meta.num_decode_runs:
            out[:nd] = decoded
        else:
            paged_decode_attention(q[:nd], cache, meta.decode_block_tables, meta.decode_context_lens, scale, bs,
                                   out[:nd], (k[:nd], v[:nd], meta.slot_mapping[:nd]))
    else:
        cache[0].index_copy_(0, meta.slot_mapping, k)
        cache[1].index_copy_(0, meta.slot_mapping, v)
    if nd and meta.decode_mask is not None:
        out[:nd] = decode_attention(q[:nd], cache, meta.decode_block_tables, meta.decode_mask, scale, bs)
    for p in meta.prefills:
        if p.block_table is None:  # nothing cached: plain causal attention over the chunk
            out[p.start:p.end] = causal_attention(q[p.start:p.end], k[p.start:p.end], v[p.start:p.end], scale)
        else:
            ks, vs = gather_blocks(cache[0], p.block_table, bs), gather_blocks(cache[1], p.block_table, bs)
            out[p.start:p.end] = chunk_attention(q[p.start:p.end], ks, vs, p.mask, scale)
    return out

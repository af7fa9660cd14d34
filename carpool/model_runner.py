"""Turn a scheduled batch into tensors, run the model once over all its tokens, return logits."""

from __future__ import annotations

import numpy as np
import torch

from carpool.config import ModelConfig
from carpool.core.block_manager import blocks_for
from carpool.core.scheduler import ScheduledBatch
from carpool.model.attention import AttentionMetadata, PrefillChunk
from carpool.model.llama import LlamaModel, can_pack_linears, pack_linears_for_cpu


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, num_layers: int | None = None,
                       tp_size: int = 1) -> int:
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * (config.num_kv_heads // tp_size) * config.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.model = model
        if can_pack_linears(device, dtype):
            pack_linears_for_cpu(model)
        self.block_size = block_size
        self.device = device
        attn = model.layers[0].self_attn
        # [layers, K/V, slots, kv_heads, head_dim]: a slot is one token's KV in one layer; block b
        # is slots [b * block_size, (b + 1) * block_size). Slots are written before they are read,
        # so the cache starts uninitialised (fast), except one extra zeroed block at the end that
        # padded block tables point at.
        self.pad_block = num_blocks
        self.kv_cache = torch.empty(model.num_local_layers, 2, (num_blocks + 1) * block_size,
                                    attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        self.kv_cache[:, :, num_blocks * block_size:].zero_()

    def slots_for(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids and positions, attention metadata, and the row of each request's last
        token (the rows whose logits are sampled, for requests whose prompt is now complete)."""
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        dev, bs = self.device, self.block_size
        for req, n in zip(batch.requests, batch.num_tokens):
            start = req.num_computed_tokens
            ctx = start + n
            row = len(ids)
            ids.extend(req.token_ids[start:ctx])
            positions.append(np.arange(start, ctx))
            slots.append(self.slots_for(req.block_ids, start, ctx))
            if req.is_decode:
                decode_tables.append(req.block_ids[:blocks_for(ctx, bs)])
                decode_lens.append(ctx)
            elif start == 0:
                prefills.append(PrefillChunk(row, row + n, None, None))
            else:
                table = req.block_ids[:blocks_for(ctx, bs)]
                mask = torch.arange(len(table) * bs)[None, :] <= torch.arange(start, ctx)[:, None]
                prefills.append(PrefillChunk(row, row + n, torch.tensor(table, device=dev), mask.to(dev)))
            if ctx == req.num_tokens:
                sample_rows.append(row + n - 1)

        tables = mask = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [self.pad_block] * (width - len(t)) for t in decode_tables], device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_size=bs,
            num_decodes=len(decode_tables),
            decode_block_tables=tables,
            decode_mask=mask,
            prefills=prefills,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.from_numpy(np.concatenate(positions)).to(dev)
        return input_ids, pos, meta, sample_rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the batch; logits [num_ready_requests, vocab] in batch order."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if not sample_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[sample_rows])

"""Turn a scheduled batch into tensors, run the model once over all its tokens, return logits."""

from __future__ import annotations

import numpy as np
import torch

from carpool.config import ModelConfig
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
        # [layers, K/V, slots, kv_heads, head_dim]: a slot is one token's KV in one layer. Slots
        # are written before they are read, so the cache starts uninitialised (fast), except one
        # extra zeroed slot at the end that padded decode contexts point at.
        self.pad_slot = num_blocks * block_size
        self.kv_cache = torch.empty(model.num_local_layers, 2, self.pad_slot + 1,
                                    attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        self.kv_cache[:, :, self.pad_slot].zero_()

    def _slots(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids and positions, attention metadata, and the row of each request's last
        token (the rows whose logits are sampled, for requests whose prompt is now complete)."""
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        decode_ctx: list[np.ndarray] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        dev = self.device
        for req, n in zip(batch.requests, batch.num_tokens):
            start = req.num_computed_tokens
            row = len(ids)
            ids.extend(req.token_ids[start:start + n])
            positions.append(np.arange(start, start + n))
            slots.append(self._slots(req.block_ids, start, start + n))
            if req.is_decode:
                decode_ctx.append(self._slots(req.block_ids, 0, start + 1))
            elif start == 0:
                prefills.append(PrefillChunk(row, row + n, 0, None, None))
            else:
                ctx = start + n
                mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
                prefills.append(PrefillChunk(row, row + n, start,
                                             torch.from_numpy(self._slots(req.block_ids, 0, ctx)).to(dev),
                                             mask.to(dev)))
            if start + n == req.num_tokens:
                sample_rows.append(row + n - 1)

        decode_slots = decode_mask = None
        if decode_ctx:
            width = max(len(c) for c in decode_ctx)
            padded = np.full((len(decode_ctx), width), self.pad_slot, dtype=np.int64)
            valid = np.zeros((len(decode_ctx), width), dtype=bool)
            for i, c in enumerate(decode_ctx):
                padded[i, :len(c)] = c
                valid[i, :len(c)] = True
            decode_slots = torch.from_numpy(padded).to(dev)
            decode_mask = torch.from_numpy(valid)[:, None, None, :].to(dev)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decodes=len(decode_ctx),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
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

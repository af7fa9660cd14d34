"""Turn a scheduled batch into tensors, run the model once over all its tokens, return logits.

The runner also decides how each step runs the layers (model/paths.py): the fused C call for
small steps, the compiled layers for large ones, the model's eager forward otherwise. The model
itself is plain: it knows no paths.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from carpool.config import ModelConfig
from carpool.core.block_manager import blocks_for
from carpool.core.scheduler import ScheduledBatch
from carpool.model.attention import AttentionMetadata, PrefillChunk, decode_runs, paged_attention, query_runs
from carpool.model.compiled import CompiledLayers, can_compile, warm_up_sizes
from carpool.model.cpu_kernels import has_decode_kernel
from carpool.model.fused_layers import FusedLayers
from carpool.model.llama import LlamaModel, pack_linears_for_cpu
from carpool.model.paths import Path, choose_path

log = logging.getLogger("carpool")


@dataclass
class WindowPlan:
    """A step's KV addresses in one of its requests' window tables (KVLayout): StepPlan's
    table-dependent fields, for the sliding layers that read it."""

    slot_mapping: np.ndarray
    decode_tables: list[list[int]]
    prefill_tables: list[list[int]]  # one per StepPlan.prefills entry
    fresh_tails: list[np.ndarray]


@dataclass
class StepPlan:
    """One batch as plain arrays (the 'batch plan' a parallel engine sends to every worker)."""

    input_ids: list[int]
    positions: np.ndarray  # [tokens] int64
    slot_mapping: np.ndarray  # [tokens] int64: KV slot each token writes
    decode_tables: list[list[int]]  # block table of each decode row (decodes come first)
    decode_lens: list[int]  # context length of each decode row, its new token included
    prefills: list[tuple[int, int, int, list[int]]]  # (row, end row, cached tokens, block table)
    sample_rows: list[int]  # rows whose logits are sampled (a decode with k drafts: k + 1 rows)
    fresh_tails: list[np.ndarray]  # unwritten slots of blocks this step starts filling: zeroed first
    prompt_logprob_rows: list[int] = field(default_factory=list)  # rows scoring prompt tokens
    windows: list[WindowPlan] = field(default_factory=list)  # one per window table (KVLayout)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def logit_rows(self) -> list[int]:
        """Rows whose logits the step returns: the sampled ones, then the prompt-scoring ones."""
        return self.sample_rows + self.prompt_logprob_rows


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, num_layers: int | None = None,
                       tp_size: int = 1) -> int:
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * (config.num_kv_heads // tp_size) * config.head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVLayout:
    """Which slice of the KV cache and which block table each local layer uses: a slice each and
    the requests' block tables, except where sliding-window layers sit beside full-attention ones
    (Gemma 2, 3; core/block_manager.py). A block then holds as many layers as attend fully, and
    the sliding layers, in groups of that many, each read one of the requests' window tables:
    sliding layer j (counted among the sliding ones) reads window table j // g in slice j % g."""

    num_slices: int  # layers a block holds
    tables: tuple[int, ...]  # per local layer: 0 the block table, t >= 1 window table t - 1
    slices: tuple[int, ...]  # per local layer: its slice of the cache
    window: int | None = None  # the sliding layers' window; None: one table for every layer

    @property
    def window_tables(self) -> int:
        return max(self.tables, default=0)

    @classmethod
    def plain(cls, num_layers: int) -> KVLayout:
        return cls(num_layers, (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def of(cls, config: ModelConfig) -> KVLayout:
        """The windowed layout for a whole model with both kinds of layers, else the plain one."""
        sliding = set(config.sliding_layers) if config.sliding_window else set()
        full = [i for i in range(config.num_layers) if i not in sliding]
        if not sliding or not full:
            return cls.plain(config.num_layers)
        g, tables, slices = len(full), [], []
        counts = [0, 0]  # full, sliding layers so far
        for i in range(config.num_layers):
            j = counts[i in sliding]
            counts[i in sliding] += 1
            tables.append(1 + j // g if i in sliding else 0)
            slices.append(j % g)
        return cls(g, tuple(tables), tuple(slices), config.sliding_window)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, enforce_eager: bool = True,
                 layout: KVLayout | None = None):
        self.model = model
        self.layout = layout or KVLayout.plain(model.num_local_layers)
        self.window = model.config.sliding_window if model.config.sliding_layers else None
        if device.type == "cpu" and dtype == torch.bfloat16:
            pack_linears_for_cpu(model)  # bf16 tiles or oneDNN's packed layers, where the CPU has either
        self.block_size = block_size
        self.device = device
        self.decode_kernel = has_decode_kernel(device, dtype)  # else SDPA over gathered blocks
        attn = model.layers[0].self_attn
        # [slices, K/V, slots, kv_heads, head_dim]: a slot is one token's KV in one slice (a layer,
        # or with KVLayout's windows a layer of each group); block b is slots [b * block_size,
        # (b + 1) * block_size). Slots are written before they are read, so the cache starts
        # uninitialised (fast), except one extra zeroed block at the end that padded block tables
        # point at.
        self.pad_block = num_blocks
        self.kv_cache = torch.empty(self.layout.num_slices, 2, (num_blocks + 1) * block_size,
                                    attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        self.kv_cache[:, :, num_blocks * block_size:].zero_()
        # What the layers index by layer: the cache itself, or each layer's slice.
        self.layer_caches = (self.kv_cache if self.layout.window is None
                             else [self.kv_cache[s] for s in self.layout.slices])
        # The other paths through the layers (model/paths.py), built once the weights are final;
        # None where they do not apply.
        self.compiled: CompiledLayers | None = None
        self.fused: FusedLayers | None = None
        plain = self.layout.window is None  # the fused and compiled layers index one cache tensor by layer
        if not enforce_eager and plain and can_compile(model):
            self.compile_forward()
        if self.decode_kernel and plain:
            self.fused = FusedLayers.build(model)

    def compile_forward(self) -> bool:
        """Compile the layers (model/compiled.py) and run one step of each warm-up size, so no
        request waits for a compilation; on failure run eager."""
        start = time.perf_counter()
        self.compiled = CompiledLayers(self.model)
        sizes = warm_up_sizes(self.model)
        try:
            for n in sizes:
                self.warm_up_step(n)
        except Exception as e:  # noqa: BLE001 -- any compiler failure leaves a working eager model
            self.compiled = None
            log.warning("torch.compile failed, running eager: %s: %s", type(e).__name__,
                        next(iter(str(e).splitlines()), ""))
            return False
        finally:
            self.kv_cache[:, :, self.pad_block * self.block_size:].zero_()
        log.info("compiled the forward for %s tokens in %.1f s", sizes, time.perf_counter() - start)
        return True

    @torch.inference_mode()
    def warm_up_step(self, num_tokens: int) -> None:
        """A decode-only step of `num_tokens` rows, all over the pad block (zeroed again after)."""
        pad_slot = self.pad_block * self.block_size
        plan = StepPlan([0] * num_tokens, np.zeros(num_tokens, dtype=np.int64),
                        np.full(num_tokens, pad_slot, dtype=np.int64), [[self.pad_block]] * num_tokens,
                        [1] * num_tokens, [], [], [])
        input_ids, positions, meta = self.tensors(plan)
        hidden = torch.zeros(num_tokens, self.model.config.hidden_size, dtype=self.kv_cache.dtype,
                             device=self.device)
        self.forward(input_ids, positions, meta, hidden)

    def slots_for(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        """Flatten a batch into plain arrays. Block tables are global, so one plan serves every
        worker of a parallel engine: the driver computes it once and sends it as is."""
        ids: list[int] = []
        positions: list[np.ndarray] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int]] = []  # (row, end row, cached tokens)
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        # Per table (the block table, then any window tables): slots, decode and prefill tables, fresh tails.
        tables = [WindowPlan(np.empty(0, np.int64), [], [], []) for _ in range(1 + self.layout.window_tables)]
        slots: list[list[np.ndarray]] = [[] for _ in tables]
        bs = self.block_size
        for req, n, drafts in zip(batch.requests, batch.num_tokens, batch.drafts):
            start = req.num_computed_tokens
            ctx = start + n
            row = len(ids)
            # This step starts the block holding token ctx-1? Attention reads that block whole
            # (masked) and 0 x NaN is NaN, so its unwritten slots must not hold stale garbage.
            fresh = ctx % bs and (ctx - 1) // bs * bs >= start
            decode = req.is_decode
            for plan, table, written in zip(tables, (req.block_ids, *req.window_block_ids), slots):
                if fresh:
                    plan.fresh_tails.append(self.slots_for(table, ctx, blocks_for(ctx, bs) * bs))
                written.append(self.slots_for(table, start, ctx))
                if decode:
                    # A decode with k drafts is k + 1 decode rows over one block table: row j sees
                    # the context up to its own token (the step writes every row's KV before any
                    # layer attends), so it runs in the batched decode attention, not as a chunk.
                    plan.decode_tables.extend([table[:blocks_for(ctx, bs)]] * n)
                else:
                    plan.prefill_tables.append(table[:blocks_for(ctx, bs)])
            ids.extend(req.token_ids[start:ctx - len(drafts)])
            ids.extend(drafts)
            positions.append(np.arange(start, ctx))
            if decode:
                decode_lens.extend(range(start + 1, ctx + 1))
            else:
                prefills.append((row, row + n, start))
            if ctx - len(drafts) == req.num_tokens:  # its last token and each draft are scored
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
            prompt_rows.extend(row + p - start for p in req.prompt_logprob_positions(n))
        for plan, written in zip(tables, slots):
            plan.slot_mapping = np.concatenate(written)
        own, *windows = tables
        return StepPlan(ids, np.concatenate(positions), own.slot_mapping, own.decode_tables, decode_lens,
                        [(*p, table) for p, table in zip(prefills, own.prefill_tables)], sample_rows,
                        own.fresh_tails, prompt_rows, windows)

    def clear_fresh_tails(self, plan: StepPlan) -> None:
        """Zero the not-yet-written slots of blocks the plan starts (the cache is allocated
        uninitialised, and freed blocks keep old KV)."""
        tails = [t for tails in (plan.fresh_tails, *(w.fresh_tails for w in plan.windows)) for t in tails]
        if tails:
            slots = torch.from_numpy(np.concatenate(tails)).to(self.device)
            self.kv_cache.index_fill_(2, slots, 0)

    def tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of a plan, on this runner's device."""
        dev = self.device
        meta = self.metadata(plan.slot_mapping, plan.decode_tables, plan.decode_lens, plan.prefills)
        decodes = decode_runs(plan.decode_tables, plan.decode_lens)
        drafts = len(decodes) < len(plan.decode_tables)
        if drafts or (plan.prefills and self.fused is not None and plan.num_tokens <= self.fused.max_tokens):
            meta.runs = query_runs(plan.decode_tables, plan.decode_lens, plan.prefills, self.pad_block, dev, decodes)
            meta.num_decode_runs = len(decodes) if drafts else 0
        if plan.windows:
            windows = [meta] + [self.metadata(w.slot_mapping, w.decode_tables, plan.decode_lens,
                                              [(*p[:3], t) for p, t in zip(plan.prefills, w.prefill_tables)])
                                for w in plan.windows]
            meta.per_layer = [windows[t] for t in self.layout.tables]
        input_ids = torch.tensor(plan.input_ids, dtype=torch.long, device=dev)
        pos = torch.from_numpy(plan.positions).to(dev)
        return input_ids, pos, meta

    def metadata(self, slot_mapping: np.ndarray, decode_tables: list[list[int]], decode_lens: list[int],
                 prefills: list[tuple[int, int, int, list[int]]]) -> AttentionMetadata:
        """Attention metadata over one set of block tables."""
        dev, bs = self.device, self.block_size
        chunks: list[PrefillChunk] = []
        for row, end, start, table in prefills:
            if start == 0:  # nothing cached: causal attention over the chunk alone
                chunks.append(PrefillChunk(row, end, None, None))
            else:
                mask = torch.arange(len(table) * bs)[None, :] <= torch.arange(start, start + end - row)[:, None]
                chunks.append(PrefillChunk(row, end, torch.tensor(table, device=dev), mask.to(dev)))
        tables = lens = mask = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [self.pad_block] * (width - len(t)) for t in decode_tables], device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            if not self.decode_kernel:
                mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            block_size=bs,
            num_decodes=len(decode_tables),
            decode_block_tables=tables,
            decode_context_lens=lens,
            decode_mask=mask,
            prefills=chunks,
            longest_context=max([*decode_lens, *(start + end - row for row, end, start, _ in prefills)], default=0),
        )

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids and positions, attention metadata, and the row of each request's last
        token (the rows whose logits are sampled, for requests whose prompt is now complete)."""
        plan = self.plan(batch)
        return (*self.tensors(plan), plan.sample_rows)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the batch; logits [plan.logit_rows, vocab]: one row per ready request in batch
        order, then the rows that score prompt tokens (see `StepPlan.logit_rows`)."""
        plan = self.plan(batch)
        self.clear_fresh_tails(plan)
        input_ids, positions, meta = self.tensors(plan)
        return self.logits(self.forward(input_ids, positions, meta), plan)

    @torch.inference_mode()
    def run_stage(self, plan: StepPlan, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """This rank's share of a plan: hidden states out of a pipeline stage that is not the last;
        on the last stage the logits of the sampled rows (gathered over tensor-parallel ranks,
        so None on ranks other than the first)."""
        self.clear_fresh_tails(plan)
        input_ids, positions, meta = self.tensors(plan)
        hidden = self.forward(input_ids, positions, meta, hidden)
        if not self.model.is_last:
            return hidden
        return self.logits(hidden, plan)

    def path(self, num_tokens: int, meta: AttentionMetadata) -> Path:
        """How a step runs the layers (model/paths.py): eager where a context passes a sliding
        window, which only the eager layers apply."""
        if self.window is not None and meta.longest_context > self.window:
            return Path.EAGER
        fused = self.fused
        fits = fused is not None and fused.can_attend(meta, num_tokens)
        return choose_path(num_tokens, fused.max_tokens if fits else 0, self.compiled is not None)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after this rank's layers (normed on the last stage), down the step's path."""
        path = self.path(len(positions), meta)
        if path is Path.EAGER:
            return self.model(input_ids, positions, self.layer_caches, meta, hidden, paged_attention)
        x, cos, sin = self.model.layer_inputs(input_ids, positions, hidden)
        if path is Path.FUSED:
            return self.fused(x, cos, sin, self.kv_cache, meta)
        return self.compiled(x, cos, sin, self.kv_cache, meta, paged_attention)

    def logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor | None:
        rows = plan.logit_rows
        if not rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        if not plan.prompt_logprob_rows and rows[-1] - rows[0] == len(rows) - 1:
            # Sampled rows ascend, so these are consecutive (every decode step): a view, not a gather.
            return self.model.compute_logits(hidden[rows[0]:rows[-1] + 1])
        return self.model.compute_logits(hidden[rows])

"""`carpool bench attention`: the engine's attention against what it replaced.

Until torch 2.13 carpool attended over gathered contexts with two batched matmuls per call, the
query heads grouped per KV head (and a chunk over a cached prefix in tiles of 32 query rows),
because that beat CPU SDPA. `grouped_decode` and `grouped_chunk` below are that code, kept as
the baseline; the engine's `decode_attention` and `chunk_attention` (model/attention.py) are
one SDPA call each. Shapes are the embedded model's (9 query heads, 3 KV heads, head dim 64);
the two are interleaved and the median of `repeats` kept, so the ratio holds on a busy host.
Decodes also time the C kernel that reads the blocks in place (model/cpu_kernels.py), which the
engine runs instead of SDPA over gathered blocks where it is built: `kernel_speedup` is SDPA's
time over the kernel's.
"""

from __future__ import annotations

import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from carpool.model import cpu_kernels
from carpool.model.attention import chunk_attention, decode_attention, gather_blocks

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
TILE = 32


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, kv_heads, rows, D]; k, v: [B, ctx, kv_heads, D]; mask broadcastable to the scores."""
    scores = torch.matmul(q, k.transpose(1, 2).contiguous().transpose(-1, -2)).float()
    scores.mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(q.dtype), v.transpose(1, 2).contiguous())


def grouped_decode(q, cache, tables, mask, scale, block_size):
    k, v = gather_blocks(cache[0], tables, block_size), gather_blocks(cache[1], tables, block_size)
    b = q.shape[0]
    return grouped(q.view(b, KV_HEADS, HEADS // KV_HEADS, DIM), k, v, mask, scale).view(b, HEADS, DIM)


def grouped_chunk(q, k, v, mask, num_cached, scale):
    n, group = q.shape[0], HEADS // KV_HEADS
    out = torch.empty_like(q)
    for lo in range(0, n, TILE):
        hi = min(lo + TILE, n)
        keys = num_cached + hi
        qt = q[lo:hi].view(hi - lo, KV_HEADS, group, DIM).permute(1, 2, 0, 3).reshape(1, KV_HEADS, -1, DIM)
        o = grouped(qt, k[None, :keys], v[None, :keys], mask[lo:hi, :keys].repeat(group, 1), scale)
        out[lo:hi] = o.view(KV_HEADS, group, hi - lo, DIM).permute(2, 0, 1, 3).reshape(hi - lo, HEADS, DIM)
    return out


def interleaved_medians(fns: list, repeats: int) -> list[float]:
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def run_attention_bench(dtype: torch.dtype, decodes: list[tuple[int, int]], chunks: list[tuple[int, int]],
                        repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for batch, ctx in decodes:
            width = ctx // BLOCK
            cache = torch.randn(2, batch * width * BLOCK + BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
            tables = torch.randperm(batch * width, generator=gen).view(batch, width)
            mask = torch.ones(batch, 1, 1, width * BLOCK, dtype=torch.bool)
            q = torch.randn(batch, HEADS, DIM, generator=gen).to(dtype)
            args = (q, cache, tables, mask, DIM ** -0.5, BLOCK)
            fns = [partial(decode_attention, *args), partial(grouped_decode, *args)]
            if cpu_kernels.has_decode_kernel(q.device, dtype):
                lens = torch.full((batch,), ctx)
                fns.append(partial(cpu_kernels.paged_decode_attention, q, cache, tables, lens, DIM ** -0.5, BLOCK))
            sdpa, base, *kernel = interleaved_medians(fns, repeats)
            rows.append({"kind": "decode", "batch": batch, "context": ctx, "sdpa_s": sdpa, "grouped_s": base})
            if kernel:
                rows[-1].update(kernel_s=kernel[0], kernel_speedup=sdpa / kernel[0])
        for n, cached in chunks:
            ctx = cached + n
            k, v = (torch.randn(ctx, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
            q = torch.randn(n, HEADS, DIM, generator=gen).to(dtype)
            mask = torch.arange(ctx)[None, :] <= torch.arange(cached, ctx)[:, None]
            sdpa, base = interleaved_medians([partial(chunk_attention, q, k, v, mask, DIM ** -0.5),
                                              partial(grouped_chunk, q, k, v, mask, cached, DIM ** -0.5)], repeats)
            rows.append({"kind": "chunk", "chunk": n, "cached": cached, "sdpa_s": sdpa, "grouped_s": base})
    for r in rows:
        r["speedup"] = r["grouped_s"] / r["sdpa_s"]
        shape = f"batch {r['batch']} x {r['context']} tokens" if r["kind"] == "decode" else \
            f"{r['chunk']}-token chunk over {r['cached']} cached"
        r["shape"] = f"{r['kind']}: {shape}"
        kernel = f"  C kernel {r['kernel_s'] * 1e3:7.2f} ms ({r['kernel_speedup']:.2f}x SDPA)" if "kernel_s" in r else ""
        print(f"{r['shape']:<40} SDPA {r['sdpa_s'] * 1e3:7.2f} ms  grouped {r['grouped_s'] * 1e3:7.2f} ms  "
              f"{r['speedup']:.2f}x{kernel}")
    return rows


def write_outputs(rows: list[dict], dtype: torch.dtype, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps({"dtype": str(dtype), "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r["speedup"] for r in rows], height=0.4, label="grouped matmuls / SDPA")
    ax.barh([y - 0.2 for y in ys], [r.get("kernel_speedup", 0) for r in rows], height=0.4,
            label="SDPA / C kernel (decodes)")
    ax.set_yticks(list(ys), [r["shape"] for r in rows])
    ax.axvline(1.0, color="grey", lw=1)
    ax.legend()
    ax.set_xlabel("speed-up (time ratio, per layer call)")
    ax.set_title(f"Attention per call, {dtype}")
    fig.tight_layout()
    fig.savefig(out / "attention.png", dpi=120)
    print(f"results in {out}/")

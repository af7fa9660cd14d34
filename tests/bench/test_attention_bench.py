"""`carpool bench attention` compares like with like: the grouped-matmul baseline computes what
the engine's SDPA attention computes, and the benchmark writes its JSON and plot."""

from __future__ import annotations

import json

import torch

from carpool.bench.attention import (BLOCK, DIM, HEADS, KV_HEADS, grouped_chunk, grouped_decode,
                                     run_attention_bench, write_outputs)
from carpool.model import cpu_kernels
from carpool.model.attention import chunk_attention, decode_attention


def test_baseline_computes_the_same_attention():
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 8 * BLOCK, KV_HEADS, DIM, generator=gen)
    tables = torch.tensor([[3, 1, 7], [0, 2, 5]])
    mask = (torch.arange(3 * BLOCK)[None, :] < torch.tensor([40, 33])[:, None])[:, None, None, :]
    q = torch.randn(2, HEADS, DIM, generator=gen)
    torch.testing.assert_close(grouped_decode(q, cache, tables, mask, 0.125, BLOCK),
                               decode_attention(q, cache, tables, mask, 0.125, BLOCK), rtol=1e-5, atol=1e-5)
    n, cached = 70, 50
    k, v = (torch.randn(cached + n, KV_HEADS, DIM, generator=gen) for _ in range(2))
    q = torch.randn(n, HEADS, DIM, generator=gen)
    causal = torch.arange(cached + n)[None, :] <= torch.arange(cached, cached + n)[:, None]
    torch.testing.assert_close(grouped_chunk(q, k, v, causal, cached, 0.125),
                               chunk_attention(q, k, v, causal, 0.125), rtol=1e-5, atol=1e-5)


def test_bench_writes_json_and_plot(tmp_path):
    rows = run_attention_bench(torch.float32, [(2, 64)], [(40, 32)], repeats=2)
    write_outputs(rows, torch.float32, tmp_path)
    saved = json.loads((tmp_path / "attention.json").read_text())
    assert [r["kind"] for r in saved["rows"]] == ["decode", "chunk"]
    assert all(r["sdpa_s"] > 0 and r["grouped_s"] > 0 and r["speedup"] > 0 for r in saved["rows"])
    if cpu_kernels.library() is not None:  # the decode row times the C kernel too
        assert saved["rows"][0]["kernel_s"] > 0 and saved["rows"][0]["kernel_speedup"] > 0
    assert (tmp_path / "attention.png").stat().st_size > 0

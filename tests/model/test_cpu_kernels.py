"""The C kernels (model/csrc/cpu_kernels.c) against torch's ops and a naive fp64 attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.harness.synthetic import SyntheticBatches
from carpool.engine import LLMEngine
from carpool.model import cpu_kernels
from carpool.model.llama import apply_rope
from tests.conftest import PROMPTS
from tests.helpers import run_greedy
from tests.model.test_attention import naive

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this machine")


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=5), block=st.sampled_from([1, 5, 16]),
       kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 4]),
       dim=st.sampled_from([8, 40, 48, 64, 128]),
       bf16=st.booleans(), write_new=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_decode_attention_reads_scattered_blocks(lens, block, kv_heads, group, dim, bf16, write_new, seed):
    """Each decode over its own blocks, scattered over the cache in random order, with strided
    query rows (a view of a fused QKV output, as in the model). With `write_new` the kernel first
    writes each decode's new k, v row (strided views too) to its last slot, as the model asks."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    used = [-(-n // block) for n in lens]
    num_blocks = sum(used) + 2
    cache = torch.randn(2, num_blocks * block, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(used)
    tables = [perm[sum(used[:i]):sum(used[:i + 1])] for i in range(len(lens))]
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # padding is never read
    heads = kv_heads * group
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, :heads * dim].view(-1, heads, dim)
    new_kv = None
    if write_new:
        k, v = qkv[:, heads * dim:].view(-1, 2 * kv_heads, dim).split(kv_heads, dim=1)
        last = torch.tensor([t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens)])
        new_kv = (k, v, last)
        written = cache.clone()
        written[0, last], written[1, last] = k, v
    got = cpu_kernels.paged_decode_attention(q, cache, padded, torch.tensor(lens), 0.3, block, new_kv=new_kv)
    if write_new:
        assert torch.equal(cache, written)
    for row, (table, n) in enumerate(zip(tables, lens)):
        slots = (torch.tensor(table)[:, None] * block + torch.arange(block)).reshape(-1)
        want = naive(q[row:row + 1].float(), cache[0, slots].float(), cache[1, slots].float(), n - 1, 0.3)
        tol = 2e-2 if bf16 else 1e-5
        torch.testing.assert_close(got[row:row + 1].float(), want, rtol=tol, atol=tol)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(1, 100), min_size=8, max_size=8), block=st.sampled_from([5, 16]),
       kv_heads=st.sampled_from([1, 3]), dim=st.sampled_from([48, 64, 128]), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_decode_attends_alike_alone_and_in_a_batch(lens, block, kv_heads, dim, bf16, seed):
    """Bit for bit: alone, a decode's few KV heads split over the threads by block and by slices
    of the head; in a batch of 8, each (sequence, KV head) is one thread's task."""
    gen = torch.Generator().manual_seed(seed)
    dtype, group = (torch.bfloat16 if bf16 else torch.float32), 3
    used = [-(-n // block) for n in lens]
    cache = torch.randn(2, sum(used) * block, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(sum(used), generator=gen).tolist()
    tables = torch.tensor([perm[sum(used[:i]):sum(used[:i + 1])] + [0] * (max(used) - used[i])
                           for i in range(len(lens))])
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = cpu_kernels.paged_decode_attention(q, cache, tables, torch.tensor(lens), 0.3, block)
        for i, n in enumerate(lens):
            alone = cpu_kernels.paged_decode_attention(q[i:i + 1], cache, tables[i:i + 1].contiguous(),
                                                       torch.tensor([n]), 0.3, block)
            assert torch.equal(alone, batch[i:i + 1])
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), min_size=1, max_size=4),
       block=st.sampled_from([1, 5, 16]), kv_heads=st.sampled_from([1, 3]), group=st.sampled_from([1, 3]),
       run=st.sampled_from([1, 3, 8]), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_attention_runs_is_causal_over_each_context(seqs, block, kv_heads, group, run, bf16, seed):
    """Sequences of (cached tokens, new tokens), their new tokens split into runs of `run`
    queries; each run's k, v written to its slots first, every query seeing its own prefix."""
    gen = torch.Generator().manual_seed(seed)
    dtype, dim = (torch.bfloat16 if bf16 else torch.float32), 64
    used = [-(-(c + n) // block) for c, n in seqs]
    cache = torch.randn(2, (sum(used) + 1) * block, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(sum(used) + 1, generator=gen).tolist()
    tables = [perm[sum(used[:i]):sum(used[:i + 1])] for i in range(len(seqs))]
    slots_of = [(torch.tensor(t)[:, None] * block + torch.arange(block)).reshape(-1) for t in tables]
    width, runs, lens, starts, slots = max(used), [], [], [], []
    for (cached, new), table, seq_slots in zip(seqs, tables, slots_of):
        for first in range(0, new, run):
            runs.append(table + [0] * (width - len(table)))
            lens.append(cached + min(new, first + run))
            starts.append(sum(len(x) for x in slots) + first)
        slots.append(seq_slots[cached:cached + new])
    tokens = sum(new for _, new in seqs)
    starts.append(tokens)
    q = torch.randn(tokens, kv_heads * group, dim, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    got = cpu_kernels.paged_attention_runs(q, k, v, cache, torch.tensor(runs), torch.tensor(lens),
                                           torch.tensor(starts), torch.cat(slots), 0.3, block)
    row, tol = 0, (2e-2 if bf16 else 1e-5)
    for (cached, new), seq_slots in zip(seqs, slots_of):
        assert torch.equal(cache[0, seq_slots[cached:cached + new]], k[row:row + new])
        want = naive(q[row:row + new].float(), cache[0, seq_slots].float(), cache[1, seq_slots].float(), cached, 0.3)
        torch.testing.assert_close(got[row:row + new].float(), want, rtol=tol, atol=tol)
        row += new


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_matches_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    x, delta = (torch.randn(rows, 576, generator=gen).bfloat16() for _ in range(2))
    w = torch.randn(576, generator=gen).bfloat16()
    want = F.rms_norm(x, w.shape, w, 1e-5)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), want, rtol=1e-2, atol=1e-2)
    summed, normed = cpu_kernels.rms_norm(x, w, 1e-5, delta)
    assert torch.equal(summed, x + delta)  # the fused add rounds as torch's bf16 add
    torch.testing.assert_close(normed, F.rms_norm(x + delta, w.shape, w, 1e-5), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 20])
def test_rope_in_place_matches_apply_rope(rows):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 15 * 64, generator=gen).bfloat16()
    qk = qkv[:, :12 * 64].view(-1, 12, 64)  # strided rows: v follows each token's q and k
    angles = torch.randn(rows, 1, 32, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    want = apply_rope(qk, cos, sin)
    v_before = qkv[:, 12 * 64:].clone()
    got = cpu_kernels.rope_(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.05)  # torch rounds 3 times, C once
    assert torch.equal(qkv[:, 12 * 64:], v_before)


@pytest.mark.parametrize("rows", [1, 20])
def test_silu_mul_matches_torch(rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)).bfloat16()
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


def test_only_eager_bf16_on_cpu_fuses():
    assert cpu_kernels.fuses(torch.zeros(2, dtype=torch.bfloat16))
    assert not cpu_kernels.fuses(torch.zeros(2))  # fp32: torch's ops, the reference arithmetic


def test_the_library_is_built_once_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CARPOOL_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left
    source = tmp_path / "other.c"
    source.write_text(cpu_kernels.SOURCES[0].read_text() + "\n/* changed */\n")
    assert cpu_kernels.build((source, *cpu_kernels.SOURCES[1:])) != first
    header = tmp_path / "kernels.h"
    header.write_text(cpu_kernels.HEADERS[0].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(cpu_kernels, "HEADERS", (header,))
    assert cpu_kernels.build() != first  # a header is part of the key too


def test_the_cache_key_names_the_cpu_and_its_flags():
    info = Path("/proc/cpuinfo")
    if not info.exists() or "flags" not in info.read_text():
        pytest.skip("no x86 /proc/cpuinfo here")
    key = cpu_kernels._cpu_model()
    assert "flags" in key and "model name" in key  # a generic model name alone is not enough


def test_without_a_compiler_torch_ops_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CARPOOL_KERNEL_CACHE", str(tmp_path))  # nothing cached here
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert "CPU kernels unavailable" in caplog.text
        assert not cpu_kernels.fuses(torch.zeros(2, dtype=torch.bfloat16))
        assert not cpu_kernels.has_decode_kernel(torch.device("cpu"), torch.bfloat16)
    finally:
        cpu_kernels.library.cache_clear()


def decode_top1(engine, seqs: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Teacher-forced argmax at each continuation position, every sequence a decode in one
    batch per step (so the paged decode kernel runs over several contexts): [seqs, steps]."""
    syn = SyntheticBatches(engine)
    reqs = []
    for seq, p in zip(seqs, prompt_lens):
        reqs.append(syn.new(seq[:p + 1]))
        reqs[-1].num_prompt_tokens = p  # so seq[p] plays the first sampled token
    try:
        syn.run([(r, p) for r, p in zip(reqs, prompt_lens)])
        top1 = []
        for step in range(min(len(s) - p for s, p in zip(seqs, prompt_lens)) - 1):
            top1.append(syn.run([(r, 1) for r in reqs], all_logits=True).argmax(-1))
            for r, seq, p in zip(reqs, seqs, prompt_lens):
                r.token_ids.append(seq[p + 1 + step])
        return torch.stack(top1, dim=1)
    finally:
        syn.close()


def test_bf16_with_kernels_agrees_with_fp32(model_path, engine_fp32, monkeypatch):
    """Greedy continuations of the test prompts decoded teacher-forced in bf16, with the kernels
    and with torch's ops: each agrees with fp32 as bf16 does (measured: 0.96-0.98)."""
    prompts = [engine_fp32.tokenizer.encode(p) for p in PROMPTS]
    seqs = [p + c for p, c in zip(prompts, run_greedy(engine_fp32, prompts, 24))]
    lens = [len(p) for p in prompts]
    want = decode_top1(engine_fp32, seqs, lens)
    engine = LLMEngine(model=model_path, dtype="bfloat16", quantization="none", kv_cache_memory=32 << 20)
    runner = engine.runner
    unwritten = runner.kv_cache[:, :, :runner.pad_block * runner.block_size]
    assert runner.decode_kernel
    unwritten.fill_(float("nan"))  # so that a slot read before it is written shows
    with_kernels = decode_top1(engine, seqs, lens)
    monkeypatch.setattr(cpu_kernels, "fuses", lambda x: False)
    runner.decode_kernel = False
    unwritten.fill_(float("nan"))
    with_torch = decode_top1(engine, seqs, lens)
    agreement = [(got == want).float().mean().item() for got in (with_kernels, with_torch)]
    print(f"top-1 agreement with fp32: kernels {agreement[0]:.3f}, torch ops {agreement[1]:.3f}")
    assert min(agreement) >= 0.93
    assert (with_kernels == with_torch).float().mean() >= 0.93

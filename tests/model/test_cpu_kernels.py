"""The C kernels (model/csrc/cpu_kernels.c) against torch's ops and a naive fp64 attention; their
signature table against csrc/kernels.h and the library; their wrappers' checks; their torch ops
(fake implementations, torch.compile without graph breaks)."""

from __future__ import annotations

import ctypes
import functools
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves, tree_map

from carpool.harness.synthetic import SyntheticBatches
from carpool.engine import LLMEngine
from carpool.model import cpu_kernels
from carpool.model.cpu_kernels import KERNELS, KernelSignatureError, Signature
from carpool.model.quant import QuantizedLinear
from carpool.model.llama import apply_rope
from tests.conftest import PROMPTS
from tests.helpers import examples, run_greedy
from tests.model.test_attention import naive

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this machine")


@settings(max_examples=examples(40), deadline=None)
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


@settings(max_examples=examples(20), deadline=None)
@given(lens=st.lists(st.integers(1, 100), min_size=8, max_size=8), block=st.sampled_from([1, 5, 16]),
       kv_heads=st.sampled_from([1, 3]), dim=st.sampled_from([48, 64, 128]), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_decode_attends_alike_alone_and_in_a_batch(lens, block, kv_heads, dim, bf16, seed):
    """Bit for bit: a decode alone, in a batch of 3 and in a batch of 8, however its (sequence,
    KV head) tasks fall to the threads, and whether its context's segments (32 blocks: 32 tokens
    at block 1) run as tasks of their own (alone, too few tasks for the threads) or one after
    another in its task (in a batch)."""
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
        three = cpu_kernels.paged_decode_attention(q[:3], cache, tables[:3].contiguous(), torch.tensor(lens[:3]), 0.3,
                                                   block)
        assert torch.equal(three, batch[:3])
        for i, n in enumerate(lens):
            alone = cpu_kernels.paged_decode_attention(q[i:i + 1], cache, tables[i:i + 1].contiguous(),
                                                       torch.tensor([n]), 0.3, block)
            assert torch.equal(alone, batch[i:i + 1])
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=examples(40), deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), min_size=1, max_size=4),
       block=st.sampled_from([1, 5, 16, 32]), kv_heads=st.sampled_from([1, 3]), group=st.sampled_from([1, 3, 4]),
       run=st.sampled_from([1, 3, 8]), dim=st.sampled_from([48, 64, 128]), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_paged_attention_runs_is_causal_over_each_context(seqs, block, kv_heads, group, run, dim, bf16, seed):
    """Sequences of (cached tokens, new tokens), their new tokens split into runs of `run`
    queries; each run's k, v written to its slots first, every query seeing its own prefix. Runs
    of up to 32 query rows, blocks of whole 16s or not: the AMX scores' tiles, where the CPU has
    them, and every other path."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
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


@settings(max_examples=examples(20), deadline=None)
@given(cached=st.lists(st.integers(0, 50), min_size=1, max_size=5), run=st.integers(2, 9),
       block=st.sampled_from([5, 16]), dim=st.sampled_from([48, 64, 128]), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_run_attends_as_its_tokens_decoded_one_at_a_time(cached, run, block, dim, bf16, seed):
    """Bit for bit, as speculation's greedy equality needs: a verified draft's token (a run of
    several queries, its last block partly visible to all but the last) and the same token as a
    decode (its context cut at its own position), alone and in a batch."""
    gen = torch.Generator().manual_seed(seed)
    dtype, kv_heads, group = (torch.bfloat16 if bf16 else torch.float32), 3, 3
    used = [-(-(c + run) // block) for c in cached]
    cache = torch.randn(2, sum(used) * block, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(sum(used), generator=gen).tolist()
    tables = torch.tensor([perm[sum(used[:i]):sum(used[:i + 1])] + [0] * (max(used) - used[i])
                           for i in range(len(cached))])
    slots = torch.cat([(tables[i, :, None] * block + torch.arange(block)).reshape(-1)[c:c + run]
                       for i, c in enumerate(cached)])
    tokens = run * len(cached)
    q = torch.randn(tokens, kv_heads * group, dim, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([c + run for c in cached])
    ran = cpu_kernels.paged_attention_runs(q, k, v, cache, tables, lens, torch.arange(len(cached) + 1) * run, slots,
                                           0.3, block)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for i in range(run):  # every sequence's i-th new token, decoded
            rows = torch.arange(len(cached)) * run + i
            decoded = cpu_kernels.paged_decode_attention(q[rows], cache, tables, lens - run + i + 1, 0.3, block)
            assert torch.equal(decoded, ran[rows])
            alone = cpu_kernels.paged_decode_attention(q[rows[:1]], cache, tables[:1].contiguous(),
                                                       lens[:1] - run + i + 1, 0.3, block)
            assert torch.equal(alone, ran[rows[:1]])
    finally:
        torch.set_num_threads(threads)


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


# Few distinct values, so rows tie; NaN and the infinities where the sampler must see them.
_LOGITS = st.sampled_from([-2.5, -1.0, 0.0, 1.5, 3.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=examples(200), deadline=None)
@given(num_rows=st.integers(1, 5), width=st.integers(1, 70), values=st.lists(_LOGITS, min_size=350, max_size=350),
       common=st.sampled_from([-2.5, 0.0, 3.0]))
def test_row_max_equals_torch_max_with_ties_nans_and_infinities(num_rows, width, values, common):
    # Two in three entries one common value (ties everywhere), the rest drawn: torch's first index.
    x = torch.tensor([common if i % 3 else v for i, v in enumerate(values[:num_rows * width])]).view(num_rows, width)
    got, want = cpu_kernels.row_max(x), x.max(dim=-1)
    assert torch.equal(got[1], want.indices)
    torch.testing.assert_close(got[0], want.values, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 49155])
def test_row_max_finds_the_first_maximum_at_every_position(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, vocab, generator=gen)
    for at in {0, vocab // 2, vocab - 1}:
        y = x.clone()
        y[:, at] = 10.0
        y[1, -1] = 10.0  # a tie after it: the first stays
        y[2, at // 2] = float("nan")  # NaN before or at it
        values, indices = cpu_kernels.row_max(y)
        assert indices.tolist() == y.max(dim=-1).indices.tolist()
        assert values[0] == 10.0 and values[2].isnan()
    strided = x[:, ::2]  # not contiguous: copied first
    assert torch.equal(cpu_kernels.row_max(strided)[1], strided.max(dim=-1).indices)
    picked = [2, 0, 2]  # rows read in place, in any order and more than once
    assert torch.equal(cpu_kernels.row_max(y, picked)[1], y[picked].max(dim=-1).indices)
    with pytest.raises(IndexError, match="out of range"):
        cpu_kernels.row_max(y, [3])


@pytest.mark.parametrize("kernel", ["int4", "int8", "Q4_K", "bf16 tiles"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_product_does_not_depend_on_how_many_threads_share_its_blocks(kernel, tokens):
    """Threads take their static share of a product's 16-row blocks, then the others' last
    untaken ones (kernels.h, claim_block). Whatever the thread count (odd, or more than the 64
    shares), every block is computed, once, and the output is the one-thread output bit for bit."""
    from tests.model.test_kquant import kernel_for, random_codes

    n, k = 16 * 37 - 5, 256
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=gen).bfloat16()
    if kernel in ("int4", "int8"):
        linear = torch.nn.Linear(k, n, bias=False).requires_grad_(False)
        linear.weight.normal_(0, 0.05, generator=gen)
        product = QuantizedLinear(linear, kernel, torch.bfloat16).to(torch.bfloat16).kernel
    elif kernel == "Q4_K":
        if not cpu_kernels.has_kq_matmul():
            pytest.skip("needs AVX-512 VNNI or AVX2 (csrc/kquant.c)")
        product = functools.partial(kernel_for(random_codes(T.Q4_K, n, k)[0]), tile_from=0)
    else:
        if not cpu_kernels.has_bf16_tiles():
            pytest.skip("needs AVX512-BF16 or AVX2 with FMA")
        tiles = cpu_kernels.bf16_tiles(torch.randn(n, k, generator=gen).bfloat16())
        product = functools.partial(cpu_kernels.bf16_tiles_matmul, tiles=tiles, n=n, amx_from=0)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = product(x)
        assert alone.abs().sum() > 0
        for threads in (2, 3, 7, 70):
            torch.set_num_threads(threads)
            assert torch.equal(product(x), alone), threads
    finally:
        torch.set_num_threads(saved)


def test_only_eager_bf16_on_cpu_fuses():
    assert cpu_kernels.fuses(torch.zeros(2, dtype=torch.bfloat16))
    assert not cpu_kernels.fuses(torch.zeros(2))  # fp32: torch's ops, the reference arithmetic


@pytest.mark.slow
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
    key = cpu_kernels.cpu_model()
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


# ---------------------------------------------------------------- the signature table

def test_the_table_matches_the_header_and_types_the_calls():
    signatures = cpu_kernels.check_signatures(KERNELS, cpu_kernels.HEADER.read_text())
    assert signatures.keys() == KERNELS.keys() == cpu_kernels.header_prototypes(cpu_kernels.HEADER.read_text()).keys()
    lib = cpu_kernels.library()
    assert lib.rms_norm_bf16.argtypes == [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    assert lib.rms_norm_bf16.restype is None and lib.quantized_matmul.restype is ctypes.c_int
    assert lib.quant_gemv_supported.argtypes == []
    assert not lib.fused_layers._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # lets the GIL go
    assert lib.rope_bf16._flags_ & ctypes._FUNCFLAG_PYTHONAPI


def test_the_header_parser_reads_prototypes_only():
    header = """
    /* int commented_out(int x); */
    #include <stdint.h>
    static inline float helper(uint16_t h) { float f; { f = h; } return f; }
    typedef struct { int64_t a; float b; } Shape;
    int none(void);
    void *make(const Shape *shape,
               int64_t n, float eps);  // spans lines
    """
    assert cpu_kernels.header_prototypes(header) == {
        "none": Signature("int", ()),
        "make": Signature("ptr", (("ptr", "shape"), ("i64", "n"), ("f32", "eps")))}
    with pytest.raises(KernelSignatureError, match="double"):
        cpu_kernels.header_prototypes("int f(double x);")


def _with(name: str, args: str | None, returns: str = "void") -> dict[str, tuple[str, str]]:
    table = dict(KERNELS)
    if args is None:
        del table[name]
    else:
        table[name] = (returns, args)
    return table


RMS_NORM = "ptr x, ptr delta, ptr x_out, ptr out, ptr weight, i64 rows, i64 dim, f32 eps"


@pytest.mark.parametrize("table, message", [
    (_with("rms_norm_bf16", RMS_NORM.replace("f32 eps", "i64 eps")), "rms_norm_bf16"),  # a wrong kind
    (_with("rms_norm_bf16", RMS_NORM.replace(", f32 eps", "")), "rms_norm_bf16"),  # an argument short
    (_with("rms_norm_bf16", RMS_NORM.replace("i64 rows, i64 dim", "i64 dim, i64 rows")), "rms_norm_bf16"),  # swapped
    (_with("rms_norm_bf16", RMS_NORM, returns="int"), "rms_norm_bf16"),  # the return kind
    (_with("rms_norm_bf16", RMS_NORM.replace("f32 eps", "double eps")), "unknown kind 'double'"),
    (_with("rope_bf16", None), "rope_bf16: not in the table"),  # a prototype with no entry
    (_with("no_such_kernel", "i64 n"), "no_such_kernel"),  # an entry with no prototype
])
def test_a_wrong_declaration_raises_at_load(table, message):
    with pytest.raises(KernelSignatureError, match=message):
        cpu_kernels.load(cpu_kernels.build(), table)


def test_a_declared_kernel_the_library_lacks_raises_at_load(tmp_path):
    header = tmp_path / "kernels.h"
    header.write_text(cpu_kernels.HEADER.read_text() + "\nint not_built(int64_t n);\n")
    with pytest.raises(KernelSignatureError, match="exports no not_built"):
        cpu_kernels.load(cpu_kernels.build(), _with("not_built", "i64 n", returns="int"), header)


# ---------------------------------------------------------------- the wrappers' checks

def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).bfloat16()


def test_calls_with_wrong_dtypes_shapes_or_devices_raise():
    x, w = bf16(2, 64), bf16(64)
    with pytest.raises(ValueError, match=r"rms_norm takes .*got x \[2, 64\] float32"):
        cpu_kernels.rms_norm(x.float(), w, 1e-5)
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_kernels.rms_norm(x, bf16(32), 1e-5)  # a weight too short: the kernel would read past it
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_kernels.rms_norm(x, w, 1e-5, bf16(1, 64))
    with pytest.raises(ValueError, match="meta"):
        cpu_kernels.rms_norm(x.to("meta"), w, 1e-5)  # not CPU memory
    with pytest.raises(ctypes.ArgumentError):  # the table's f32
        cpu_kernels.rms_norm(x, w, "1e-5")
    with pytest.raises(ValueError, match="rope_"):
        cpu_kernels.rope_(bf16(2, 4, 16), bf16(1, 1, 16), bf16(2, 1, 16))  # cos for one row of two
    with pytest.raises(ValueError, match="rope_"):
        cpu_kernels.rope_(bf16(2, 16, 4).transpose(1, 2), bf16(2, 1, 16), bf16(2, 1, 16))  # heads not dense
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_kernels.silu_mul(bf16(2, 63))
    q, cache = bf16(2, 4, 16), bf16(2, 32, 2, 16)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([10, 12])
    with pytest.raises(ValueError, match="paged_decode_attention"):
        cpu_kernels.paged_decode_attention(q, cache, tables.int(), lens, 0.3, 8)  # int32 tables
    with pytest.raises(ValueError, match="paged_decode_attention"):
        cpu_kernels.paged_decode_attention(q, cache.float(), tables, lens, 0.3, 8)  # cache dtype
    with pytest.raises(ValueError, match="paged_decode_attention"):
        cpu_kernels.paged_decode_attention(q, bf16(2, 32, 3, 16), tables, lens, 0.3, 8)  # 3 kv heads, 4 heads
    with pytest.raises(ValueError, match="paged_decode_attention"):
        cpu_kernels.paged_decode_attention(q, cache, tables[:1], lens, 0.3, 8)  # a table short
    with pytest.raises(ValueError, match="new_kv"):
        cpu_kernels.paged_decode_attention(q, cache, tables, lens, 0.3, 8,
                                           new_kv=(bf16(2, 2, 16), bf16(2, 2, 16), torch.tensor([9])))
    with pytest.raises(ValueError, match="paged_attention_runs"):
        cpu_kernels.paged_attention_runs(q, bf16(2, 2, 16), bf16(2, 2, 16), cache, tables, lens,
                                         torch.tensor([0, 1]), torch.tensor([9, 27]), 0.3, 8)  # starts [runs]


@pytest.mark.skipif(not cpu_kernels.has_quantized_matmul(), reason="no AVX-512 VNNI or AVX2 here")
def test_quantized_matmul_checks_its_weights_and_input():
    codes, scale, low = QuantizedLinear(torch.nn.Linear(64, 40), "int4", torch.bfloat16).kernel.tensors
    matmul = cpu_kernels.QuantizedMatmul(40, codes, scale, low)
    assert matmul(bf16(3, 64)).shape == (3, 40)
    with pytest.raises(ValueError, match=r"quantized_matmul takes a CPU tensor \[tokens, 64\]"):
        matmul(bf16(3, 32))
    with pytest.raises(ValueError, match="quantized_matmul"):
        matmul(bf16(3, 64).half())
    with pytest.raises(ValueError, match="QuantizedMatmul"):
        cpu_kernels.QuantizedMatmul(64, codes, scale, low)  # packed for 40 rows: 3 blocks, not 4
    with pytest.raises(ValueError, match="QuantizedMatmul"):
        cpu_kernels.QuantizedMatmul(40, codes, scale.float(), low)


# ---------------------------------------------------------------- the torch ops

def op_cases() -> dict[str, tuple]:
    """Each op with small inputs: (op, args)."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()
    qk = r(3, 6 * 16)[:, :5 * 16].view(3, 5, 16)  # strided rows, as the model's view of QKV
    angles = torch.randn(3, 1, 8, generator=gen).repeat(1, 1, 2)
    ops = torch.ops.carpool
    cases = {
        "rms_norm": (ops.rms_norm, (r(3, 64), r(64), 1e-5)),
        "add_rms_norm": (ops.add_rms_norm, (r(3, 64), r(3, 64), r(64), 1e-5)),
        "rope_": (ops.rope_, (qk, angles.cos().bfloat16(), angles.sin().bfloat16())),
        "silu_mul": (ops.silu_mul, (r(3, 64),)),
        "paged_decode_attention": (ops.paged_decode_attention, (
            r(2, 4, 16), r(2, 32, 2, 16), torch.tensor([[0, 1], [2, 3]]), torch.tensor([10, 12]), 0.3, 8,
            r(2, 2, 16), r(2, 2, 16), torch.tensor([9, 27]))),
        "paged_attention_runs": (ops.paged_attention_runs, (
            r(3, 4, 16), r(3, 2, 16), r(3, 2, 16), r(2, 32, 2, 16), torch.tensor([[0, 1], [2, 3]]),
            torch.tensor([11, 12]), torch.tensor([0, 2, 3]), torch.tensor([9, 10, 27]), 0.3, 8)),
    }
    if cpu_kernels.has_quantized_matmul():
        codes, scale, low = QuantizedLinear(torch.nn.Linear(64, 40), "int4", torch.bfloat16).kernel.tensors
        cases["quantized_matmul"] = (ops.quantized_matmul, (r(3, 64), codes, scale, low, 40, None))
    return cases


OPS = list(op_cases())


def outputs(op, args) -> list[torch.Tensor]:
    """The op's outputs, and for an op that returns nothing, the tensor it mutates."""
    out = op(*args)
    return list(out) if isinstance(out, (tuple, list)) else [args[0] if out is None else out]


@pytest.mark.parametrize("name", OPS)
def test_each_ops_fake_implementation_matches_its_output(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args = op_cases()[name]
    real = outputs(op, args)
    with FakeTensorMode() as mode:
        fake = outputs(op, tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, args))
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]
    # torch's own checks: the schema's mutations and aliases, fake vs real, AOT dispatch
    torch.library.opcheck(op, op_cases()[name][1])


def fresh(fn):
    """fn with a code object of its own: Dynamo caches compilations per code object, so a test
    compiles its function anew without resetting what other tests compiled."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled(fn, recorded: list):
    """fn compiled with no graph break allowed, through AOT (functionalization, fake tensors);
    the FX graphs Dynamo hands over are appended to `recorded`."""
    def backend(gm, example_inputs):
        recorded.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    return torch.compile(fresh(fn), backend=backend, fullgraph=True, dynamic=True)


def calls(graphs: list, name: str) -> int:
    return sum(str(node.target) == f"carpool.{name}.default" or str(node.target) == f"carpool.{name}"
               for gm in graphs for node in gm.graph.nodes if node.op == "call_function")


def wrapper_cases() -> dict[str, tuple]:
    """The public wrappers as the model calls them, around other ops: (fn, args, op name)."""
    _, (x, delta, w, eps) = op_cases()["add_rms_norm"]
    _, (qk, cos, sin) = op_cases()["rope_"]
    _, (q, cache, tables, lens, scale, block, k, v, slots) = op_cases()["paged_decode_attention"]

    def rope(qkv, cos, sin):
        qkv = qkv * 1  # a fresh tensor, roped in place through a strided view of it
        cpu_kernels.rope_(qkv[:, :80].view(3, 5, 16), cos, sin)
        return qkv

    def attend(q, cache, k, v):
        out = torch.empty_like(q)
        cpu_kernels.paged_decode_attention(q * 1, cache, tables, lens, scale, block, out, (k, v, slots))
        return out

    return {
        "rms_norm": (lambda x, w: cpu_kernels.rms_norm(x * 2, w, eps), (x, w)),
        "add_rms_norm": (lambda x, d, w: cpu_kernels.rms_norm(x, w, eps, d * 2), (x, delta, w)),
        "rope_": (rope, (qk.as_strided((3, 96), (96, 1)), cos, sin)),
        "silu_mul": (lambda g: cpu_kernels.silu_mul(g * 2), op_cases()["silu_mul"][1]),
        "paged_decode_attention": (attend, (q, cache, k, v)),
    }


@pytest.mark.parametrize("name", list(wrapper_cases()))
def test_compiled_wrappers_hold_their_op_with_no_graph_break(name):
    fn, args = wrapper_cases()[name]
    eager_args = [a.clone() for a in args]
    want = fn(*eager_args)
    graphs = []
    got = compiled(fn, graphs)(*args)
    assert calls(graphs, name) == 1
    got, want = tree_leaves((got, args)), tree_leaves((want, eager_args))  # the outputs and any mutated input
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(not cpu_kernels.has_quantized_matmul(), reason="no AVX-512 VNNI or AVX2 here")
def test_a_compiled_quantized_matmul_holds_its_op():
    _, (x, codes, scale, low, n, _) = op_cases()["quantized_matmul"]
    matmul = cpu_kernels.QuantizedMatmul(n, codes, scale, low)
    graphs = []
    got = compiled(lambda x: matmul(x * 2) + 1, graphs)(x)
    assert calls(graphs, "quantized_matmul") == 1
    assert torch.equal(got, matmul(x * 2) + 1)


def test_inductor_compiles_an_op_into_its_graph():
    """Inductor (what the runner compiles with) calls the op from its generated code."""
    _, (gate_up,) = op_cases()["silu_mul"]
    fn = lambda g: cpu_kernels.silu_mul(g * 2) * 2  # both exact in bf16
    explained = torch._dynamo.explain(fresh(fn))(gate_up)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert torch.equal(torch.compile(fresh(fn), fullgraph=True)(gate_up), fn(gate_up))


def test_eager_calls_skip_the_op(monkeypatch):
    """Outside torch.compile the wrappers call the library directly: an op's dispatch costs
    more than a small kernel."""
    def no_dispatch(*args):
        raise AssertionError("dispatched through torch.ops")
    for name in ("rms_norm", "add_rms_norm", "rope_", "silu_mul", "paged_decode_attention"):
        monkeypatch.setattr(torch.ops.carpool, name, no_dispatch)
    for name, (fn, args) in wrapper_cases().items():
        fn(*args)


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


@pytest.mark.slow
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

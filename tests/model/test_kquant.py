"""csrc/kquant.c: GGUF's quantized weights multiplied as stored.

- Its reading of the packed layout gives gguf-py's dequantized values bit for bit (kq_rows).
- The integer kernel equals the dequantized weights times the int8-rounded activations, to fp32
  summation and the output's rounding; the int8 rounding itself stays within its bound.
- The bf16 tile kernel equals the bf16-rounded dequantized weights times the bf16 activations,
  to fp32 summation and the output's rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.model import cpu_kernels, gguf_codes
from tests.helpers import examples
from tests.model.test_gguf_codes import TYPES, random_raw

pytestmark = pytest.mark.skipif(not cpu_kernels.has_kq_matmul(), reason="needs AVX-512 VNNI or AVX2 (csrc/kquant.c)")


def kernel_for(codes: gguf_codes.QuantCodes) -> cpu_kernels.KQuantMatmul:
    p = gguf_codes.pack(codes)
    t = lambda a: None if a is None else torch.from_numpy(a)
    return cpu_kernels.KQuantMatmul((t(p.lo), t(p.hi), t(p.sc), t(p.mn), t(p.d), t(p.dmin)), p.n, p.k, p.bits,
                                    p.offset, p.super_size, lookup=p.lookup)


def random_codes(qtype: T, n: int, k: int, seed: int = 0) -> tuple[gguf_codes.QuantCodes, np.ndarray]:
    raw = random_raw(qtype, n, k, seed)
    return gguf_codes.decode(raw, qtype, (n, k)), raw


def int8_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the integer kernel sees it: int8 per group of 32, codes round(x * (127 / max|x|)) to
    nearest and scale max|x| / 127; and, per channel, the step by which the kernel's code may
    differ where x * 127 / max|x| lies within 2^-12 of a tie (the kernel's fp32 product may land
    on the other side), else 0."""
    g = x.float().reshape(x.shape[0], -1, 32)
    top = g.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    scaled = g * inv
    step = (top / 127).double()
    near_tie = ((scaled - scaled.floor() - 0.5).abs() < 2 ** -12).double() * step
    return ((torch.round(scaled).clamp(-127, 127).double() * step).reshape(x.shape),
            near_tie.reshape(x.shape))


def min_term(c: gguf_codes.QuantCodes) -> torch.Tensor:
    """The weights' min term, -dmin * mn per channel: the integer kernel multiplies it by the
    exact activations' sums, not by their int8 rounding."""
    if c.dmin is None:
        return torch.zeros(c.n, c.k, dtype=torch.float64)
    low = np.repeat(c.dmin.astype(np.float64), c.super_size // c.sub_size, axis=1)
    if c.mn is not None:
        low = low * c.mn
    return -torch.from_numpy(np.repeat(low, c.sub_size, axis=1))


def assert_within(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, out_dtype: torch.dtype,
                  slack: torch.Tensor | float = 0.0) -> None:
    """|y - ref| <= output rounding (half an ulp of `out_dtype`: 2^-9 relative for bf16) + fp32
    summation (2^-16 of sum |w x|: K <= 2^8 terms per thread's chain at 2^-24 each)."""
    rounding = 2.0 ** -8 if out_dtype is torch.bfloat16 else 2.0 ** -23
    bound = rounding * (ref.abs() + slack) + 2.0 ** -16 * magnitude + slack + 1e-30
    excess = (y.double() - ref).abs() - bound
    assert excess.max() <= 0, f"{(excess > 0).sum()} outputs past the bound, worst by {excess.max():.3g}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_are_gguf_dequantized_values_bit_for_bit(qtype):
    codes, raw = random_codes(qtype, 37, 512)
    got = kernel_for(codes).rows(torch.arange(37)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), gguf_dequantize(raw, qtype).view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_integer_kernel_is_dequantized_weights_times_int8_activations(qtype, dtype):
    n, k = 45, 512
    codes, _ = random_codes(qtype, n, k, seed=1)
    w = torch.from_numpy(gguf_codes.dequantize(codes)).double()
    low = min_term(codes)
    kernel = kernel_for(codes)
    for tokens in (1, 2, 3, 4, 5, 9):
        x = torch.randn(tokens, k).to(dtype)
        y = kernel(x, 0)
        xq, tie_step = int8_rounded(x)
        ref = xq @ (w - low).T + x.double() @ low.T
        assert_within(y, ref, xq.abs() @ w.abs().T + x.double().abs() @ low.abs().T, dtype,
                      slack=tie_step @ (w - low).abs().T)
        # the activations' rounding: at most half a step (max |x_g| / 254) per channel
        exact = x.double() @ w.T
        step = x.double().abs().reshape(tokens, -1, 32).amax(-1).repeat_interleave(32, 1) / 254
        assert ((ref - exact).abs() <= step @ (w - low).abs().T * (1 + 1e-9)).all()


@settings(max_examples=examples(30), deadline=None)
@given(qtype=st.sampled_from(TYPES), blocks=st.integers(1, 3), rows_short=st.integers(0, 15),
       tokens=st.integers(2, 12), bf16=st.booleans(), seed=st.integers(0, 1000))
def test_a_token_gets_the_same_output_alone_and_among_others(qtype, blocks, rows_short, tokens, bf16, seed):
    """The integer kernel, bit for bit: a lone token (a batch-1 decode), a few tokens and a chunk
    take different loops (AVX2: one token, tiles of 4, the unpacked form in pairs), and a token's
    output must not depend on which ran, or greedy decoding would depend on the batch."""
    n, k = 16 * blocks - rows_short, 512
    kernel = kernel_for(random_codes(qtype, n, k, seed=seed)[0])
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16 if bf16 else torch.float32)
    together = kernel(x, 0)
    for i in range(tokens):
        assert torch.equal(kernel(x[i:i + 1], 0), together[i:i + 1])


@pytest.mark.skipif(not cpu_kernels.has_kq_tiles(), reason="needs AVX512-BF16 and VBMI")
@settings(max_examples=examples(24), deadline=None)
@given(qtype=st.sampled_from(TYPES), blocks=st.integers(1, 5), rows_short=st.integers(0, 15),
       tokens=st.integers(1, 50), threads=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_tile_kernel_is_bf16_weights_times_bf16_activations(qtype, blocks, rows_short, tokens, threads, seed):
    """Any row count (odd block counts, a part-filled last block) and token count (every tile size;
    on AMX, one and two token tiles per pass, the last part-filled)."""
    n, k = max(1, blocks * 16 - rows_short), 256
    codes, _ = random_codes(qtype, n, k, seed=seed)
    w = torch.from_numpy(gguf_codes.dequantize(codes)).bfloat16().double()
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernel_for(codes)(x, 1)
    finally:
        torch.set_num_threads(saved)
    assert_within(y, x.double() @ w.T, x.double().abs() @ w.abs().T, torch.bfloat16)


@pytest.mark.skipif(not cpu_kernels.has_kq_tiles(), reason="needs AVX512-BF16 and VBMI")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_1], ids=lambda t: t.name)
def test_tile_kernel_over_many_channels(qtype):
    """Tokens whose channels outgrow a core's L2 (on AMX the product then runs in passes over the
    channels, the sums kept between passes, the last pass shorter; each thread several block pairs,
    the next one's tiles dequantized between the current one's products, the last one a single
    block): still the bf16 products summed in fp32,
    |y - x W^T| <= 2^-8 |x W^T| + k 2^-24 |x| |W|^T (output rounding, then k fp32 adds)."""
    n, k, tokens = 200, 4352, 272
    codes, _ = random_codes(qtype, n, k, seed=5)
    w = torch.from_numpy(gguf_codes.dequantize(codes)).bfloat16().double()
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = kernel_for(codes)(x, 1).double()
    exact = x.double() @ w.T
    assert ((y - exact).abs() <= 2 ** -8 * exact.abs() + k * 2 ** -24 * (x.double().abs() @ w.abs().T)).all()


def test_both_kernels_agree_across_the_switch():
    """The same weights through either kernel: the two roundings apart, never more."""
    codes, _ = random_codes(T.Q4_K, 64, 1024, seed=3)
    kernel = kernel_for(codes)
    x = torch.randn(20, 1024).bfloat16()
    a, b = kernel(x, 0).double(), kernel(x, 1 if cpu_kernels.has_kq_tiles() else 0).double()
    assert (a - b).abs().max() <= 0.03 * b.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_stacked_parts_are_each_parts_product_in_its_columns(dtype):
    """A fused q/k/v of a Q4_K_M file (v Q6_K) as parts in their own forms: one call gives every
    part's own product, bit for bit, in its columns; rows read across the parts."""
    k = 512
    parts = [random_codes(qtype, n, k, seed=n)[0] for qtype, n in ((T.Q4_K, 40), (T.Q4_K, 8), (T.Q6_K, 21))]
    runs = gguf_codes.stack_rows(parts)
    assert [(r.n, r.bits, r.sub_size) for r in runs] == [(48, 4, 32), (21, 6, 16)]
    singles = [kernel_for(r) for r in runs]
    stacked = cpu_kernels.KQuantMatmul.stacked([kernel_for(r) for r in runs])
    assert stacked.n == 69 and len(stacked.parts) == 2
    for tokens, tile_from in ((1, 0), (3, 0), (9, 0), (20, 16)):
        x = torch.randn(tokens, k).to(dtype)
        want = torch.cat([single(x, tile_from if dtype is torch.bfloat16 else 0) for single in singles], dim=1)
        got = stacked(x, tile_from if dtype is torch.bfloat16 else 0)
        assert torch.equal(got, want)
    rows = torch.tensor([0, 47, 48, 68, 5])
    assert torch.equal(stacked.rows(rows), torch.cat([singles[0].rows(torch.arange(48)),
                                                      singles[1].rows(torch.arange(21))])[rows])
    x = torch.randn(3, k).to(dtype)  # in a graph, each part is its own carpool::kq_matmul
    assert torch.equal(torch.compile(lambda x: stacked(x, 0), backend="eager", fullgraph=True)(x), stacked(x, 0))


def test_one_form_for_parts_only_where_it_costs_little():
    """stack_rows: parts of one type make one run; types whose one form would hold > 5% more stay
    apart; a small part of a slightly wider type joins the rest."""
    k = 256
    q4k = lambda n: random_codes(T.Q4_K, n, k, seed=n)[0]
    assert [r.n for r in gguf_codes.stack_rows([q4k(32), q4k(16)])] == [48]
    q6k = random_codes(T.Q6_K, 16, k)[0]
    assert [(r.n, r.bits) for r in gguf_codes.stack_rows([q4k(32), q4k(16), q6k])] == [(48, 4), (16, 6)]
    # Q2_K (5.125 bits a weight) and Q3_K (4.5625): one form, Q2_K's, costs Q3_K's rows 12%
    q2k, q3k = random_codes(T.Q2_K, 64, k)[0], random_codes(T.Q3_K, 16, k)[0]
    (merged,) = gguf_codes.stack_rows([q2k, q3k])
    assert (merged.n, merged.bits, merged.sub_size) == (80, 4, 16)
    np.testing.assert_array_equal(gguf_codes.dequantize(merged),
                                  np.concatenate([gguf_codes.dequantize(q2k), gguf_codes.dequantize(q3k)]))
    assert len(gguf_codes.stack_rows([random_codes(T.Q2_K, 16, k)[0], random_codes(T.Q3_K, 64, k)[0]])) == 2


def test_wrapper_refuses_mismatched_tensors():
    codes, _ = random_codes(T.Q6_K, 16, 256)
    p = gguf_codes.pack(codes)
    t = lambda a: None if a is None else torch.from_numpy(a)
    with pytest.raises(ValueError, match="KQuantMatmul"):  # planes of a 6-bit weight declared as 5-bit
        cpu_kernels.KQuantMatmul((t(p.lo), t(p.hi), t(p.sc), t(p.mn), t(p.d), t(p.dmin)), 16, 256, 5, 32, 256)
    kernel = kernel_for(codes)
    with pytest.raises(ValueError, match="kq_matmul"):
        kernel(torch.randn(2, 128), 0)
    with pytest.raises(IndexError):
        kernel.rows(torch.tensor([16]))


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.slow
@pytest.mark.skipif("avx512f" not in _cpu_flags() or "avx2" not in _cpu_flags(),
                    reason="this CPU runs the AVX2 kernels in every test already (or has no AVX2)")
def test_the_avx2_kernels_pass_these_tests_on_an_avx512_cpu(tmp_path):
    """CPUs without AVX-512 (AMD Zen 1-3) run other code: build it here too (-mno-avx512f) and
    run this file's integer-kernel tests, the int4/int8 ones and the bf16 tiles' against it."""
    env = {**os.environ, "CARPOOL_KERNEL_FLAGS": "-mno-avx512f -mno-amx-tile", "CARPOOL_KERNEL_CACHE": str(tmp_path)}
    probe = ("from carpool.model import cpu_kernels as k; "
             "print(k.has_kq_matmul(), k.has_kq_tiles(), k.has_quantized_matmul(), k.has_amx(), k.has_bf16_tiles())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "True", "False", "True"], out.stdout + out.stderr
    tests = ["tests/model/test_kquant.py::test_integer_kernel_is_dequantized_weights_times_int8_activations",
             "tests/model/test_kquant.py::test_a_token_gets_the_same_output_alone_and_among_others",
             "tests/model/test_kquant.py::test_both_kernels_agree_across_the_switch", "tests/model/test_quant.py",
             "tests/model/test_bf16_tiles.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                         cwd=Path(__file__).parents[2], capture_output=True, text=True, check=False)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]

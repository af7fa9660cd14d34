"""bf16 weights stored as kquant.c's tiles (model/llama.py's TiledLinear): any shape and token
count, on vdpbf16ps, on AMX and with AVX2's FMAs, gives the bf16 products summed in fp32."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.model import cpu_kernels
from carpool.model.llama import TiledLinear, pack_linears_for_cpu
from tests.helpers import examples

pytestmark = pytest.mark.skipif(not cpu_kernels.has_bf16_tiles(), reason="needs AVX512-BF16 or AVX2 with FMA")


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 80), groups=st.integers(1, 8), tokens=st.integers(1, 40), amx_from=st.sampled_from([0, 1, 16]),
       seed=st.integers(0, 2**16))
def test_tiles_give_the_bf16_products_summed_in_fp32(n, groups, tokens, amx_from, seed):
    """Each product of two bf16 values is exact in fp32; the sums of k of them (in another order than
    the reference's) are off by at most k half-ulps (2^-24 relative) of the largest partial sum, and
    the output is rounded to bf16 (8 significant bits: at most 2^-8 relative):
    |y - x W^T| <= (2^-8 + k 2^-24) |x| |W|^T."""
    k = 32 * groups
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(tokens, k, generator=g).bfloat16()
    y = cpu_kernels.bf16_tiles_matmul(x, cpu_kernels.bf16_tiles(w), n, amx_from).double()
    exact = x.double() @ w.double().T
    bound = (2**-8 + k * 2**-24) * (x.double().abs() @ w.double().abs().T)
    assert y.shape == (tokens, n)
    assert ((y - exact).abs() <= bound).all()


@pytest.mark.parametrize("amx_from", [0, 1])
def test_tiles_over_many_channels(amx_from):
    """Tokens whose channels outgrow a core's L2 (on AMX the product runs in passes over the
    channels, the last one shorter and not a multiple of 256): the same bound."""
    n, k, tokens = 40, 4384, 272
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(tokens, k, generator=g).bfloat16()
    y = cpu_kernels.bf16_tiles_matmul(x, cpu_kernels.bf16_tiles(w), n, amx_from).double()
    exact = x.double() @ w.double().T
    assert ((y - exact).abs() <= (2**-8 + k * 2**-24) * (x.double().abs() @ w.double().abs().T)).all()


def test_tiles_over_many_tokens_and_rows():
    """Past 64 MB of fp32 sums (16384 rows x 1056 tokens) AMX runs the tokens in slices: the same
    bound, against an fp32 reference (itself within k 2^-24 |x| |W|^T, so that term doubles)."""
    n, k, tokens = 16384, 256, 1056
    g = torch.Generator().manual_seed(9)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(tokens, k, generator=g).bfloat16()
    y = cpu_kernels.bf16_tiles_matmul(x, cpu_kernels.bf16_tiles(w), n, 1).float()
    ref = x.float() @ w.float().T
    bound = 2**-8 * ref.abs() + 2 * k * 2**-24 * (x.float().abs() @ w.float().abs().T)
    assert ((y - ref).abs() <= bound).all()


def test_pack_linears_swaps_in_tiles_that_keep_the_bias_and_the_leading_dims():
    layer = torch.nn.Linear(64, 40).bfloat16()
    holder = torch.nn.Sequential(layer)
    x = torch.randn(5, 3, 64).bfloat16()
    w, b = layer.weight.double(), layer.bias.double()
    assert pack_linears_for_cpu(holder) == 1 and isinstance(holder[0], TiledLinear)
    with torch.no_grad():
        got = holder(x).double()
    exact = x.double() @ w.T + b  # two roundings to bf16: the product, then the bias added
    bound = (2 * 2**-8 + 64 * 2**-24) * (x.double().abs() @ w.abs().T + b.abs())
    assert got.shape == (5, 3, 40) and ((got - exact).abs() <= bound).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.bf16_tiles(torch.zeros(4, 48, dtype=torch.bfloat16))
    tiles = cpu_kernels.bf16_tiles(torch.zeros(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[tokens, 64\]"):
        cpu_kernels.bf16_tiles_matmul(torch.zeros(2, 32, dtype=torch.bfloat16), tiles, 4, 16)

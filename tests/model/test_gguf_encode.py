"""The numpy K-quant encoder against stated error bounds and both decoders (gguf-py's and
gguf_codes'), llama-quantize's type mixes against tables derived by hand from its rules, and whole
GGUF files requantized (a small synthetic one and the embedded model)."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.config import default_model_path
from carpool.model import gguf_codes
from carpool.model.gguf_encode import LLAMA_CPP_MIXES, main, quantize, random_gguf, requantize_gguf, tensor_type
from tests.helpers import examples

K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
IQ4_TYPES = [T.IQ4_NL, T.IQ4_XS]
# asymmetric types (w = d sc q - dmin m): sub-block size, largest code Q, sub-scale levels L
ASYMMETRIC = {T.Q2_K: (16, 3, 15), T.Q4_K: (32, 15, 63), T.Q5_K: (32, 31, 63)}
# symmetric types (w = d sc (q - n), 16 channels a sub-block): n, sub-scale levels L'
SYMMETRIC = {T.Q3_K: (4, 32), T.Q6_K: (32, 128)}
CODE_BITS = {T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5,
             T.Q8_0: 8, T.IQ4_NL: 4, T.IQ4_XS: 4}


def fp16_error(x: np.ndarray) -> np.ndarray:
    """How far rounding x >= 0 to fp16 can move it: half an ulp, 2^-25 among the subnormals."""
    return np.maximum(x * 2.0 ** -11, 2.0 ** -25)


def error_bound(w: np.ndarray, qtype: T) -> np.ndarray:
    """Per element, the most |w - w_hat| may be, from the quantizer's definition (module doc of
    gguf_encode). A_j: the sub-block's max |w|, A: the super-block's; S, s: a sub-block's
    rounded and exact scale.

    Asymmetric (codes 0..Q, min m = -min(w, 0)): a code off the clip range is within S / 2 <= A_j / Q
    + |S - s| / 2; a clipped one within Q |S - s| + |M - m|. The sub-scale is a rounded multiple of
    d = max scale / L <= 2A / (Q L): |S - s| <= d / 2 + L * fp16 error of d; likewise |M - m| with
    dmin <= A / L.
    Symmetric (codes -n..n-1, the largest |w| mapped to -n): one side reaches only n - 1 steps, so
    the error is at most |S| + n |S - s| <= A_j / n + (n + 1) |S - s|, with |S - s| <= d + L' * fp16
    error of d (a sub-scale at +L' is clipped to L' - 1), d = A / (n L')."""
    n_rows, k = w.shape
    per_super = np.abs(w).reshape(n_rows, k // 256, 256).max(axis=-1)
    if qtype in ASYMMETRIC:
        sub, top, levels = ASYMMETRIC[qtype]
        d, dmin = 2 * per_super / (top * levels), per_super / levels
        scale_error = 0.51 * d + levels * fp16_error(d)
        min_error = 0.51 * dmin + levels * fp16_error(dmin)
        per_sub = np.abs(w).reshape(n_rows, k // sub, sub).max(axis=-1) / top
        per_super_bound = (top + 0.5) * scale_error + min_error
    else:
        n, levels = SYMMETRIC[qtype]
        sub = 16
        d = per_super / (n * levels)
        per_sub = np.abs(w).reshape(n_rows, k // sub, sub).max(axis=-1) / n
        per_super_bound = (n + 1) * (1.01 * d + levels * fp16_error(d))
    bound = np.repeat(per_sub, sub, axis=1) + np.repeat(per_super_bound, 256, axis=1)
    return bound + 2.0 ** -20 * np.repeat(per_super, 256, axis=1)  # the fp32 arithmetic


def weights(rng: np.random.Generator, n: int, k: int, scale: float) -> np.ndarray:
    """Normal weights with the blocks quantizers trip on: zero and constant sub-blocks, a
    super-block all positive, one all negative."""
    w = rng.standard_normal((n, k)) * scale
    subs = w.reshape(n, k // 16, 16)
    subs[rng.random(subs.shape[:2]) < 0.05] = 0
    constant = rng.random(subs.shape[:2]) < 0.05
    subs[constant] = rng.standard_normal((constant.sum(), 1)) * scale
    supers = w.reshape(n, k // 256, 256)
    supers[0, 0] = np.abs(supers[0, 0]) + scale
    supers[-1, -1] = -np.abs(supers[-1, -1])
    return w.astype(np.float32)


def iq4_error_bound(w: np.ndarray, qtype: T) -> np.ndarray:
    """Per element, the most |w - w_hat| may be for IQ4_NL / IQ4_XS (module doc of gguf_encode). A_j:
    the 32-channel block's max |w|, A: the super-block's. The table t runs -127 .. 113 with gaps of
    at most 24, so a value x / step within it is at most 12 steps from an entry, one past it at
    most 127 |s| / |step| - 113 steps from 113, where s = A_j / 127 is the block's exact scale.
    IQ4_NL's step is s (to fp16 rounding): at most 14 s off. IQ4_XS's is d sc with |d sc - s| <= |d|
    (rounding to a multiple of d, or clipping +32 to 31), |d| = A / (32 * 127): at most
    max(12 (s + |d|), 14 s + 113 |d|). The factor 1.01 covers fp16's rounding of d."""
    n_rows, k = w.shape
    blocks = np.repeat(np.abs(w).reshape(n_rows, k // 32, 32).max(axis=-1), 32, axis=1) / 127
    if qtype == T.IQ4_NL:
        return 1.01 * 14 * blocks + 2.0 ** -20 * blocks * 127
    d = np.repeat(np.abs(w).reshape(n_rows, k // 256, 256).max(axis=-1), 256, axis=1) / (32 * 127)
    return 1.01 * np.maximum(12 * (blocks + d), 14 * blocks + 113 * d) + 2.0 ** -20 * d * 32 * 127


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 8), supers=st.integers(1, 4), log_scale=st.floats(-2, 2), seed=st.integers(0, 2 ** 16))
def test_encoded_types_within_bound_and_decoded_alike(n, supers, log_scale, seed):
    w = weights(np.random.default_rng(seed), n, 256 * supers, 10.0 ** log_scale)
    for qtype in K_TYPES + IQ4_TYPES:
        raw = quantize(w, qtype)
        block, size = GGML_QUANT_SIZES[qtype]
        assert raw.dtype == np.uint8 and raw.shape == (n, 256 * supers // block * size)
        got = gguf_dequantize(raw, qtype)
        assert np.isfinite(got).all()
        bound = iq4_error_bound(w, qtype) if qtype in IQ4_TYPES else error_bound(w, qtype)
        excess = np.abs(got - w) - bound
        assert excess.max() <= 0, (qtype.name, np.unravel_index(excess.argmax(), w.shape))
        ours = gguf_codes.dequantize(gguf_codes.decode(raw, qtype, (n, 256 * supers)))
        np.testing.assert_array_equal(ours.view(np.uint32), got.view(np.uint32))


def test_iq4_keeps_its_own_grid():
    """Values on the table's grid come back unchanged: a block holding t[0] * 2^-4 and other
    entries times 2^-4 has scale exactly 2^-4."""
    values = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
    w = np.tile(np.concatenate([values, values[::-1]]), (2, 8)) / 16
    for qtype in IQ4_TYPES:
        np.testing.assert_array_equal(gguf_dequantize(quantize(w, qtype), qtype), w)


def test_error_falls_with_bits():
    w = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    mse = [float(np.mean((gguf_dequantize(quantize(w, t), t) - w) ** 2)) for t in K_TYPES]
    assert mse == sorted(mse, reverse=True) and len(set(mse)) == len(mse), mse
    assert mse[-1] < 1e-3  # Q6_K: a step ~ 4 sigma / 63 at most


def test_exact_values_stay_exact():
    """Zeros come back as zeros from every type, and Q6_K's own grid points unchanged where the
    scales are powers of two (largest |w| 8: sub-scale 8 / 32, d = 2^-9)."""
    w = np.zeros((2, 512), np.float32)
    for qtype in K_TYPES:
        assert not gguf_dequantize(quantize(w, qtype), qtype).any()
    w[1] = np.tile(np.arange(16, dtype=np.float32) - 8, 32)
    np.testing.assert_array_equal(gguf_dequantize(quantize(w, T.Q6_K), T.Q6_K), w)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q6_K], ids=lambda t: t.name)  # asymmetric, symmetric
def test_whole_tensor_under_two_seconds(qtype):
    """Vectorised over the tensor: a Python loop over its 65,536 super-blocks would take longer."""
    w = np.random.default_rng(2).standard_normal((8192, 2048)).astype(np.float32)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        quantize(w, qtype)
        best = min(best, time.perf_counter() - start)
    assert best < 2.0


def test_legacy_types_are_gguf_pys():
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        np.testing.assert_array_equal(quantize(w, qtype), gguf_quantize(w, qtype))
    np.testing.assert_array_equal(quantize(w, "Q8_0"), gguf_quantize(w, T.Q8_0))


def test_rows_must_hold_whole_super_blocks():
    with pytest.raises(ValueError, match="super-blocks"):
        quantize(np.zeros((2, 576), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="no encoder"):
        quantize(np.zeros((2, 256), np.float32), T.IQ2_XXS)
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize(np.zeros((2, 48), np.float32), T.IQ4_NL)


# ---------------------------------------------------------------- mixes

# llama.cpp's use_more_bits(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, evaluated by hand
MORE_BITS = {8: {0, 3, 6, 7}, 30: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}}


def layer_types(mix: str, kind: str, n_layers: int, k: int = 2048, n_gqa: int = 1) -> list[str]:
    return [tensor_type(f"blk.{i}.{kind}.weight", (512, k), mix, n_layers, n_gqa=n_gqa) for i in range(n_layers)]


@pytest.mark.parametrize("n_layers", sorted(MORE_BITS))
def test_q4_k_m_and_q5_k_m_give_more_bits_to_v_and_down(n_layers):
    for mix, more, base in (("Q4_K_M", "Q6_K", "Q4_K"), ("Q5_K_M", "Q6_K", "Q5_K")):
        want = [more if i in MORE_BITS[n_layers] else base for i in range(n_layers)]
        assert layer_types(mix, "attn_v", n_layers) == want
        assert layer_types(mix, "ffn_down", n_layers) == want
        for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert layer_types(mix, kind, n_layers) == [base] * n_layers


def test_other_mixes():
    n = 32
    assert layer_types("Q3_K_M", "attn_v", n) == ["Q5_K"] * 2 + ["Q4_K"] * 30
    assert layer_types("Q3_K_M", "ffn_down", n) == ["Q5_K"] * 2 + ["Q4_K"] * 30  # n / 16 layers
    assert layer_types("Q3_K_M", "attn_output", n) == ["Q4_K"] * n
    assert layer_types("Q3_K_M", "ffn_up", n) == ["Q3_K"] * n
    assert layer_types("Q4_K_S", "attn_v", n) == ["Q5_K"] * 4 + ["Q4_K"] * 28
    assert layer_types("Q4_K_S", "ffn_down", n) == ["Q5_K"] * 4 + ["Q4_K"] * 28  # n / 8 layers
    assert layer_types("Q2_K", "attn_v", n, n_gqa=3) == ["Q3_K"] * n
    assert layer_types("Q2_K", "attn_v", n, n_gqa=4) == ["Q4_K"] * n
    for kind, want in (("ffn_down", "Q3_K"), ("attn_output", "Q3_K"), ("attn_q", "Q2_K"), ("ffn_gate", "Q2_K")):
        assert layer_types("Q2_K", kind, n) == [want] * n
    for kind in ("attn_v", "ffn_down", "attn_q"):
        assert layer_types("Q6_K", kind, n) == ["Q6_K"] * n
    for mix in ("IQ4_XS", "IQ4_NL"):
        assert layer_types(mix, "attn_v", n, n_gqa=4) == ["Q5_K"] * n
        assert layer_types(mix, "attn_v", n, n_gqa=3) == [mix] * n
        assert layer_types(mix, "ffn_down", n) == ["Q5_K"] * 4 + [mix] * 28  # n / 8 layers
        assert layer_types(mix, "attn_output", n) == [mix] * n


def test_output_fallbacks_and_unquantized():
    for mix in LLAMA_CPP_MIXES:
        assert tensor_type("output.weight", (32000, 4096), mix, 32) == ("Q8_0" if mix == "Q8_0" else "Q6_K")
        assert tensor_type("output.weight", (49152, 576), mix, 30) == "Q8_0"
        assert tensor_type("blk.0.attn_norm.weight", (4096,), mix, 32) == "F32"
        assert tensor_type("blk.0.attn_q.bias", (4096,), mix, 32) == "F32"
        assert tensor_type("blk.3.ffn_gate.weight", (1536, 100), mix, 32) == "F16"  # not even 32-channel blocks
    # the embeddings are the output where the file has none (tied), else the mix's type
    assert tensor_type("token_embd.weight", (32000, 4096), "Q4_K_M", 32, tied_output=True) == "Q6_K"
    assert tensor_type("token_embd.weight", (32000, 4096), "Q4_K_M", 32) == "Q4_K"
    # rows of 576 (no whole 256-channel super-blocks): llama.cpp's fallbacks
    assert layer_types("Q4_K_M", "attn_v", 30, k=576) == ["Q8_0" if i in MORE_BITS[30] else "Q5_0" for i in range(30)]
    assert layer_types("Q5_K_M", "attn_q", 30, k=576) == ["Q5_1"] * 30
    assert layer_types("Q2_K", "attn_q", 30, k=576) == ["Q4_0"] * 30
    assert layer_types("Q3_K_M", "ffn_up", 30, k=576) == ["Q4_0"] * 30
    assert layer_types("IQ4_XS", "attn_q", 30, k=576) == ["IQ4_NL"] * 30
    with pytest.raises(ValueError, match="unknown mix"):
        tensor_type("output.weight", (8, 256), "Q4_K_XL", 1)


# ---------------------------------------------------------------- files

def fields(reader: GGUFReader) -> dict:
    return {name: (f.types, f.contents()) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def check_requantized(src: str, dst: str, types: dict[str, str], mix: str) -> None:
    """dst holds src's metadata and tensor shapes, each tensor in the type tensor_type gives it:
    copied byte for byte where that is src's type, else src's values quantized (and within
    3 * row max / (2^bits - 1) of them, a bound every type's rounding and clipping meets)."""
    a, b = GGUFReader(src), GGUFReader(dst)
    assert fields(b) == fields(a)
    n_layers = int(a.fields[f"{a.fields['general.architecture'].contents()}.block_count"].contents())
    tied = "output.weight" not in {t.name for t in a.tensors}
    heads = {k: int(a.fields[f"llama.attention.{k}"].contents()) for k in ("head_count", "head_count_kv")}
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors] == list(types)
    for old, new in zip(a.tensors, b.tensors):
        shape = tuple(int(x) for x in reversed(old.shape))
        assert tuple(int(x) for x in reversed(new.shape)) == shape
        assert new.tensor_type.name == types[old.name]
        assert types[old.name] == tensor_type(old.name, shape, mix, n_layers,
                                              n_gqa=heads["head_count"] // heads["head_count_kv"], tied_output=tied)
        if new.tensor_type == old.tensor_type:
            np.testing.assert_array_equal(np.asarray(new.data), np.asarray(old.data))
            continue
        w = gguf_dequantize(np.asarray(old.data), old.tensor_type).reshape(shape)
        got = gguf_dequantize(np.asarray(new.data), new.tensor_type).reshape(shape)
        if new.tensor_type in (T.F32, T.F16):
            np.testing.assert_array_equal(got, w.astype(np.float16 if new.tensor_type == T.F16 else np.float32))
            continue
        np.testing.assert_array_equal(np.asarray(new.data).reshape(-1), quantize(w, new.tensor_type).reshape(-1))
        row_max = np.abs(w).max(axis=-1, keepdims=True)
        assert (np.abs(got - w) <= 3 * row_max / (2 ** CODE_BITS[new.tensor_type] - 1)).all(), old.name


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    """An 8-layer Llama of width 256 (GQA 4): f32 / f16 / Q8_0 tensors and a 96-wide one."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(8)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_string("general.name", "tiny")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_token_list([f"t{i}" for i in range(64)])
    writer.add_array("tokenizer.ggml.token_type", [1] * 64)
    w = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)
    writer.add_tensor("token_embd.weight", w(64, 256).astype(np.float16))
    writer.add_tensor("output.weight", w(64, 256))
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    for i in range(8):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(256, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", gguf_quantize(w(256, 256), T.Q8_0), raw_dtype=T.Q8_0)
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(64, 256))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(64, 256))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(256, 256))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(512, 256).astype(np.float16))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(512, 256))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(256, 512))
    writer.add_tensor("blk.0.attn_q_a.weight", w(16, 96))  # not a multiple of 256 channels
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_K_S", "Q3_K_M", "Q2_K", "IQ4_XS"])
def test_requantize_tiny(tiny_gguf, tmp_path, mix):
    dst = str(tmp_path / f"{mix}.gguf")
    types = requantize_gguf(tiny_gguf, dst, mix)
    check_requantized(tiny_gguf, dst, types, mix)
    if mix == "Q4_K_M":
        assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == [
            "Q6_K" if i in MORE_BITS[8] else "Q4_K" for i in range(8)]
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
        assert types["blk.0.attn_q_a.weight"] == "Q5_0"
    if mix == "Q2_K":  # GQA 4
        assert {types[f"blk.{i}.attn_v.weight"] for i in range(8)} == {"Q4_K"}
    if mix == "IQ4_XS":
        assert {types[f"blk.{i}.attn_v.weight"] for i in range(8)} == {"Q5_K"}  # GQA 4
        assert [types[f"blk.{i}.ffn_down.weight"] for i in range(8)] == ["Q5_K"] + ["IQ4_XS"] * 7
        assert types["blk.0.attn_q_a.weight"] == "IQ4_NL" and types["blk.3.ffn_up.weight"] == "IQ4_XS"


def test_cli_prints_type_counts(tiny_gguf, tmp_path, capsys):
    main([tiny_gguf, str(tmp_path / "out.gguf"), "--mix", "Q6_K"])
    counts = {line.split()[0]: int(line.split()[1]) for line in capsys.readouterr().out.splitlines()}
    # every 2-D weight Q6_K but the 96-wide one (Q8_0); norms F32
    assert counts == {"F32": 9, "Q6_K": 2 + 8 * 7, "Q8_0": 1}


@pytest.mark.slow  # ~35 s on 2 cores: three GGUFReader parses of its 49k-token vocabulary, 100M weights
def test_requantize_embedded_model(tmp_path):
    src = default_model_path()
    dst = str(tmp_path / "q4_k_m.gguf")
    types = requantize_gguf(src, dst, "Q4_K_M")
    # 30 layers of width 576 (not whole super-blocks: Q4_K -> Q5_0, Q6_K -> Q8_0), tied embeddings
    # (the output's Q6_K -> Q8_0, already the file's type), ffn_down 1536 wide
    for i in range(30):
        more = i in MORE_BITS[30]
        assert types[f"blk.{i}.attn_v.weight"] == ("Q8_0" if more else "Q5_0")
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if more else "Q4_K")
        for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{kind}.weight"] == "Q5_0"
    assert types["token_embd.weight"] == "Q8_0"
    assert Counter(types.values()) == {"Q5_0": 166, "F32": 61, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14}
    check_requantized(src, dst, types, "Q4_K_M")


@pytest.mark.slow  # ~6 s: the embedded model's tokenizer read twice, an engine built
def test_random_model_in_a_mix_loads_and_runs(tmp_path):
    """random:SHAPE files (benchmarks at 1-8B): llama-quantize's types, the embedded tokenizer, and
    a model carpool loads as the shape says and runs."""
    from carpool import LLM, SamplingParams
    dst = str(tmp_path / "random.gguf")
    shape = (256, 512, 4, 4, 2, False)  # hidden, FFN, layers, heads, KV heads, tied
    types = random_gguf(dst, shape, "Q4_K_M", default_model_path())
    reader = GGUFReader(dst)
    assert {t.name: t.tensor_type.name for t in reader.tensors} == types
    assert types["output.weight"] == "Q6_K" and types["blk.1.ffn_gate.weight"] == "Q4_K"
    more_bits = (2, 3)  # of 4 layers: llama.cpp's last eighth and every third
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == ["Q6_K" if i in more_bits else "Q4_K"
                                                                   for i in range(4)]
    llm = LLM(model=dst, max_model_len=64, kv_cache_memory=2**24)
    config = llm.llm_engine.model_config
    assert (config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.vocab_size) == (256, 512, 4, 4, 2, 49152)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4

"""K-quant and IQ4 GGUFs run on their own codes (`--quantization gguf`, what 'auto' picks for them):
the embedded model requantized as llama.cpp's Q4_K_M and IQ4_XS mixes, loaded without a dense copy, agrees with
the fp32 run on the same file's dequantized weights; loading stays within a bound of the file's
size; broken files and unsupported types are clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

from carpool.engine import LLMEngine
from carpool.model import cpu_kernels
from carpool.model.gguf_encode import random_gguf, requantize_gguf
from carpool.model.loader import open_gguf, resolve_quantization
from carpool.model.quant import QuantizedEmbedding, QuantizedLinear
from tests.helpers import run_greedy
from tests.model.test_quant import teacher_forced_logits

pytestmark = pytest.mark.skipif(not cpu_kernels.has_kq_matmul(), reason="needs AVX-512 VNNI or AVX2 (csrc/kquant.c)")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def q4_k_m(model_path, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "smollm2-q4_k_m.gguf")
    types = requantize_gguf(model_path, path, "Q4_K_M")
    assert {"Q4_K", "Q6_K"} <= set(types.values())  # K-quants where rows allow, fallbacks elsewhere
    return path


@pytest.fixture(scope="module")
def iq4_xs(model_path, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "smollm2-iq4_xs.gguf")
    types = requantize_gguf(model_path, path, "IQ4_XS")
    assert {"IQ4_XS", "IQ4_NL"} <= set(types.values())  # ffn_down's 1536 channels; rows of 576
    return path


def test_auto_keeps_k_quant_codes(q4_k_m):
    reader = open_gguf(q4_k_m)
    assert resolve_quantization("auto", CPU, torch.bfloat16, reader) == "gguf"
    assert resolve_quantization("auto", CPU, torch.float32, reader) == "none"  # the reference arithmetic
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_quantization("gguf", CPU, torch.bfloat16, None)


def test_an_unsupported_type_is_widened_with_a_warning_or_refused(caplog):
    tensors = [SimpleNamespace(name="blk.0.attn_q.weight", shape=(256, 256), tensor_type=T.Q4_K),
               SimpleNamespace(name="blk.0.ffn_down.weight", shape=(256, 256), tensor_type=T.IQ2_XXS)]
    reader = SimpleNamespace(tensors=tensors)
    with caplog.at_level("WARNING", logger="carpool"):
        assert resolve_quantization("auto", CPU, torch.bfloat16, reader) == "none"
    assert "blk.0.ffn_down.weight" in caplog.text and "IQ2_XXS" in caplog.text
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight.*IQ2_XXS"):
        resolve_quantization("gguf", CPU, torch.bfloat16, reader)


def test_broken_files_are_clear_errors(q4_k_m, tmp_path):
    data = open(q4_k_m, "rb").read()
    for name, cut in (("header", 2000), ("tensors", len(data) // 2)):
        path = tmp_path / f"cut-{name}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated"):
            LLMEngine(model=str(path), kv_cache_memory=16 << 20)


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["q4_k_m", "iq4_xs"])
def test_quantized_gguf_agrees_with_fp32_on_its_dequantized_weights(mix, request):
    """Top-1 agreement, teacher-forced over a prompt and 256 greedy fp32 tokens, >= 95%: the
    fp32 engine dequantizes the same file (the reference), the bf16 one multiplies its codes."""
    path = request.getfixturevalue(mix)
    reference = LLMEngine(model=path, dtype="float32", kv_cache_memory=64 << 20)
    assert reference.runner.model.quantization == "none"
    prompt = reference.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    seq = prompt + run_greedy(reference, [prompt], 256)[0]
    want = teacher_forced_logits(reference, seq).argmax(-1)
    reference.shutdown()
    engine = LLMEngine(model=path, dtype="bfloat16", kv_cache_memory=64 << 20)
    model = engine.runner.model
    assert model.quantization == "gguf"
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * engine.model_config.num_layers + 1 and all(m.kq is not None for m in layers)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.kq is model.lm_head.kq
    assert not any(p.dim() == 2 and p.shape[1] == engine.model_config.hidden_size and p.shape[0] != model.config.vocab_size
                   for p in model.layers.parameters())  # no dense layer weights
    got = teacher_forced_logits(engine, seq).argmax(-1)
    agreement = (got == want).float().mean().item()
    print(f"{mix} top-1 agreement with fp32: {agreement:.4f} over {len(seq)} positions")
    assert agreement >= 0.95


# VmHWM, not ru_maxrss: the latter survives exec, so a child would inherit the test process's peak.
RSS_SCRIPT = """
import sys, torch
from carpool.model.loader import load_model
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
before = status("VmRSS")
model = load_model(sys.argv[1], torch.bfloat16, torch.device("cpu"), quantization="auto")
assert model.quantization == "gguf"
print(before, status("VmRSS"), status("VmHWM"))
"""


@pytest.mark.parametrize("mix", ["q4_k_m", pytest.param("iq4_xs", marks=pytest.mark.slow)])  # iq4_xs: ~17 s
def test_loading_memory_is_a_bounded_multiple_of_the_file(mix, request):
    """Resident memory after load within the file's size + 200 MB over the process before it
    (measured: +220 MB for a 100 MB file), and the peak while loading within 5x the file + 200 MB
    (measured: +450 MB; the transients are a tensor's codes unpacked to a byte each and numpy's
    temporaries while packing them). The embedding and a tied LM head share one packed copy."""
    path = request.getfixturevalue(mix)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, path], capture_output=True, text=True, check=True)
    before, after, peak = map(int, out.stdout.split())
    size = os.path.getsize(path)
    print(f"file {size >> 20} MB: +{(after - before) >> 20} MB after load, peak +{(peak - before) >> 20} MB")
    assert after - before <= size + (200 << 20)
    assert peak - before <= 5 * size + (200 << 20)


@pytest.fixture(scope="module")
def random_q4_k_m(model_path, tmp_path_factory) -> str:
    """A small Llama (hidden 256, so every tensor takes K-quants) in llama-quantize's Q4_K_M."""
    path = str(tmp_path_factory.mktemp("gguf") / "random-q4_k_m.gguf")
    types = random_gguf(path, (256, 768, 8, 4, 2, False), "Q4_K_M", model_path)
    assert {"Q4_K", "Q6_K"} == {t for name, t in types.items() if name.startswith("blk.") and t != "F32"}
    return path


@pytest.mark.parametrize("mix", ["iq4_xs", "random_q4_k_m"])
def test_layers_are_held_at_the_files_size(mix, request):
    """The layers' packed tensors take at most 1.03x the bytes of their tensors in the file:
    Q4_K's 6-bit sub-scales are held as bytes (4.625 bits a weight for 4.5), once per 32
    channels as in the file; IQ4 codes stay 4-bit table indices (the kernels look them up); a
    fused q/k/v with v Q6_K keeps q and k in their own 4-bit form. Before each of these the
    layers took 1.7x (IQ4 as 8-bit codes) and 1.15x (Q4_K_M)."""
    from carpool.model.loader import load_model

    path = request.getfixturevalue(mix)
    model = load_model(path, torch.bfloat16, CPU, quantization="auto")
    linears = {name: m for name, m in model.named_modules()
               if name.startswith("layers.") and isinstance(m, QuantizedLinear)}
    assert linears and all(m.kq is not None for m in linears.values())
    if mix == "iq4_xs":
        assert sum(m.kq.struct.lookup for m in linears.values()) >= len(linears) // 2
    else:  # llama-quantize gives some layers' v Q6_K: their q/k/v are stacked parts
        assert any(len(m.kq.parts) == 2 for name, m in linears.items() if name.endswith("qkv_proj"))
    held = sum(t.numel() * t.element_size() for m in linears.values() for t in m.kq.tensors if t is not None)
    in_file = sum(t.n_bytes for t in open_gguf(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    print(f"layers: {held >> 10} KiB held for {in_file >> 10} KiB in the file")
    assert held <= 1.03 * in_file

"""`carpool bench quant` end to end on a tiny random Llama: JSON, table and plot are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool.cli import main
from carpool.model import cpu_kernels
from tests.model.test_hf_folder import write_checkpoint


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_bench_quant_tiny(tmp_path, engine_fp32, capsys):
    model = tmp_path / "tiny"
    write_checkpoint(model, "llama", engine_fp32.tokenizer)
    out = tmp_path / "out"
    rc = main(["bench", "quant", "--model", str(model), "--dtype", "bfloat16", "--num-threads", "2",
               "--kv-cache-memory", "16MiB", "--tokens", "1,16,256", "--rounds", "1", "--new-tokens", "4",
               "--modes", "none,int4", "--output", str(out)])
    assert rc == 0
    result = json.loads((out / "quant.json").read_text())
    assert {r["shape"] for r in result["kernels"]} == {"qkv", "o", "gate_up", "down", "lm_head"}
    timed = ["int8 torch", "int4 torch"] + (["int8 C", "int4 C"] if cpu_kernels.has_quantized_matmul() else [])
    assert all(r[f"{k}_s"] > 0 for r in result["kernels"] for k in timed)
    assert set(result["single_stream"]) == {"none", "int4"}
    assert result["single_stream"]["int4"]["mode_in_use"] == "int4"
    peak = result["int8_peak_gops"]
    assert (peak > 0) == ("avx512_vnni" in cpu_flags())  # vpdpbusd's rate where the CPU has it
    if cpu_kernels.has_quantized_matmul():  # the summary: prefill vs bf16, 16 tokens vs 1, rate, per kernel
        summary = result["targets"]["int4 C"]
        assert set(summary) == {"prefill_256_vs_bf16", "batch16_vs_batch1_tokens_per_s", "prefill_256_gops",
                                *(["prefill_256_of_int8_peak"] if peak else [])}
        at_256 = [r for r in result["kernels"] if r["tokens"] == 256]
        ops = sum(2 * r["in"] * r["out"] * 256 for r in at_256)
        assert summary["prefill_256_gops"] == pytest.approx(ops / sum(r["int4 C_s"] for r in at_256) / 1e9)
        if peak:
            assert summary["prefill_256_of_int8_peak"] == pytest.approx(summary["prefill_256_gops"] / peak)
    assert (out / "quant.png").stat().st_size > 0 and "| lm_head |" in (out / "quant.md").read_text()


def test_bench_quant_rejects_unknown_mode(capsys):
    assert main(["bench", "quant", "--modes", "int3"]) == 2
    assert "int3" in capsys.readouterr().err

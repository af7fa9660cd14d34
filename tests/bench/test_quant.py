"""`carpool bench quant` end to end on a tiny random Llama: JSON, table and plot are written."""

from __future__ import annotations

import json

from carpool.cli import main
from carpool.model import cpu_kernels
from tests.model.test_hf_folder import write_checkpoint


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
    if cpu_kernels.has_quantized_matmul():  # the summary: prefill vs bf16, 16 tokens vs 1, per kernel
        assert set(result["targets"]["int4 C"]) == {"prefill_256_vs_bf16", "batch16_vs_batch1_tokens_per_s"}
    assert (out / "quant.png").stat().st_size > 0 and "| lm_head |" in (out / "quant.md").read_text()


def test_bench_quant_rejects_unknown_mode(capsys):
    assert main(["bench", "quant", "--modes", "int3"]) == 2
    assert "int3" in capsys.readouterr().err

"""`carpool bench quant`: weight-only quantized kernels against oneDNN bf16 on this CPU.

For every weight shape of the model (fused QKV, O, fused gate/up, down, LM head) and token count,
times carpool's quantized layers as the engine calls them (int4 / int8: csrc/quant_gemv.c at decode
sizes; GGUF Q4_K / Q6_K / IQ4_XS: csrc/kquant.c, IQ4_XS also as the 8-bit codes its values become
beside other types; all from their own codes at every size, the bf16
tile kernel from quant.tile_from() tokens), torch's `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu`, and the bf16 tiles (`TiledLinear`) the engine uses for unquantized
models where the CPU has AVX512-BF16, against bf16 `F.linear` and the oneDNN-packed `PackedLinear`
it uses elsewhere. Each shape has one weight per layer, called in
turn, so weights come from memory as in a forward pass rather than from a hot cache; kernels are
interleaved and the best of a few rounds is kept, so ratios hold on a busy host. Then one greedy
stream decodes per `--quantization` mode through the whole engine (the engines take turns, best
of the same rounds). The summary states, per quantized kernel, prefill speed at 256 tokens as a
ratio to the packed bf16 GEMM, a 16-token step's tokens/s as a ratio to a 1-token step's, and the
256-token rate in GOP/s beside the CPU's `vpdpbusd` rate alone, measured at the start of the run
(csrc/kquant.c `int8_peak_gops`): how far an integer kernel's prefill is from what the CPU can do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

from carpool.bench.hostload import OtherCpu
from carpool.bench.hybrid import carpool_single_stream
from carpool.config import EngineConfig, ModelConfig
from carpool.harness.metrics import cpu_name
from carpool.model import cpu_kernels, gguf_codes, gguf_encode
from carpool.model.llama import PackedLinear, TiledLinear, can_pack_linears
from carpool.model.quant import QuantizedLinear

# "C": the layer as the engine calls it; "VNNI" / "AMX": quant_gemv.c's integer kernel on one of
# the two at every token count (same outputs); "bf16 tiles": the bf16 layer where the CPU has
# AVX512-BF16 (TiledLinear), against oneDNN's packed one.
KERNELS = ("bf16 F.linear", "bf16 packed", "bf16 tiles", "int8 torch", "int4 torch", "int8 C", "int4 C", "Q4_K C",
           "Q6_K C", "IQ4_XS C", "IQ4_XS C 8-bit", "int4 C VNNI", "int4 C AMX")
COMPARED = KERNELS[2:]  # each against the packed bf16 layer


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """name -> (in, out, copies): the linears of one decoder layer, as fused in model/llama.py,
    and the LM head (one copy)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    return {"qkv": (h, q + 2 * kv, n), "o": (q, h, n), "gate_up": (h, 2 * inter, n),
            "down": (inter, h, n), "lm_head": (h, cfg.vocab_size, 1)}


def layer_kernels(in_features: int, out_features: int, copies: int, dtype: torch.dtype,
                  generator: torch.Generator, only: tuple[str, ...] = KERNELS) -> dict[str, list]:
    """`copies` random weights of one shape, each prepared for every kernel (of `only`)."""
    kernels: dict[str, list] = {k: [] for k in KERNELS}
    for _ in range(copies):
        linear = nn.Linear(in_features, out_features, bias=False)
        linear.weight.data = torch.randn(out_features, in_features, generator=generator) * 0.02
        for mode in ("int8", "int4"):
            kernels[f"{mode} torch"].append(QuantizedLinear(linear, mode, dtype, c_kernel=False).to(dtype).quantized)
            with_c = QuantizedLinear(linear, mode, dtype).to(dtype)
            if with_c.kernel is not None:
                kernels[f"{mode} C"].append(with_c)
            if with_c.kernel is not None and mode == "int4" and cpu_kernels.has_amx():
                kernels["int4 C VNNI"].append(functools.partial(with_c.kernel, amx_from=0))
                kernels["int4 C AMX"].append(functools.partial(with_c.kernel, amx_from=1))
        if dtype == torch.bfloat16 and cpu_kernels.has_kq_matmul() and in_features % 256 == 0:
            for qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_XS):
                if not any(name.startswith(qtype.name) for name in only):
                    continue
                codes = gguf_codes.decode(gguf_encode.quantize(linear.weight.numpy(), qtype), qtype,
                                          (out_features, in_features))
                kernels[f"{qtype.name} C"].append(QuantizedLinear.from_codes(codes, None, dtype))
                if codes.lookup:  # the same values as 8-bit codes, as a projection stacked with other types holds them
                    wide = dataclasses.replace(codes, q=codes.codes8, bits=8, lookup=False)
                    kernels[f"{qtype.name} C 8-bit"].append(QuantizedLinear.from_codes(wide, None, dtype))
        dense = linear.to(dtype).requires_grad_(False)
        kernels["bf16 F.linear"].append(dense)
        if can_pack_linears(torch.device("cpu"), dtype):
            kernels["bf16 packed"].append(PackedLinear(dense))
        if dtype == torch.bfloat16 and cpu_kernels.has_bf16_tiles() and in_features % 32 == 0:
            kernels["bf16 tiles"].append(TiledLinear(dense))
    return {k: v for k, v in kernels.items() if v and k in only}


def time_shape(kernels: dict[str, list], in_features: int, tokens: int, dtype: torch.dtype,
               rounds: int) -> dict[str, float]:
    """Seconds per call of each kernel at `tokens` rows: best of `rounds` passes over all copies."""
    x = torch.randn(tokens, in_features, dtype=dtype)
    best = {k: float("inf") for k in kernels}
    for _ in range(rounds + 1):  # the first pass warms up
        for name, fns in kernels.items():
            t = time.perf_counter()
            for fn in fns:
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - t) / len(fns))
    return best


def kernel_table(cfg: ModelConfig, tokens: list[int], rounds: int, dtype: torch.dtype, log=print,
                 only: tuple[str, ...] = KERNELS) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, (k, n, copies) in model_shapes(cfg).items():
            kernels = layer_kernels(k, n, copies, dtype, gen, only)
            for m in tokens:
                t = time_shape(kernels, k, m, dtype, rounds)
                rows.append({"shape": name, "in": k, "out": n, "tokens": m,
                             **{f"{kk}_s": v for kk, v in t.items()}})
                ref = t.get("bf16 packed", t["bf16 F.linear"])
                log(f"{name:8s} {k:5d}x{n:<6d} M={m:4d}: " + "  ".join(
                    f"{kk} {v * 1e6:8.1f} us ({ref / v:4.2f}x)" for kk, v in t.items()))
            del kernels
    return rows


def decode_per_mode(config: EngineConfig, modes: list[str], new_tokens: int, rounds: int) -> dict[str, dict]:
    """Single-stream greedy decode tokens/s per --quantization mode (same prompt, whole engine),
    with the crossovers each engine chose. The engines take turns, best of `rounds` each."""
    from carpool.engine import LLMEngine

    engines = {}
    for mode in modes:
        config.quantization = mode
        engines[mode] = LLMEngine(config)
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for mode, engine in engines.items():
            result = carpool_single_stream(engine, new_tokens)
            if mode not in best or result["decode_tokens_per_s"] > best[mode]["decode_tokens_per_s"]:
                best[mode] = result
    for mode, engine in engines.items():
        best[mode]["mode_in_use"] = engine.runner.model.quantization
        print(f"--quantization {mode} ({best[mode]['mode_in_use']}): "
              f"{best[mode]['decode_tokens_per_s']:.1f} decode tokens/s")
        engine.shutdown()
    return best


def run_quant_bench(config: EngineConfig, args) -> dict:
    from carpool.config import resolve_device, resolve_dtype
    from carpool.model.loader import is_gguf, load_model_config, open_gguf

    from carpool.model.quant import QUANTIZATIONS

    only = tuple(dict.fromkeys(["bf16 F.linear", *(args.kernels or KERNELS)]))  # the reference always runs
    unknown = [k for k in only if k not in KERNELS]
    if unknown:
        raise ValueError(f"--kernels: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(KERNELS)}")
    for mode in args.modes:
        if mode not in QUANTIZATIONS:
            raise ValueError(f"--modes: unknown quantization {mode!r}; choose from {', '.join(QUANTIZATIONS)}")
    device = resolve_device(config.device)
    if device.type != "cpu":
        raise ValueError("carpool bench quant measures CPU kernels; use --device cpu")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dtype = resolve_dtype(config.dtype, device, config.model, config.quantization)  # the engine's, for this model
    cfg = load_model_config(config.model, open_gguf(config.model) if is_gguf(config.model) else None)
    cpu = OtherCpu()
    start = time.perf_counter()
    print(f"model {Path(config.model).name}; dtype {dtype}; threads {torch.get_num_threads()}")
    peak = cpu_kernels.int8_peak_gops(torch.get_num_threads())
    if peak:
        print(f"vpdpbusd alone: {peak:.0f} GOP/s on {torch.get_num_threads()} threads")
    rows = kernel_table(cfg, args.tokens, args.rounds, dtype, only=only)
    config.kv_cache_memory = config.kv_cache_memory or 256 << 20
    decode = decode_per_mode(config, args.modes, args.new_tokens, args.rounds) if args.new_tokens else {}
    result = {"model": config.model, "dtype": str(dtype), "threads": torch.get_num_threads(),
              "cpu": cpu_name(), "other_cpu_cores": cpu.sample(), "seconds": time.perf_counter() - start,
              "int8_peak_gops": peak, "kernels": rows, "targets": targets(rows, peak), "single_stream": decode}
    write_outputs(result, Path(args.output))
    return result


def targets(rows: list[dict], int8_peak_gops: float = 0.0) -> dict[str, dict[str, float]]:
    """Per kernel but the reference (the quantized ones and the bf16 tiles), summed over the
    model's shapes: prefill at 256 tokens as a speed ratio to the packed bf16 GEMM (>= 0.8 wanted: one copy of the weights costs prefill little),
    and a 16-token step's tokens/s over a 1-token step's (>= 4 wanted: batching pays). Also the
    256-token rate in GOP/s and as a share of `int8_peak_gops`, the CPU's `vpdpbusd` rate alone:
    how much faster an integer kernel's prefill could be at all (a share above 1 means the
    kernel runs on something faster, such as AMX tiles)."""
    def total(kernel: str, tokens: int) -> float | None:
        times = [r.get(f"{kernel}_s") for r in rows if r["tokens"] == tokens]
        return sum(times) if times and None not in times else None

    ref = "bf16 packed" if any("bf16 packed_s" in r for r in rows) else "bf16 F.linear"
    out = {}
    for kernel in COMPARED:
        prefill, dense, one, sixteen = total(kernel, 256), total(ref, 256), total(kernel, 1), total(kernel, 16)
        entry = {}
        if prefill and dense:
            entry["prefill_256_vs_bf16"] = dense / prefill
        if one and sixteen:
            entry["batch16_vs_batch1_tokens_per_s"] = 16 * one / sixteen
        if prefill:
            entry["prefill_256_gops"] = sum(2 * r["in"] * r["out"] * 256 for r in rows if r["tokens"] == 256) / prefill / 1e9
            if int8_peak_gops:
                entry["prefill_256_of_int8_peak"] = entry["prefill_256_gops"] / int8_peak_gops
        if entry:
            out[kernel] = entry
    return out


def write_outputs(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant.json").write_text(json.dumps(result, indent=2))
    kernels = [k for k in KERNELS if f"{k}_s" in result["kernels"][0]]
    ref = "bf16 packed" if "bf16 packed" in kernels else "bf16 F.linear"
    lines = [f"CPU {result['cpu']}, {result['threads']} threads, {result['dtype']}; other processes used "
             f"{result['other_cpu_cores']:.2f} cores on average during the run ({result['seconds']:.0f} s).", "",
             "| shape | in x out | tokens | " + " | ".join(f"{k} us" for k in kernels)
             + f" | speed-up vs {ref}: " + " / ".join(k for k in kernels if k in COMPARED) + " |",
             "|---|---|---|" + "---|" * len(kernels) + "---|"]
    for r in result["kernels"]:
        lines.append(f"| {r['shape']} | {r['in']}x{r['out']} | {r['tokens']} | "
                     + " | ".join(f"{r[f'{k}_s'] * 1e6:.1f}" for k in kernels) + " | "
                     + " / ".join(f"{r[f'{ref}_s'] / r[f'{k}_s']:.2f}x" for k in kernels if k in COMPARED) + " |")
    if result["targets"]:
        peak = result.get("int8_peak_gops", 0.0)
        lines += ["", "| kernel (all shapes) | prefill 256 tokens, speed vs bf16 | 16-token step vs 1-token, tokens/s "
                  f"| 256 tokens GOP/s | share of vpdpbusd's {peak:.0f} GOP/s |", "|---|---|---|---|---|"]
        nan = float("nan")
        for kernel, t in result["targets"].items():
            lines.append(f"| {kernel} | {t.get('prefill_256_vs_bf16', nan):.2f}x | "
                         f"{t.get('batch16_vs_batch1_tokens_per_s', nan):.2f}x | {t.get('prefill_256_gops', nan):.0f} | "
                         f"{t.get('prefill_256_of_int8_peak', nan):.2f} |")
    if result["single_stream"]:
        lines += ["", "| --quantization | decode tokens/s |", "|---|---|"]
        for mode, s in result["single_stream"].items():
            lines.append(f"| {mode} ({s['mode_in_use']}) | {s['decode_tokens_per_s']:.1f} |")
    (out / "quant.md").write_text("\n".join(lines) + "\n")
    plot(result, kernels, out / "quant.png")
    print("\n".join(lines))


def plot(result: dict, kernels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in result["kernels"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.2 * len(shapes), 3.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in result["kernels"] if r["shape"] == shape]
        for k in kernels:
            ax.plot([r["tokens"] for r in rows], [r[f"{k}_s"] * 1e6 for r in rows], marker="o", ms=3, label=k)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} {rows[0]['in']}x{rows[0]['out']}", fontsize=9)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("us per call")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"weight-only quantized vs bf16 linears ({result['cpu']}, {result['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

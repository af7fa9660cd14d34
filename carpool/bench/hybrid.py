"""`carpool bench hybrid`: the Sarathi paper's Table 2 on this machine, with the real runner.

Times prefill-only (C tokens), decode-only (D requests at context L) and hybrid (C-D prefill +
D decodes) iterations, and derives the cost of a decode token alone vs piggybacked on a prefill
chunk. Each iteration is also put against its roofline bound from this machine's measured GEMM
rate and memory bandwidth, and single-stream decode is compared with transformers in the same run.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from carpool.config import EngineConfig, cpu_has_fast_bf16
from carpool.engine import LLMEngine
from carpool.harness.synthetic import SyntheticBatches, median_time
from carpool.model.llama import PackedLinear
from carpool.model.quant import QuantizedLinear


@dataclass
class Machine:
    gemm_tflops: dict[str, float]
    mem_gbs: float  # STREAM's copy: 2 x bytes copied / time
    threads: int
    mem_read_gbs: float = 0.0  # bytes summed / time: reads alone, as a decode step's weights are


def measure_machine(repeats: int = 5, size: int = 2048) -> Machine:
    """Peak-ish GEMM rate per dtype (size^3; bf16 at a quarter of it where torch emulates bf16
    GEMMs: at full size that took minutes) and DRAM bandwidth: copying a 512 MiB tensor, as
    STREAM counts it, and reading it alone (a sum), which runs faster: no writes."""
    rates = {}
    for name, dt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        n = size if dt == torch.float32 or cpu_has_fast_bf16() else size // 4
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        rates[name] = 2 * n**3 / median_time(lambda: a @ b, repeats) / 1e12
    copy, read = memory_rates(repeats)
    return Machine(rates, copy, torch.get_num_threads(), read)


def memory_rates(repeats: int = 5) -> tuple[float, float]:
    """GB/s of copying a 512 MiB tensor (as STREAM counts it: 2 x bytes / time) and of reading it
    alone (a sum)."""
    src = torch.empty(128 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy = median_time(lambda: dst.copy_(src), repeats)
    read = median_time(lambda: src.sum(), repeats)
    return 2 * src.numel() * 4 / copy / 1e9, src.numel() * 4 / read / 1e9


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads, as stored: a quantized linear's packed weights and
    scales (the C kernels' are attributes), a oneDNN-packed weight, every other tensor once (tied
    ones once), but not the embedding table (one row per token)."""
    skip = {id(m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "embed_tokens"}
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if id(m) in skip:
            continue
        if isinstance(m, PackedLinear):  # the packed weight is an attribute, not a parameter
            total += m.packed.numel() * m.packed.element_size()
        if isinstance(m, QuantizedLinear) and (m.kernel is not None or m.kq is not None):
            total += sum(t.numel() * t.element_size() for t in m.weight_tensors())
        for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


class Roofline:
    """Lower bound on an iteration's time: max(FLOPs / GEMM peak, bytes / DRAM bandwidth), with
    the weights' bytes as stored (quantized or not)."""

    def __init__(self, engine: LLMEngine, machine: Machine):
        cfg = engine.model_config
        self.cfg = cfg
        h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        self.layer_params = h * (q + 2 * kv) + q * h + 3 * h * inter
        self.elt = engine.dtype.itemsize
        self.weight_bytes = weight_bytes_read(engine.model)
        self.kv_token_bytes = 2 * cfg.num_layers * kv * self.elt
        self.peak = machine.gemm_tflops["bfloat16" if engine.dtype == torch.bfloat16 else "float32"] * 1e12
        self.bw = machine.mem_gbs * 1e9

    def bound(self, prefill_tokens: int, prefill_context: int, decodes: int, decode_context: int) -> float:
        cfg = self.cfg
        tokens = prefill_tokens + decodes
        sampled = decodes + (1 if prefill_tokens else 0)
        flops = 2 * tokens * cfg.num_layers * self.layer_params + 2 * sampled * cfg.hidden_size * cfg.vocab_size
        attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
        flops += attn * (prefill_tokens * (prefill_context + prefill_tokens / 2) + decodes * decode_context)
        kv = self.kv_token_bytes * (prefill_context + prefill_tokens + decodes * (decode_context + 1))
        return max(flops / self.peak, (self.weight_bytes + kv) / self.bw)

    def weight_bytes_bound(self, decodes: int, decode_context: int, bandwidth: float | None = None) -> float:
        """A decode step's floor whatever kernels run: its weights as stored and its KV, read
        once at DRAM speed (the copy rate unless `bandwidth` is given, in bytes/s; the GEMM peak
        above is the dense dtype's, which quantized kernels, and on AVX2 alone emulated bf16, do
        not run at)."""
        return (self.weight_bytes + self.kv_token_bytes * decodes * (decode_context + 1)) / (bandwidth or self.bw)


BATCH1_REPEATS = 100
BATCH1_ROUNDS = 5  # rounds of batch-1 steps, the memory rates measured before each


def time_batch(synthetic: SyntheticBatches, grants, repeats: int) -> float:
    """Median time of model runner + greedy sampling for one fixed batch (state is not advanced,
    so every repeat runs exactly the same shapes)."""
    def once():
        logits = synthetic.run(grants, advance=False)
        logits.argmax(-1)

    return median_time(once, repeats)


SINGLE_STREAM_PROMPT = "Write a long story about a lighthouse keeper and a storm."


def carpool_single_stream(engine: LLMEngine, new_tokens: int) -> dict:
    """Tokens/s of one request through the whole engine loop (scheduler, runner, sampler,
    detokenizer), over its decode phase."""
    from carpool.sampling_params import SamplingParams

    ids = engine.tokenizer.encode(SINGLE_STREAM_PROMPT)
    request = engine.add_request(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    times = request.token_times
    return {"prompt_tokens": len(ids), "new_tokens": new_tokens,
            "decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0])}


def hf_single_stream(model_path: str, dtype: torch.dtype, new_tokens: int) -> dict:
    """transformers on the same GGUF weights, same prompt: a greedy loop over its KV cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.cache_utils import DynamicCache

    p = Path(model_path)
    kwargs = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    folder = p.parent if p.suffix == ".gguf" else p
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(folder, **kwargs).encode(SINGLE_STREAM_PROMPT)])
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        elapsed = time.perf_counter() - t
    return {"decode_tokens_per_s": (new_tokens - 1) / elapsed}


def run_hybrid_bench(config: EngineConfig, args) -> dict:
    chunks = [int(c) for c in args.chunks.split(",")]
    decodes = [int(d) for d in args.decodes.split(",")]
    if min(chunks + decodes) < 1:
        raise ValueError("--chunks and --decodes take counts of 1 or more (each row's prefill-only column is "
                         "its chunk alone)")
    L, repeats = args.context, args.repeats
    config.kv_cache_memory = config.kv_cache_memory or 1 << 30
    engine = LLMEngine(config)
    machine = measure_machine()
    roof = Roofline(engine, machine)
    gen = torch.Generator().manual_seed(0)
    synthetic = SyntheticBatches(engine)
    vocab = engine.model_config.vocab_size
    print(f"machine: {machine}; model dtype {engine.dtype}; threads {torch.get_num_threads()}")

    contexts = [synthetic.with_cached_context(L, gen) for _ in range(max(decodes))]
    prompt = lambda n: synthetic.new(torch.randint(vocab, (n,), generator=gen).tolist())

    def prefill(n: int) -> float:
        return time_batch(synthetic, [(prompt(n), n)], repeats)

    rows = []
    prefill_cache: dict[int, float] = {}
    for C in chunks:
        prefill_cache.setdefault(C, prefill(C))
        for D in decodes:
            if D >= C:
                continue
            prefill_cache.setdefault(C - D, prefill(C - D))
            decode_only = time_batch(synthetic, [(r, 1) for r in contexts[:D]], repeats)
            hybrid = time_batch(synthetic, [(r, 1) for r in contexts[:D]] + [(prompt(C - D), C - D)], repeats)
            row = {
                "C": C, "D": D, "L": L,
                "prefill_only_s": prefill_cache[C],
                "decode_only_s": decode_only,
                "hybrid_s": hybrid,
                "decode_token_alone_s": decode_only / D,
                "decode_token_piggybacked_s": max(0.0, hybrid - prefill_cache[C - D]) / D,
                "prefill_roofline_frac": roof.bound(C, 0, 0, 0) / prefill_cache[C],
                "decode_roofline_frac": roof.bound(0, 0, D, L) / decode_only,
                "hybrid_roofline_frac": roof.bound(C - D, 0, D, L) / hybrid,
            }
            row["piggyback_ratio"] = row["decode_token_piggybacked_s"] / row["decode_token_alone_s"]
            rows.append(row)
            print(f"C={C:4d} D={D:3d}: prefill {prefill_cache[C]*1e3:7.1f} ms  decode {decode_only*1e3:7.1f} ms  "
                  f"hybrid {hybrid*1e3:7.1f} ms  decode/token alone {row['decode_token_alone_s']*1e3:6.2f} ms "
                  f"piggybacked {row['decode_token_piggybacked_s']*1e3:6.2f} ms ({row['piggyback_ratio']:.2f}x)")

    # One decode alone: how close a step comes to reading the weights once at DRAM speed. The
    # step is ~10 ms and this host's steps swing by 10% from one to the next: a median of many.
    # The memory rates are taken between its rounds: a shared host's speed moves within minutes
    # (a 1B step on a Zen 3 came out 1.48x its read roofline against rates measured at the run's
    # start, 1.08x fifteen minutes later), so the step and the rates have to share their minutes.
    steps, copies, reads = [], [], []
    for _ in range(BATCH1_ROUNDS):
        copy, read = memory_rates(3)
        copies.append(copy), reads.append(read)
        steps.append(time_batch(synthetic, [(contexts[0], 1)], max(repeats, BATCH1_REPEATS) // BATCH1_ROUNDS))
    batch1, copy_gbs, read_gbs = statistics.median(steps), statistics.median(copies), statistics.median(reads)
    batch1_decode = {"step_s": batch1, "roofline_s": roof.weight_bytes_bound(1, L, copy_gbs * 1e9),
                     "weight_bytes": roof.weight_bytes, "copy_gbs": copy_gbs, "read_gbs": read_gbs,
                     "rounds": {"step_s": steps, "copy_gbs": copies, "read_gbs": reads}}
    batch1_decode["x_roofline"] = batch1 / batch1_decode["roofline_s"]
    batch1_decode["read_roofline_s"] = roof.weight_bytes_bound(1, L, read_gbs * 1e9)
    batch1_decode["x_read_roofline"] = batch1 / batch1_decode["read_roofline_s"]
    print(f"batch-1 decode step {batch1*1e3:.1f} ms = {batch1_decode['x_roofline']:.2f}x its roofline "
          f"({roof.weight_bytes/1e6:.0f} MB of weights at {copy_gbs:.1f} GB/s); "
          f"{batch1_decode['x_read_roofline']:.2f}x at the read rate ({read_gbs:.1f} GB/s), both taken between its rounds")

    # Iteration cost around the default budget: is the token count on a fast size?
    sweep = {n: prefill(n) for n in range(480, 561, 8) if n <= engine.max_model_len}
    sweep.update({n: prefill(n) for n in (513, 520, 528) if n <= engine.max_model_len})
    synthetic.close()

    result = {
        "machine": asdict(machine),
        "model": config.model, "dtype": str(engine.dtype), "context": L, "repeats": repeats,
        "quantization": config.quantization,
        "rows": rows,
        "batch1_decode": batch1_decode,
        "token_count_sweep_s": sweep,
        "single_stream": {"carpool": carpool_single_stream(engine, 128)},
    }
    if not args.no_hf:
        for dtype in (engine.dtype, torch.float32) if engine.dtype != torch.float32 else (torch.float32,):
            result["single_stream"][f"transformers_{str(dtype).removeprefix('torch.')}"] = \
                hf_single_stream(config.model, dtype, 128)
    write_outputs(result, Path(args.output))
    return result


def write_outputs(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Machine: bf16 GEMM {result['machine']['gemm_tflops']['bfloat16']:.2f} TFLOP/s, fp32 "
        f"{result['machine']['gemm_tflops']['float32']:.2f} TFLOP/s, DRAM {result['machine']['mem_gbs']:.1f} GB/s "
        f"(copy; read alone {result['machine'].get('mem_read_gbs', 0.0):.1f} GB/s), "
        f"{result['machine']['threads']} threads; model dtype {result['dtype']}, L = {result['context']}.",
        "",
        "| C | D | prefill-only ms | decode-only ms | hybrid ms | decode/token alone ms | piggybacked ms | ratio | "
        "roofline frac (prefill / decode / hybrid) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['C']} | {r['D']} | {r['prefill_only_s']*1e3:.1f} | {r['decode_only_s']*1e3:.1f} | "
            f"{r['hybrid_s']*1e3:.1f} | {r['decode_token_alone_s']*1e3:.2f} | "
            f"{r['decode_token_piggybacked_s']*1e3:.2f} | {r['piggyback_ratio']:.2f} | "
            f"{r['prefill_roofline_frac']:.2f} / {r['decode_roofline_frac']:.2f} / {r['hybrid_roofline_frac']:.2f} |")
    b1 = result["batch1_decode"]
    lines += ["", f"Batch-1 decode step (context {result['context']}): {b1['step_s']*1e3:.1f} ms, "
                  f"{b1['x_roofline']:.2f}x its roofline ({b1['roofline_s']*1e3:.1f} ms: "
                  f"{b1['weight_bytes']/1e6:.0f} MB of weights as stored and the KV, quantization "
                  f"{result['quantization']}, at the {b1['copy_gbs']:.1f} GB/s copy rate); "
                  f"{b1['x_read_roofline']:.2f}x at the read-alone {b1['read_gbs']:.1f} GB/s (both rates taken "
                  f"between the step's rounds)."]
    lines += ["", "| tokens in iteration | ms | us/token |", "|---|---|---|"]
    for n, s in sorted(result["token_count_sweep_s"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {n} | {s*1e3:.1f} | {s/int(n)*1e6:.1f} |")
    ss = result["single_stream"]
    ours = ss["carpool"]["decode_tokens_per_s"]
    lines += ["", f"Single-stream decode ({ss['carpool']['prompt_tokens']}-token prompt, "
                  f"{ss['carpool']['new_tokens']} new tokens, greedy): carpool {ours:.1f} tokens/s"]
    for name, hf in ss.items():
        if name.startswith("transformers"):
            lines[-1] += f"; {name.replace('_', ' ')} {hf['decode_tokens_per_s']:.1f} tokens/s ({ours / hf['decode_tokens_per_s']:.2f}x)"
    (out / "hybrid.md").write_text("\n".join(lines) + "\n")
    plot(result, out / "hybrid.png")
    print("\n".join(lines))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"C={r['C']}\nD={r['D']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["decode_token_alone_s"] * 1e3 for r in rows], 0.4, label="decode-only")
    ax.bar([i + 0.2 for i in x], [r["decode_token_piggybacked_s"] * 1e3 for r in rows], 0.4, label="piggybacked")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per decode token")
    ax.set_title(f"Decode token cost alone vs piggybacked ({result['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Decode-only step time against batch size: the fused path (model/fused_layers.py) against the
eager layers, with the kernels as chosen at start-up and with every matmul on the quantized
kernel. Median of `repeats` per point, the three alternated in one process over the same
random cached contexts.

    python -m carpool.bench.decode_sweep --context 512 --output bench_results/decode_sweep/context512.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from carpool.bench.synthetic import SyntheticBatches
from carpool.config import default_model_path
from carpool.engine import LLMEngine
from carpool.model.fused_layers import FusedLayers
from carpool.model.quant import QuantizedLinear

BATCHES = (1, 2, 4, 8, 12, 16, 20, 24, 31)


def sweep(engine: LLMEngine, context: int, batches=BATCHES, repeats: int = 7) -> list[dict]:
    model = engine.model
    fused = model.fused_layers or FusedLayers.build(model)
    if fused is None:
        raise SystemExit("no fused path here (needs bf16, quantized weights, AVX-512 VNNI)")
    chosen = {m: m.max_quantized_tokens for m in model.modules() if isinstance(m, QuantizedLinear)}
    synthetic = SyntheticBatches(engine)
    g = torch.Generator().manual_seed(0)
    requests = [synthetic.with_cached_context(context, g) for _ in range(max(batches))]

    def median_step(grants) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            synthetic.run(grants, advance=False)
            times.append(time.perf_counter() - start)
        return sorted(times)[repeats // 2]

    rows = []
    try:
        for d in batches:
            grants = [(r, 1) for r in requests[:d]]
            model.fused_layers = None
            for m, n in chosen.items():
                m.max_quantized_tokens = n
            eager = median_step(grants)
            for m in chosen:
                m.max_quantized_tokens = max(batches)
            eager_quantized = median_step(grants)
            model.fused_layers = fused
            rows.append({"decodes": d, "context": context, "eager_s": eager, "eager_quantized_s": eager_quantized,
                         "fused_s": median_step(grants)})
    finally:
        for m, n in chosen.items():
            m.max_quantized_tokens = n
        model.fused_layers = fused
        synthetic.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    engine = LLMEngine(model=default_model_path(), dtype="bfloat16", kv_cache_memory=512 << 20)
    rows = sweep(engine, args.context, repeats=args.repeats)
    print(f"| decodes (context {args.context}) | eager ms | eager, all quantized ms | fused ms |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['decodes']} | {r['eager_s'] * 1e3:.1f} | {r['eager_quantized_s'] * 1e3:.1f} | "
              f"{r['fused_s'] * 1e3:.1f} |")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"cpu_threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

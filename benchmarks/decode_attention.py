"""The C decode attention alone, over a model's layers: ms a step, KV read rate and multiply-adds.

    .venv/bin/python benchmarks/decode_attention.py [--decodes 1,4,16] [--contexts 800,3200]
        [--layers 30 --heads 9 --kv-heads 3 --head-dim 64] [--base REV] [--rounds 9] [--output OUT.json]

A decode step's attention reads each decode's whole context of K and V once, so at long contexts
it is bound by memory, and a step's other work (the linears) does not grow with the context.
Blocks are taken in order (`seq`, as a fresh engine hands them out) and scattered at random
(`scattered`, as a long-running engine's free list leaves them). One KV cache per layer, of
--blocks blocks, so a step reads from DRAM as the engine does. The host's read rate (a sum over
512 MiB) is taken after each row's rounds, so the kernel's rate is put beside the host's own.
With --base REV the same calls alternate with REV's kernels (`ab_kernels.load_at`), the outputs
compared bit for bit (or, with --tolerance, within it: for a change of the sums' order).
The defaults are the embedded model's shape (SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ab_kernels import load_at
from carpool.bench.hybrid import memory_rates
from carpool.model import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", default="1,4,16")
    ap.add_argument("--contexts", default="800,3200")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4096, help="KV blocks per layer's cache")
    ap.add_argument("--base", help="git revision whose kernels to alternate with")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="largest difference allowed between the builds' outputs (0: bit for bit)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    libs = {"tree": cpu_kernels.library()}
    if args.base:
        libs = {"base": load_at(args.base), **libs}
    active = ["tree"]
    cpu_kernels.library = lambda: libs[active[0]]

    torch.manual_seed(0)
    bs, kv, dim = args.block_size, args.kv_heads, args.head_dim
    caches = [torch.randn(2, args.blocks * bs, kv, dim).bfloat16() for _ in range(args.layers)]
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        for n in map(int, args.decodes.split(",")):
            per_seq = -(-ctx // bs)
            if n * per_seq > args.blocks:
                raise SystemExit(f"{n} decodes at context {ctx} need {n * per_seq} blocks; raise --blocks")
            for order in ("seq", "scattered"):
                pick = torch.arange(args.blocks) if order == "seq" else torch.randperm(args.blocks)
                tables = pick[: n * per_seq].view(n, per_seq).contiguous()
                lens = torch.full((n,), ctx, dtype=torch.int64)
                q = torch.randn(n, args.heads, dim).bfloat16()
                ms, outs = {name: [] for name in libs}, {}
                for r in range(args.rounds + 1):
                    for name in libs if r % 2 == 0 else reversed(libs):
                        active[0] = name
                        out = torch.empty_like(q)
                        start = time.perf_counter()
                        for cache in caches:
                            cpu_kernels.paged_decode_attention(q, cache, tables, lens, dim ** -0.5, bs, out=out)
                        if r:  # the first round warms
                            ms[name].append((time.perf_counter() - start) * 1e3)
                        outs[name] = out
                differ = max((outs["tree"].float() - o.float()).abs().max().item() for o in outs.values())
                if differ > args.tolerance:
                    raise SystemExit(f"the builds differ by {differ:g} at {n} decodes, context {ctx}")
                read_gb_per_s = memory_rates(3)[1]
                kv_bytes = n * ctx * kv * dim * 2 * 2 * args.layers  # K and V, bf16
                macs = n * ctx * args.heads * dim * 2 * args.layers  # scores and the weighted sum
                best = {name: min(v) for name, v in ms.items()}
                row = {"decodes": n, "context": ctx, "blocks": order, "ms": ms, "max_difference": differ,
                       "kv_gb_per_s": kv_bytes / best["tree"] / 1e6, "gmac_per_s": macs / best["tree"] / 1e6,
                       "host_read_gb_per_s": read_gb_per_s}
                line = (f"{n} decodes, context {ctx}, {order} blocks: {best['tree']:.2f} ms a step, "
                        f"KV {row['kv_gb_per_s']:.1f} GB/s ({row['kv_gb_per_s'] / read_gb_per_s:.2f}x the host's "
                        f"read rate, {read_gb_per_s:.1f} GB/s), {row['gmac_per_s']:.1f} G multiply-adds/s")
                if args.base:
                    row["base_over_tree"] = statistics.median(b / t for b, t in zip(ms["base"], ms["tree"]))
                    line += f"; base {best['base']:.2f} ms, base/tree {row['base_over_tree']:.3f}"
                rows.append(row)
                print(line, flush=True)
    if args.output:
        args.output.write_text(json.dumps({"base": args.base, "args": vars(args) | {"output": str(args.output)},
                                           "cpu": cpu_kernels.cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Two builds of the C kernels side by side in one process: one weight's product alternated.

    .venv/bin/python benchmarks/ab_kernel_shapes.py --base REV --model FILE.gguf [--tensors blk.0.ffn_up.weight,...]
        [--int4 NxK,...] [--tokens 16,64,256] [--rounds 7] [--output OUT.json]

ab_kernels.py compares whole engine steps; this compares the matmul alone, at token counts the
engine may not isolate (5-7 tokens, say). Each named GGUF tensor is decoded once and bound to each
build's kernel (`quant.packed_kernel`, the loader's form); `--int4 NxK` adds a random weight of that
shape in carpool's int4 (`QuantizedLinear`). Calls alternate between the builds, the order flipped
every round; the ratio is the median of the rounds' base/tree times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from gguf import GGUFReader
from torch import nn

from ab_kernels import load_at
from carpool.model import cpu_kernels, gguf_codes, quant


def gguf_weight(reader: GGUFReader, name: str):
    """(label, input size, a factory for the tensor's kernel, built against the active library)."""
    t = next(t for t in reader.tensors if t.name == name)
    shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists the input dimension first
    codes = gguf_codes.decode(t.data, t.tensor_type, shape)
    return (f"{name} {t.tensor_type.name} {shape[0]}x{shape[1]}", shape[1],
            lambda: (lambda x, kernel=quant.packed_kernel(codes): kernel(x, 0)))


def int4_weight(n: int, k: int):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False).requires_grad_(False)
    linear.weight.normal_(0, 0.05)
    return f"int4 {n}x{k}", k, lambda: quant.QuantizedLinear(linear, "int4", torch.bfloat16).to(torch.bfloat16).kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernels are the baseline")
    ap.add_argument("--model", type=Path, help="a GGUF whose tensors --tensors names")
    ap.add_argument("--tensors", default="blk.0.ffn_up.weight,blk.0.ffn_down.weight")
    ap.add_argument("--int4", default="", help="shapes NxK of random int4 weights, comma-separated")
    ap.add_argument("--tokens", default="16,64,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    weights = []
    if args.model:
        reader = GGUFReader(args.model)
        weights += [gguf_weight(reader, name) for name in args.tensors.split(",") if name]
    weights += [int4_weight(*map(int, shape.split("x"))) for shape in args.int4.split(",") if shape]
    libs = {"base": load_at(args.base), "tree": cpu_kernels.load(cpu_kernels.build())}
    active = ["base"]
    cpu_kernels.library = lambda: libs[active[0]]
    rows = []
    for label, k, make in weights:
        kernels = {}
        for name in libs:  # a kernel binds its library when built
            active[0] = name
            kernels[name] = make()
        for tokens in map(int, args.tokens.split(",")):
            ms = {name: [] for name in libs}
            for r in range(args.rounds + 1):
                for name in ("base", "tree") if r % 2 == 0 else ("tree", "base"):
                    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).bfloat16()
                    start = time.perf_counter()
                    kernels[name](x)
                    elapsed = (time.perf_counter() - start) * 1e3
                    if r:  # the first round warms
                        ms[name].append(elapsed)
            ratio = statistics.median(b / t for b, t in zip(ms["base"], ms["tree"]))
            rows.append({"weight": label, "tokens": tokens, "ms": ms, "base_over_tree": ratio})
            print(f"{label}, {tokens} tokens: base {statistics.median(ms['base']):.2f} ms, "
                  f"tree {statistics.median(ms['tree']):.2f} ms, base/tree {ratio:.3f}", flush=True)
    if args.output:
        args.output.write_text(json.dumps({"base": args.base, "model": str(args.model), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

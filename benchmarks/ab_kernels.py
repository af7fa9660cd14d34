"""Two builds of the C kernels side by side in one process: the same generations alternated.

    .venv/bin/python benchmarks/ab_kernels.py --base REV [--model M] [--quantization Q] [--rounds 30] [--tokens 16]
        [--streams 1] [--prompt-tokens 12]

On a host whose memory speed moves 20-40% from minute to minute, two runs of `carpool bench ...`
minutes apart compare the minutes, not the kernels. Here the kernels of git revision REV and those
of the working tree are each compiled (the flags `carpool.model.cpu_kernels` uses), an engine is
loaded on each, and short greedy decodes run on one then the other, in turn, for many rounds
(`--streams` at once: steps of that many tokens). With a long `--prompt-tokens` and `--tokens 1`
each generation is a prefill, and the ratio compares the kernels' chunks. The decode steps alone
are timed too, from the last stream's first token to the end (every stream decoding), so that a
long prompt's prefill does not hide them.
Each engine runs with its own library (looked up per call, or bound at load as the fused layers
do). Prints each round and the median ratio, and writes them as JSON with --output.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from carpool import LLM, SamplingParams
from carpool.model import cpu_kernels

CSRC = "carpool/model/csrc"


def build_at(rev: str, into: Path) -> Path:
    """The kernel library of `rev`'s csrc, compiled into `into` (its kernels.h beside it)."""
    archive = subprocess.run(["git", "archive", rev, CSRC], capture_output=True, check=True).stdout
    tarfile.open(fileobj=BytesIO(archive)).extractall(into, filter="data")
    csrc = into / CSRC
    lib = into / "kernels.so"
    flags = [*cpu_kernels.COMPILE_FLAGS, *os.environ.get("CARPOOL_KERNEL_FLAGS", "").split()]  # as the tree's
    cmd = [*flags, f"-I{csrc}", *map(str, sorted(csrc.glob("*.c"))), *cpu_kernels.LINK_FLAGS]
    subprocess.run(["cc", *cmd, "-o", str(lib)], check=True)
    return lib


def load_at(rev: str) -> ctypes.PyDLL:
    """`rev`'s kernel library, loaded and typed by its own header: REV may lack an entry point the
    tree added (one the tree's C calls, not its Python), and the tree's table would refuse it."""
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_at(rev, Path(tmp))
        header = Path(tmp) / CSRC / "kernels.h"
        own = {name: (sig.returns, ", ".join(" ".join(arg) for arg in sig.args))
               for name, sig in cpu_kernels.header_prototypes(header.read_text()).items()}
        return cpu_kernels.load(lib, own, header)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernels are the baseline")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens a stream, after its prompt")
    ap.add_argument("--prompt-tokens", type=int, default=12, help="prompt tokens a stream")
    ap.add_argument("--streams", type=int, default=1, help="greedy streams decoding together")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    libs = {"base": load_at(args.base), "tree": cpu_kernels.load(cpu_kernels.build())}
    engines, active = {}, ["base"]
    cpu_kernels.library = lambda: libs[active[0]]
    for name in libs:
        active[0] = name
        # the fixed token budget: both engines cut a prompt into the same chunks; no prefix cache,
        # or each round after the first would skip the prompt
        engines[name] = LLM(model=args.model, quantization=args.quantization, kv_cache_memory="256MiB", target_tbt_ms=0,
                            enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + args.prompt_tokens))} for i in range(args.streams)]
    ms, decode_ms, ids = {name: [] for name in libs}, {name: [] for name in libs}, {}
    for name in libs:
        active[0] = name
        engines[name].generate(prompts, params, use_tqdm=False)  # warm
    for r in range(args.rounds):
        for name in ("base", "tree") if r % 2 == 0 else ("tree", "base"):
            active[0] = name
            start = time.perf_counter()
            out = engines[name].generate(prompts, params, use_tqdm=False)
            ms[name].append((time.perf_counter() - start) / args.tokens * 1e3)
            if args.tokens > 1:
                times = [o.metrics.token_times for o in out]
                decoding = max(t[-1] for t in times) - max(t[0] for t in times)
                decode_ms[name].append(decoding / (args.tokens - 1) * 1e3)
            ids[name] = [o.outputs[0].token_ids for o in out]
        print(f"round {r}: base {ms['base'][-1]:.2f} ms a token, tree {ms['tree'][-1]:.2f}"
              + (f"; decode steps alone: base {decode_ms['base'][-1]:.2f} ms, tree {decode_ms['tree'][-1]:.2f}"
                 if args.tokens > 1 else ""), flush=True)
    ratios = [b / t for b, t in zip(ms["base"], ms["tree"])]
    decode_ratios = [b / t for b, t in zip(decode_ms["base"], decode_ms["tree"])]
    result = {"base": args.base, "model": args.model, "quantization": args.quantization, "tokens": args.tokens,
              "streams": args.streams, "prompt_tokens": args.prompt_tokens,
              "ms_per_token": ms, "base_over_tree": ratios, "median": statistics.median(ratios),
              "decode_ms_per_step": decode_ms, "decode_base_over_tree": decode_ratios,
              "decode_median": statistics.median(decode_ratios) if decode_ratios else None,
              "same_tokens": ids["base"] == ids["tree"]}
    print(f"base/tree: median {result['median']:.3f} ({min(ratios):.3f}-{max(ratios):.3f}), "
          f"same tokens: {result['same_tokens']}")
    if decode_ratios:
        print(f"decode steps alone, base/tree: median {result['decode_median']:.3f} "
              f"({min(decode_ratios):.3f}-{max(decode_ratios):.3f})")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Which path runs a step's decoder layers, by its token count: the thresholds, in one place.

Three paths compute the same layers; the model runner picks one per step (`choose_path`):

- fused (model/fused_layers.py): every layer of the step in one C call;
- compiled (model/compiled.py): each layer's dense halves as Inductor graphs, attention eager;
- eager (model/llama.py): the model's own forward, one module call at a time.

The fused path runs steps of up to FUSED_MAX_TOKENS tokens, with the kernels the eager layers
pick (the integer kernels below quant.tile_from() tokens, the tile kernel from there): a whole fused
step beat the eager one at every batch size up to 31 (decode-only, context 512: 3.8 vs 8.3 ms at
1 decode, 15.6 vs 20.3 at 8, 28.8 vs 40.3 at 16, 53.6 vs 61.7 at 31, a sweep of decode-only
steps over both paths; Intel Xeon with AMX, 2 threads, 2026-12-01), and the compiled one from 32
to 124 tokens: 16 decodes with a draft each (32 tokens, one query run per decode) 68 vs 111 ms,
with 4 drafts each (80) 128 vs 177 ms; 4 decodes and a 64-token chunk 66 vs 111 ms, a 120-token
chunk over 300 cached tokens 158 vs 160 ms (context 400, medians of 7; the same Xeon, 2026-12-03,
scratch timings through `ModelRunner.execute`). Past that, SDPA over a long prefix wins. Where the
fused path cannot run (fp32, dense weights, tensor parallelism, Qwen3's q/k norms, Gemma's
layers), those steps run eager, or compiled from COMPILE_MIN_TOKENS.

Only steps of at least COMPILE_MIN_TOKENS tokens run compiled. A compiled call costs ~50 us of
Python (guard checks, wrappers) against ~5 us for an eager op, so at a few tokens per step the
fused loops win nothing back (a batch-1 decode: 31.7 ms compiled vs 30.5 eager); from a few dozen
tokens they do (a 256-token prefill: 101-103 ms vs 110-122 ms eager). BENCHMARKS.md "The
compiled forward" has the numbers and how they were measured.
"""

from __future__ import annotations

from enum import Enum

COMPILE_MIN_TOKENS = 32
FUSED_MAX_TOKENS = 95  # where it runs, the fused path takes steps the compiled one would from 32


class Path(Enum):
    FUSED = "fused"
    COMPILED = "compiled"
    EAGER = "eager"


def choose_path(num_tokens: int, fused_max_tokens: int, compiled: bool) -> Path:
    """The path of a step of `num_tokens` tokens. fused_max_tokens: up to how many tokens the
    fused layers run this step (0 where they cannot); compiled: whether compiled layers exist."""
    if num_tokens <= fused_max_tokens:
        return Path.FUSED
    if compiled and num_tokens >= COMPILE_MIN_TOKENS:
        return Path.COMPILED
    return Path.EAGER

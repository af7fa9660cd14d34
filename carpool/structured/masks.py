"""Token masks of constrained requests, computed while the model runs.

When a batch is scheduled, the rows it will sample are known, and each constrained one's matcher
has already consumed every token generated so far (a request is in at most one micro-batch at a
time, and tokens are consumed right after sampling). So its next mask can be computed at once, in
a background thread (llguidance releases the GIL), while the forward pass runs; the sampler then
only waits for it and applies it to those rows. Unconstrained requests cost nothing.

Preemption needs nothing here: recompute keeps a request's tokens and drops only its KV, so the
matcher, which has consumed exactly the tokens sampled so far, is still in the right state.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from carpool.core.scheduler import ScheduledBatch
from carpool.request import Request
from carpool.sampling_params import StructuredOutputsParams
from carpool.structured.grammar import GrammarCompiler


# How `accept`'s errors begin: the server answers them as the request's constraint failing (400),
# not as an engine fault. llguidance can allow a token it then refuses, on constraints it finds
# too complex (a fuzzed guided_choice of control characters and astral code points did).
GRAMMAR_REFUSED = "structured outputs: the grammar refused token"


@dataclass
class GrammarMasks:
    """Allowed tokens of some rows of a logits batch: `bitmask[j]` (int32 words, bit i of word w
    is token 32 w + i) belongs to row `rows[j]`."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words] int32

    def apply(self, logits: torch.Tensor) -> list[int]:
        """Set disallowed tokens of those rows to -inf; return the rows left with no token at all
        (other controls, e.g. min_tokens banning EOS, removed everything the grammar allows)."""
        vocab = logits.shape[1]
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.zeros(len(self.rows), vocab, dtype=torch.bool)
        width = min(vocab, bits.shape[1])
        allowed[:, :width] = torch.from_numpy(bits[:, :width]).bool()  # ids past the mask: never
        rows = logits[self.rows].masked_fill_(~allowed, float("-inf"))
        logits[self.rows] = rows
        dead = torch.isneginf(rows).all(dim=1).tolist()
        return [r for r, d in zip(self.rows, dead) if d]


@dataclass
class MaskStats:
    """Running totals, for `carpool bench structured`: how long masks took to compute (in the
    background thread) and how long the engine still waited for them after the forward pass."""

    num_jobs: int = 0  # steps with constrained rows
    num_masks: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0


class MaskJob:
    """The masks of one batch's sampled constrained rows, being computed in the background."""

    def __init__(self, requests: list[Request], future: Future, stats: MaskStats):
        self.requests = requests
        self.future = future
        self.stats = stats

    def masks_for(self, ready: list[Request]) -> GrammarMasks | None:
        """Wait for the masks; map them onto the rows of `ready` (the requests sampled, in order:
        requests aborted meanwhile are gone from it)."""
        start = time.perf_counter()
        bitmask = self.future.result()
        self.stats.wait_seconds += time.perf_counter() - start
        index = {id(r): j for j, r in enumerate(self.requests)}
        pairs = [(i, index[id(r)]) for i, r in enumerate(ready) if id(r) in index]
        if not pairs:
            return None
        return GrammarMasks([i for i, _ in pairs], bitmask[[j for _, j in pairs]])


class StructuredOutputs:
    """The engine's structured-output machinery: a matcher per constrained request (held on the
    request, so it goes when the request does), masks per step, and advancing after sampling."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._thread: ThreadPoolExecutor | None = None  # started with the first constrained row
        self._llg_executor = None
        self.stats = MaskStats()

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for a new request; ValueError if the constraint is invalid."""
        return self.compiler.matcher(params)

    def start_masks(self, batch: ScheduledBatch) -> MaskJob | None:
        """Begin computing the masks of the constrained rows this batch samples (None if none)."""
        sampled = [r for r, n in zip(batch.requests, batch.num_tokens)
                   if r.grammar is not None and r.num_computed_tokens + n == r.num_tokens]
        if not sampled:
            return None
        if self._thread is None:
            import llguidance

            self._thread = ThreadPoolExecutor(1, thread_name_prefix="carpool-grammar")
            # llguidance spreads a batch's rows over its own threads; leave the model most cores.
            self._llg_executor = llguidance.LLExecutor(max(1, (os.cpu_count() or 2) // 4))
        matchers = [r.grammar for r in sampled]  # the thread must not read requests that move on
        return MaskJob(sampled, self._thread.submit(self._compute, matchers), self.stats)

    def _compute(self, matchers: list) -> torch.Tensor:
        from llguidance.torch import fill_next_token_bitmask_par

        start = time.perf_counter()
        words = (self.compiler.tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        fill_next_token_bitmask_par(self._llg_executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        self.stats.num_jobs += 1
        self.stats.num_masks += len(matchers)
        self.stats.compute_seconds += time.perf_counter() - start
        return bitmask

    @staticmethod
    def accept(request: Request, token: int) -> str | None:
        """Advance the request's matcher by its sampled token; an error message if it refuses
        (the mask should prevent that; see GRAMMAR_REFUSED for when it does not)."""
        if request.grammar.consume_token(token):
            return None
        return f"{GRAMMAR_REFUSED} {token}: {request.grammar.get_error()}"

    @staticmethod
    def is_complete(request: Request) -> bool:
        """The grammar allows nothing more (a closed JSON value, a full choice): stop now."""
        return request.grammar.is_stopped()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)

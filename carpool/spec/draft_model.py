"""The draft_model proposer: a smaller model with the target's tokenizer guesses, greedily.

The draft runs on the engine's own machinery (loader, `ModelRunner`, `BlockManager`, `Request`,
`ScheduledBatch`) with its own weights and KV cache. Each target request has a shadow `Request`
holding the draft's block table and computed tokens; the proposer is the shadows' scheduler.

Drafting does not count against the target's token budget: the draft's forwards run between the
target's steps, and only the drafts the scheduler grants (verification tokens) take budget.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

from carpool.config import SpeculativeConfig, default_kv_cache_memory
from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import ScheduledBatch
from carpool.model import cpu_kernels
from carpool.model.loader import is_gguf, load_model, load_model_config, open_gguf, resolve_model_path
from carpool.model_runner import ModelRunner, kv_bytes_per_token
from carpool.request import Request
from carpool.sampling_params import SamplingParams
from carpool.tokenizer import load_tokenizer

log = logging.getLogger("carpool")

GREEDY = SamplingParams(temperature=0.0)


def check_same_vocabulary(target: tuple[str, int, object], draft: tuple[str, int, object]) -> None:
    """Raise a ValueError naming both models unless (name, model vocab size, tokenizer) agree:
    the draft's token ids are fed to the target as they are."""
    (t_name, t_size, t_tok), (d_name, d_size, d_tok) = target, draft
    if t_size != d_size:
        raise ValueError(f"speculative_config: the draft model {d_name} has a vocabulary of {d_size} tokens, "
                         f"the target {t_name} one of {t_size}; a draft must share the target's tokenizer")
    if len(t_tok) != len(d_tok) or t_tok.get_vocab() != d_tok.get_vocab():
        raise ValueError(f"speculative_config: the draft model {d_name} and the target {t_name} have different "
                         f"tokenizers ({len(d_tok)} and {len(t_tok)} tokens); a draft must share the target's "
                         f"tokenizer")


class DraftModelProposer:
    """Greedy drafts from a small model on its own KV cache, one shadow request per target request.

    KV cache: as many blocks as the target's (a shadow mirrors its target's tokens plus a few
    drafts, so the draft runs short about when the target does), at the draft's bytes per token,
    capped by `default_kv_cache_memory` measured after the draft's weights are loaded (on a GPU
    the target's cache has already taken most of the memory). No prefix caching: a shadow rolls
    back inside a block after a rejection and rewrites it, which a shared cached block must never
    see. Where blocks run short, a request gets no drafts that step; the target's step never fails
    for the draft's sake."""

    # Tokens per draft forward. Between two target steps the draft runs one catch-up forward and
    # then its decodes, so a long prompt catches up over several steps instead of stalling one.
    MAX_STEP_TOKENS = 512

    def __init__(self, config: SpeculativeConfig, engine):
        path = resolve_model_path(config.model)
        reader = open_gguf(path) if is_gguf(path) else None
        draft_config = load_model_config(path, reader)
        tokenizer = load_tokenizer(path, gguf_reader=reader)
        check_same_vocabulary((engine.config.model, engine.model_config.vocab_size, engine.tokenizer),
                              (config.model, draft_config.vocab_size, tokenizer))
        device, dtype, bs = engine.device, engine.dtype, engine.config.block_size
        self.model = load_model(path, dtype, device, gguf_reader=reader, quantization=config.quantization)
        per_token = kv_bytes_per_token(self.model.config, dtype)
        budget = min(engine.block_manager.num_blocks * bs * per_token, default_kv_cache_memory(device))
        num_blocks = budget // (per_token * bs)
        if num_blocks < 1:
            raise ValueError(f"speculative_config: no KV block of the draft model {config.model} fits in "
                             f"{budget} bytes")
        self.block_manager = BlockManager(num_blocks, bs)
        self.runner = ModelRunner(self.model, num_blocks, bs, device, dtype,
                                  enforce_eager=engine.config.enforce_eager)
        self.max_model_len = min(self.model.config.max_position_embeddings, self.block_manager.capacity_tokens)
        self.max_step_tokens = self.MAX_STEP_TOKENS
        self.shadows: dict[Request, Request] = {}  # target request -> its shadow (identity keys)
        self._ids = itertools.count()
        log.info("draft model %s: KV cache %d blocks x %d tokens (%.0f MiB)", Path(path).name, num_blocks, bs,
                 num_blocks * bs * per_token / 2**20)

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """For each request, up to `limits[i]` greedy draft tokens (fewer or none where the draft's
        context or blocks run short, or its forward fails)."""
        self._reap()
        drafts: dict[Request, list[int]] = {}
        wanted: dict[Request, int] = {}
        for request, limit in zip(requests, limits):
            shadow = self._sync(request)
            # The last draft is sampled, not computed: slots for num_tokens + limit - 1 tokens.
            need = shadow.num_tokens + limit - 1
            if limit > 0 and need <= self.max_model_len and self.block_manager.allocate(shadow, need):
                drafts[shadow], wanted[shadow] = [], limit
        try:
            # Catch-up: one forward over every shadow's new tokens, at most max_step_tokens. A
            # shadow left behind (a long prompt) drafts nothing this time and goes on next time.
            active = list(drafts)
            while active:
                for shadow, token in self._step(active):
                    shadow.token_ids.append(token)
                    drafts[shadow].append(token)
                active = [s for s in active if 0 < len(drafts[s]) < wanted[s]]
        except Exception:  # noqa: BLE001 -- a failed draft costs its drafts, never the target's step
            log.exception("draft model step failed; dropping its drafts")
            self.close()
            return [[] for _ in requests]
        for shadow, tokens in drafts.items():
            shadow.spec_token_ids = tokens
        return [list(drafts.get(self.shadows[r], ())) for r in requests]

    def close(self) -> None:
        """Free every shadow's blocks (the model and its cache stay until the proposer is dropped)."""
        for shadow in self.shadows.values():
            self.block_manager.free(shadow)
        self.shadows.clear()

    def _reap(self) -> None:
        """Free the shadows of finished requests (done lazily: the engine does not tell us)."""
        for request in [r for r in self.shadows if r.is_finished]:
            self.block_manager.free(self.shadows.pop(request))

    def _sync(self, request: Request) -> Request:
        """The request's shadow with its target's tokens. Its KV stays valid over the prefix the
        two share; past it the computed count rolls back and the blocks past it are given back.
        A shadow's `spec_token_ids` are the drafts at the end of its tokens, which the target had
        not confirmed when they were proposed: the tokens before them are the target's."""
        shadow = self.shadows.get(request)
        if shadow is None:
            shadow = Request(f"draft-{next(self._ids)}", list(request.prompt_token_ids), GREEDY)
            self.shadows[request] = shadow
        mine, theirs = shadow.token_ids, request.token_ids
        same = len(mine) - len(shadow.spec_token_ids)
        while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
            same += 1
        del mine[same:]
        mine.extend(theirs[same:])
        shadow.spec_token_ids = []
        # At least the last token is computed (again): its logits give the first draft.
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, len(theirs) - 1)
        self.block_manager.trim(shadow, shadow.num_computed_tokens)
        return shadow

    def _step(self, shadows: list[Request]) -> list[tuple[Request, int]]:
        """One draft forward: each shadow's uncomputed tokens under the step's token cap, decodes
        first; returns the shadows now level with their tokens and the greedy token after them.
        Computed tokens advance as `Scheduler.commit` advances them."""
        batch, budget = ScheduledBatch(), self.max_step_tokens
        for shadow in sorted(shadows, key=lambda s: s.num_uncomputed_tokens):
            if budget == 0:
                break
            n = min(shadow.num_uncomputed_tokens, budget)
            batch.add(shadow, n)
            budget -= n
        batch = batch.ordered()  # the rows of the logits follow the batch's order
        logits = self.runner.execute(batch)
        ready = []
        for shadow, n in zip(batch.requests, batch.num_tokens):
            shadow.num_computed_tokens += n
            if shadow.num_computed_tokens == shadow.num_tokens:
                ready.append(shadow)
        return list(zip(ready, cpu_kernels.row_max(logits)[1].tolist()))

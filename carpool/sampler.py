"""Turn the last-position logits of each ready request into its next token (and logprobs).

A row whose numbers go bad (NaN or infinite logits after penalties and temperature, a
distribution `multinomial` refuses) fails alone: its token is None and its error says why,
while every other row of the batch is sampled as usual. One request's extreme parameters
must never fail other clients' requests."""

from __future__ import annotations

import torch

from carpool.model.cpu_kernels import row_max
from carpool.outputs import Logprob
from carpool.request import Request
from carpool.structured.masks import GrammarMasks


# A request whose own constraint and token controls leave no token to sample: its error, not the engine's.
NO_ALLOWED_TOKEN = "sampling failed: no token the structured output allows is left"
BAD_LOGITS = "sampling failed: the logits became NaN or infinite (check the penalties)"


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition penalty over prompt and output (as in HF); presence/frequency over output."""
    for row, req in enumerate(requests):
        sp = req.sampling_params
        if not sp.has_penalties:
            continue
        x = logits[row]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long)
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        out = req.output_token_ids
        if out and (sp.presence_penalty or sp.frequency_penalty):
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).to(x.dtype)
            x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(x.dtype)


def apply_token_controls(logits: torch.Tensor, requests: list[Request]) -> None:
    """logit_bias, allowed_token_ids and bad_words (a bad word's last token is banned once the
    output ends with the rest of it)."""
    for row, req in enumerate(requests):
        sp = req.sampling_params
        if sp.logit_bias:
            ids = torch.tensor(list(sp.logit_bias), dtype=torch.long)
            logits[row, ids] += torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype)
        if sp.allowed_token_ids is not None:
            keep = logits[row, sp.allowed_token_ids].clone()
            logits[row] = float("-inf")
            logits[row, sp.allowed_token_ids] = keep
        if req.bad_words_token_ids:
            out = req.output_token_ids
            for seq in req.bad_words_token_ids:
                head = seq[:-1]
                if not head or (len(out) >= len(head) and out[len(out) - len(head):] == head):
                    logits[row, seq[-1]] = float("-inf")


def mask_stops_before_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    for row, req in enumerate(requests):
        sp = req.sampling_params
        if req.num_output_tokens < sp.min_tokens:
            banned = set(sp.stop_token_ids)
            if not sp.ignore_eos:
                banned |= req.eos_token_ids
            if banned:
                logits[row, sorted(banned)] = float("-inf")


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> torch.Tensor:
    """Rows of temperature-scaled logits; returns them with excluded tokens at -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays). Rows
    # with top_p == 1 skip it: float32 cumsum can reach 1.0 before the tail of a large vocab.
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, requests: list[Request], grammar: GrammarMasks | None = None,
                 rows: list[int] | None = None
                 ) -> tuple[list[int | None], list[dict[int, Logprob] | None], list[str | None]]:
        """Returns per request: the token (None if its row failed), its logprobs entry, and the
        error of a failed row. `rows`: each request's row of `logits` (None: row i for request i);
        greedy rows are read in place, the others gathered. `grammar` holds the allowed tokens of
        constrained rows (applied last, so that nothing re-allows a token the grammar forbids).
        The caller's logits stay as they came."""
        logits = logits.float()
        want_logprobs = [r.sampling_params.logprobs is not None for r in requests]
        edits = grammar is not None or any(r.sampling_params.edits_logits for r in requests)
        gathered = rows is not None and (edits or any(want_logprobs))
        if gathered:
            logits, rows = logits[rows], None  # a copy, which the edits below may change
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
        if edits:
            logits = logits if gathered else logits.clone()
            apply_penalties(logits, requests)
            apply_token_controls(logits, requests)
            mask_stops_before_min_tokens(logits, requests)

        errors: list[str | None] = [None] * len(requests)
        for i in grammar.apply(logits) if grammar is not None else ():
            errors[i] = f"{NO_ALLOWED_TOKEN} (min_tokens, logit_bias, allowed_token_ids or bad_words exclude them all)"
        # +inf or NaN anywhere poisons argmax and softmax alike (-inf is a banned token: fine).
        # max propagates NaN, so one reduction finds both, and the greedy tokens with them.
        best, tokens = row_max(logits, rows)
        for i in torch.nonzero(~(best < float("inf"))).flatten().tolist():
            errors[i] = BAD_LOGITS
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy and errors[i] is None]
        if random_rows:
            params = [requests[i].sampling_params for i in random_rows]
            picked = logits[random_rows if rows is None else [rows[i] for i in random_rows]]
            scaled = filter_top_k_top_p_min_p(
                picked / torch.tensor([p.temperature for p in params])[:, None],
                torch.tensor([min(p.top_k, logits.shape[-1]) for p in params]),  # any k past the vocabulary keeps it all
                torch.tensor([p.top_p for p in params]),
                torch.tensor([p.min_p for p in params]),
            )
            probs = scaled.softmax(dim=-1)
            bad_probs = (~torch.isfinite(probs).all(-1)).tolist()
            for j, i in enumerate(random_rows):
                if bad_probs[j]:
                    errors[i] = "sampling failed: the probabilities became NaN (check temperature and penalties)"
                    continue
                gen = requests[i].generator or self.generator
                try:
                    tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
                except RuntimeError as exc:  # e.g. a distribution of NaNs or all zeros
                    errors[i] = f"sampling failed: {exc}"

        token_list: list[int | None] = tokens.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(requests)
        for i, req in enumerate(requests):
            if errors[i] is not None:
                token_list[i] = None
            elif want_logprobs[i]:
                logprobs[i] = logprob_entries(raw_logprobs[i:i + 1], [token_list[i]],
                                              req.sampling_params.logprobs)[0]
        return token_list, logprobs, errors


def logprob_entries(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[dict[int, Logprob]]:
    """Per row of log-probabilities: {token: its Logprob and rank} plus the row's `num_top`
    most likely tokens (vLLM's layout; the chosen token comes first); -1: every token."""
    num_top = logprobs.shape[-1] if num_top < 0 else num_top
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    entries = [{t: Logprob(v, r)} for t, v, r in zip(tokens, chosen[:, 0].tolist(), ranks)]
    if num_top:
        top = logprobs.topk(num_top, dim=-1)
        for entry, values, ids in zip(entries, top.values.tolist(), top.indices.tolist()):
            for rank, (v, t) in enumerate(zip(values, ids), 1):
                entry.setdefault(t, Logprob(v, rank))
    return entries


def score_prompt(logits: torch.Tensor, request: Request, positions: range) -> list[dict[int, Logprob]]:
    """Logprob entries of the prompt tokens that follow `positions`, from those positions' logits."""
    targets = request.prompt_token_ids[positions.start + 1:positions.stop + 1]
    return logprob_entries(logits.float().log_softmax(dim=-1), targets, request.sampling_params.prompt_logprobs)

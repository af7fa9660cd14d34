"""Chunked prefill gives the same logits as one-shot prefill (fp32)."""

from __future__ import annotations

import pytest
import torch

from carpool.harness.synthetic import SyntheticBatches

PROMPT = ("In the middle of the night, the old lighthouse keeper climbed the stairs once more, "
          "counting every step as he had done for forty years, and wondering whether the ships "
          "still needed his light now that every captain carried a satellite receiver. ") * 2


def last_logits(engine, ids, chunk):
    manual = SyntheticBatches(engine)
    try:
        r = manual.new(ids)
        while r.num_computed_tokens < len(ids):
            logits = manual.run([(r, min(chunk, len(ids) - r.num_computed_tokens))])
        return logits[0]
    finally:
        manual.close()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_equals_one_shot(engine_fp32, chunk):
    ids = engine_fp32.tokenizer.encode(PROMPT)
    assert len(ids) > 64
    full = last_logits(engine_fp32, ids, len(ids))
    torch.testing.assert_close(last_logits(engine_fp32, ids, chunk), full, rtol=1e-4, atol=1e-3)


def test_chunks_sharing_a_budget_with_decodes(engine_fp32):
    """Prefill chunks batched with running decodes, as the Sarathi scheduler builds them: the
    chunked prompt's logits and the decodes' tokens both match their solo runs."""
    tok = engine_fp32.tokenizer
    ids = tok.encode(PROMPT)
    others = [tok.encode("The weather today is"), tok.encode("My favourite food is")]
    full = last_logits(engine_fp32, ids, len(ids))

    def solo_decode(prompt, steps):
        manual = SyntheticBatches(engine_fp32)
        try:
            r = manual.new(prompt)
            out = []
            logits = manual.run([(r, len(prompt))])
            for _ in range(steps):
                t = int(logits[0].argmax())
                out.append(t)
                r.token_ids.append(t)
                logits = manual.run([(r, 1)])
            return out
        finally:
            manual.close()

    budget = 24
    steps = -(-len(ids) // (budget - len(others)))
    expected = [solo_decode(p, steps) for p in others]

    manual = SyntheticBatches(engine_fp32)
    try:
        decs = [manual.new(p) for p in others]
        first = manual.run([(d, len(d.token_ids)) for d in decs])
        for d, row in zip(decs, first):
            d.token_ids.append(int(row.argmax()))
        r = manual.new(ids)
        while r.num_computed_tokens < len(ids):
            n = min(budget - len(decs), len(ids) - r.num_computed_tokens)
            logits = manual.run([(d, 1) for d in decs] + [(r, n)])
            for d, row in zip(decs, logits[:len(decs)]):
                d.token_ids.append(int(row.argmax()))
        torch.testing.assert_close(logits[-1], full, rtol=1e-4, atol=1e-3)
        for d, exp, p in zip(decs, expected, others):
            assert d.token_ids[len(p):len(p) + steps] == exp
    finally:
        manual.close()

"""Applying grammar bitmasks to logits rows (carpool/structured/masks.py)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.structured.masks import GrammarMasks
from tests.helpers import examples


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_apply_keeps_exactly_the_allowed_tokens(data):
    batch = data.draw(st.integers(1, 5))
    vocab = data.draw(st.integers(1, 130))
    words = data.draw(st.integers(max(1, (vocab - 40) // 32), (vocab + 70) // 32 + 1))  # shorter or longer
    rows = sorted(data.draw(st.sets(st.integers(0, batch - 1), min_size=1)))
    seed = data.draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32))
    logits = torch.from_numpy(rng.standard_normal((batch, vocab)).astype(np.float32))
    before = logits.clone()
    dead = GrammarMasks(rows, bitmask).apply(logits)
    for j, r in enumerate(rows):
        for t in range(vocab):
            word, bit = divmod(t, 32)
            ok = word < words and (int(bitmask[j, word]) >> bit) & 1
            assert logits[r, t] == (before[r, t] if ok else float("-inf"))
    for r in set(range(batch)) - set(rows):
        assert torch.equal(logits[r], before[r])
    assert dead == [r for r in rows if torch.isneginf(logits[r]).all()]

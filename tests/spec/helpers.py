"""Turn speculation on for a shared test engine without building another one."""

from __future__ import annotations

import contextlib

from carpool.config import SpeculativeConfig
from carpool.spec.acceptance import SpecDecodeStats
from carpool.spec.proposers import make_proposer


@contextlib.contextmanager
def speculating(engine, num_speculative_tokens: int = 4, **kwargs):
    """The engine speculates inside the block (n-gram unless kwargs say otherwise), with fresh
    counters; as before afterwards."""
    saved = engine.spec_config, engine.proposer, engine.spec_stats
    engine.spec_config = SpeculativeConfig(num_speculative_tokens=num_speculative_tokens, **kwargs)
    engine.proposer = make_proposer(engine.spec_config, engine)
    engine.spec_stats = SpecDecodeStats()
    try:
        yield engine
    finally:
        engine.spec_config, engine.proposer, engine.spec_stats = saved

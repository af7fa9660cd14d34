"""carpool: an LLM serving engine with Sarathi-Serve chunked prefill and stall-free batching.

The public names load on first use (PEP 562): `carpool serve` starts its engine process before
the frontend imports torch, and importing any carpool module would otherwise import them all."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"EngineConfig": "carpool.config", "LLM": "carpool.llm", "LLMEngine": "carpool.engine",
            "RequestOutput": "carpool.outputs", "RequestOutputKind": "carpool.sampling_params",
            "SamplingParams": "carpool.sampling_params", "StructuredOutputsParams": "carpool.sampling_params",
            "TextPrompt": "carpool.inputs", "TokensPrompt": "carpool.inputs"}

__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams", "TextPrompt", "TokensPrompt"]

if TYPE_CHECKING:
    from carpool.config import EngineConfig
    from carpool.engine import LLMEngine
    from carpool.inputs import TextPrompt, TokensPrompt
    from carpool.llm import LLM
    from carpool.outputs import RequestOutput
    from carpool.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'carpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

"""carpool: an LLM serving engine with Sarathi-Serve chunked prefill and stall-free batching."""

from carpool.config import EngineConfig
from carpool.engine import LLMEngine
from carpool.inputs import TextPrompt, TokensPrompt
from carpool.llm import LLM
from carpool.outputs import RequestOutput
from carpool.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams", "TextPrompt", "TokensPrompt"]

"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar."""

from carpool.structured.grammar import GrammarCompiler
from carpool.structured.masks import GrammarMasks, StructuredOutputs

__all__ = ["GrammarCompiler", "GrammarMasks", "StructuredOutputs"]

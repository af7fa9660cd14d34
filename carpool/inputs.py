"""The prompt forms a request may take (vLLM's): a string, a list of token ids, or a dict.

`TextPrompt` holds text to tokenize; `TokensPrompt` holds token ids, with the text they came from
if the caller has it (so outputs can show it). carpool has no multi-modal inputs, so any other
key is refused rather than silently dropped."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):  # `total=False` marks `prompt` optional on Python 3.10
    prompt: str  # the text the ids came from, shown as RequestOutput.prompt


PromptType = str | list[int] | TextPrompt | TokensPrompt

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


def parse_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt: the ids, when given, are what runs; the text is then only
    shown. Raises ValueError for a dict with a key carpool does not know or with neither key."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - PROMPT_KEYS, key=str)
        if unknown:
            raise ValueError(f"prompt dict has unknown keys {unknown}; carpool takes "
                             "{'prompt': text} (TextPrompt) or {'prompt_token_ids': ids} (TokensPrompt)")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt dict: 'prompt' must be a string, got {type(text).__name__}")
        if ids is None and text is None:
            raise ValueError("prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if ids is not None and (isinstance(ids, str) or not isinstance(ids, (list, tuple))):
            raise ValueError(f"prompt dict: 'prompt_token_ids' must be a list of ints, got {type(ids).__name__}")
        return text, None if ids is None else list(ids)
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids, or a TextPrompt/TokensPrompt dict; "
                     f"got {type(prompt).__name__}")


def is_single_prompt(prompts) -> bool:
    """Whether `prompts` is one prompt rather than a sequence of them."""
    return (isinstance(prompts, (str, dict))
            or (isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int)))

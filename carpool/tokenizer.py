"""The model's own tokenizer and chat template, from tokenizer files or GGUF metadata."""

from __future__ import annotations

import os
from pathlib import Path

from carpool.model.loader import is_gguf, open_gguf, resolve_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: everything is local
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _NotOurs(ValueError):
    """A GGUF tokenizer carpool's own reader does not cover; transformers' GGUF support reads it."""


def _gguf_tokenizer(reader):
    """Rebuild a byte-level BPE tokenizer from the vocab, merges and special tokens in GGUF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise _NotOurs(f"GGUF tokenizer model {kind!r}")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                     byte_fallback=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = field("tokenizer.ggml.pre", "default")
    if pre in ("smollm", "starcoder", "refact", "default", "gpt2"):
        # These split every digit on its own before the GPT-2 byte-level regex.
        digits = pre != "gpt2"
        tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if digits else byte_level)
    else:
        raise _NotOurs(f"GGUF pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    # Types 3 (control) and 4 (user-defined) are special tokens that must never be split.
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens(special)

    def token(key):
        i = field(key)
        return None if i is None else tokens[i]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=field("tokenizer.chat_template"),
        add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
        clean_up_tokenization_spaces=False,
    )


def _transformers_gguf_tokenizer(path: str):
    """Other families' GGUF tokenizers (SentencePiece 'llama', Llama-3 'llama-bpe', 'qwen2', ...),
    converted by transformers' GGUF support."""
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def load_tokenizer(model_path: str, gguf_reader=None):
    if is_gguf(model_path):
        try:
            return _gguf_tokenizer(gguf_reader or open_gguf(model_path))
        except _NotOurs:
            return _transformers_gguf_tokenizer(model_path)
    from transformers import AutoTokenizer

    model_path = resolve_model_path(model_path)  # org/name: its snapshot in the local HF cache
    if not (Path(model_path) / "tokenizer_config.json").exists() and not (Path(model_path) / "tokenizer.json").exists():
        raise FileNotFoundError(f"{model_path} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(model_path)


PROMPT_CONTEXT = 6  # prompt tokens decoded ahead of the output, so its first token decodes as in-stream


def rust_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` that a transformers fast tokenizer wraps (or the tokenizer itself);
    None for a tokenizer without one (a slow, pure-Python transformers tokenizer)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back bytes of a UTF-8 character not yet complete
    (`add` returns "" until the character is whole).

    With a Rust tokenizer, `tokenizers.decoders.DecodeStream` does the work: it decodes a window
    of recent tokens and emits what extends past the text the window had already produced, so
    merges across token boundaries (spaces, multi-byte characters) come out right without
    re-decoding the whole output. Special tokens are dropped with `skip_special_tokens`, else
    written as their text with nothing between them (as `tokenizer.decode` of a fast tokenizer
    writes them); transformers' `clean_up_tokenization_spaces` is not applied (as in vLLM).
    Tokenizers without a Rust backend, and a stream whose decoder rewrites text it already
    emitted (the library's "invalid prefix" error), fall back to the same window in Python."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.backend = rust_tokenizer(tokenizer)
        # The prompt's last tokens, less any that end inside a character: the stream would take
        # an unfinished prompt for output not yet emitted, and emit the prompt's text with it.
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        while self.ids and self._decode(self.ids).endswith("\ufffd"):
            self.ids.pop()
        self.prefix_offset = 0  # the window: ids[prefix_offset:read_offset] decoded already
        self.read_offset = len(self.ids)
        self.stream = None if self.backend is None else DecodeStream(self.ids, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return (self.backend or self.tokenizer).decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        new = None
        if self.stream is not None:
            try:
                new = self.stream.step(self.backend, token_id)
            except Exception:  # the window's text changed before its end: decode it here from now on
                self.stream = None
        if self.stream is None:
            new = self._step_in_python()
        if not new:
            return ""  # an incomplete character (or nothing visible) so far
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new

    def _step_in_python(self) -> str | None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return full[len(prefix):]

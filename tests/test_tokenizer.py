"""The GGUF-built tokenizer against transformers' own GGUF tokenizer conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from carpool.tokenizer import IncrementalDetokenizer, load_tokenizer

TEXTS = [
    "Hello, world!", "  leading spaces and trailing  ", "Numbers 1234567 and 3.14159",
    "def f(x):\n    return x ** 2\n", "Ünïcödé façade — naïve café", "汽车共享很好", "emoji 🚗🚕 ok",
    "<|im_start|>user\nhi<|im_end|>\n", "tabs\tand\nnewlines\r\n", "MiXeD CaSe WoRdS's don't",
]


@pytest.fixture(scope="module")
def reference(model_path):
    p = Path(model_path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@pytest.fixture(scope="module")
def ours(model_path):
    return load_tokenizer(model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, reference, text):
    assert ours.encode(text) == reference.encode(text)
    assert ours.decode(ours.encode(text)) == text


def test_chat_template_from_gguf(ours, reference):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    mine = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert mine == reference.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert mine.endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant" in mine


def test_incremental_detokenizer_reassembles_text(ours):
    text = "Carpool 🚗 lanes: 汽车共享, naïve café! 1234"
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours, ours.encode("Prompt:"))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # multi-token characters were held back, not split

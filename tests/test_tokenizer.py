"""The GGUF-built tokenizer against transformers' own GGUF tokenizer conversion, and the
incremental detokenizer against whole-sequence decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer

from carpool.tokenizer import IncrementalDetokenizer, load_tokenizer
from tests.helpers import examples

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
    assert detok.stream is not None  # the Rust DecodeStream, not the Python window
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # multi-token characters were held back, not split


class PythonOnly:
    """A tokenizer without a Rust backend: the detokenizer's Python path."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


MULTIBYTE = "汽车共享很好 🚗🚕 Ünïcödé façade — naïve café ∑∫≈ 😀🎉"


@settings(max_examples=examples(400), deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans(), rust=st.booleans(),
       prompt=st.sampled_from(["Prompt:", "<|im_start|>assistant\n", "", "汽车"]))
def test_streamed_pieces_add_up_to_decode(ours, data, skip_special_tokens, rust, prompt):
    """For any token ids (the whole vocabulary, special tokens included, mixed with pieces of
    multi-byte characters), the streamed pieces concatenate to `decode(ids)` exactly when that
    text does not end inside a character; when it does, they are a prefix of it, short by that
    unfinished character (held back, never emitted as U+FFFD). U+FFFD inside the text (bytes that
    never form a character) is emitted as decode writes it."""
    pieces_of_characters = sorted(set(ours.encode(MULTIBYTE)))
    ids = data.draw(st.lists(st.one_of(st.integers(0, len(ours) - 1), st.sampled_from(pieces_of_characters)),
                             max_size=30))
    detok = IncrementalDetokenizer(ours if rust else PythonOnly(ours), ours.encode(prompt), skip_special_tokens)
    assert (detok.stream is not None) == rust
    pieces = [detok.add(t) for t in ids]
    streamed = "".join(pieces)
    whole = ours.decode(ids, skip_special_tokens=skip_special_tokens)
    if whole.endswith("\ufffd"):
        assert whole.startswith(streamed) and len(streamed) < len(whole)
    else:
        assert streamed == whole
    assert not any(p.endswith("\ufffd") for p in pieces)


def test_special_tokens_skipped_or_written_without_spaces(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|><|im_end|>\n")
    for skip, expected in ((True, "user\nhi\n"), (False, "<|im_start|>user\nhi<|im_end|><|im_end|>\n")):
        detok = IncrementalDetokenizer(ours, [], skip_special_tokens=skip)
        assert "".join(detok.add(t) for t in ids) == expected == ours.decode(ids, skip_special_tokens=skip)


def test_a_prompt_ending_inside_a_character_is_not_emitted(ours):
    """The prompt's unfinished character stays out of the stream's context: the output is what
    its own tokens decode to (here the rest of that character's bytes, as U+FFFD)."""
    ids = ours.encode("汽车")
    assert ours.decode(ids[:1]) == "\ufffd"  # the first token ends inside 汽
    prompt = ours.encode("Hello ") + ids[:1]
    output = ids[1:] + ours.encode(" ok")
    detok = IncrementalDetokenizer(ours, prompt)
    streamed = "".join(detok.add(t) for t in output)
    assert streamed == ours.decode(output) and streamed.endswith("车 ok") and "Hello" not in streamed


def test_a_decoder_that_rewrites_emitted_text_falls_back_to_python():
    """A decoder whose text for a window is not a prefix of its text for a longer window makes
    DecodeStream raise ("invalid prefix"); the detokenizer carries on in Python instead and never
    takes back text it emitted."""
    tok = Tokenizer(models.WordLevel({"a": 0, "bc": 1, "d": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    assert tok.decode([0, 1]) == "Xc"
    detok = IncrementalDetokenizer(tok, [])
    assert detok.stream is not None
    assert [detok.add(t) for t in (0, 1, 2, 0)] == ["a", "c", "d", "a"]
    assert detok.stream is None

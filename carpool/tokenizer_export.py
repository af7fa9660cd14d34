"""The model's tokenizer as a Hugging Face folder (`carpool export-tokenizer`), and the
tokenizer_config.json it would hold (GET /tokenizer_info). A GGUF's tokenizer is rebuilt from its
metadata (carpool/tokenizer.py); written out, any transformers-based tool (lm-evaluation-harness,
benchmark clients that count tokens) loads it with AutoTokenizer and encodes as carpool does."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any


def save_tokenizer(tokenizer, folder: str | Path, model_max_length: int | None = None,
                   chat_template: str | None = None) -> Path:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and the special
    tokens map to `folder`; `model_max_length`: the context the model serves."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    saved = {"model_max_length": tokenizer.model_max_length, "chat_template": tokenizer.chat_template}
    try:
        if model_max_length is not None:
            tokenizer.model_max_length = model_max_length
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(str(folder))
    finally:  # the caller's tokenizer as it was
        tokenizer.model_max_length, tokenizer.chat_template = saved["model_max_length"], saved["chat_template"]
    return folder


def tokenizer_config(tokenizer, model_max_length: int | None = None, chat_template: str | None = None
                     ) -> dict[str, Any]:
    """What the saved folder's tokenizer_config.json says, with `tokenizer_class` and the chat
    template in it (transformers may write the template to a file of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tokenizer(tokenizer, tmp, model_max_length, chat_template)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        template_file = folder / "chat_template.jinja"
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
    config.setdefault("tokenizer_class", type(tokenizer).__name__)
    return config

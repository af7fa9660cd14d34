"""Every tensor-parallel size the docs show runs on the embedded model as written: the model's
heads, KV heads and intermediate size must divide by it (the loader shards them; KV heads are
not replicated when T exceeds them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from carpool.config import default_model_path
from carpool.model.loader import load_model_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "BENCHMARKS.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
TP_FLAG = re.compile(r"(?<![\w-])(?:--tensor-parallel-size|-tp)[ =](\d+)")  # not the simulator's --tp


def documented_tp_sizes(text: str) -> list[int]:
    """The TP sizes in the bash blocks of a markdown file (`carpool` and torchrun lines alike)."""
    return [int(n) for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for n in TP_FLAG.findall(block)]


def test_the_pattern_finds_sizes():
    assert documented_tp_sizes("```bash\ncarpool serve -tp 3\nx --tensor-parallel-size=9 --tp 4\n```") == [3, 9]


@pytest.fixture(scope="module")
def cfg():
    return load_model_config(default_model_path())


@pytest.mark.parametrize("doc", DOCS)
def test_documented_tp_sizes_divide_the_embedded_model(doc, cfg):
    for t in documented_tp_sizes((ROOT / doc).read_text()):
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            assert getattr(cfg, name) % t == 0, (
                f"{doc}: --tensor-parallel-size {t} does not divide the embedded model's {name} "
                f"({getattr(cfg, name)})")

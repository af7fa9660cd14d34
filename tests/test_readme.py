"""The README's Python example runs as written, the README stays short, and every documented
`carpool` command (README, BENCHMARKS, docs/) parses."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ["README.md", "BENCHMARKS.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.slow
def test_python_api_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "from carpool import" in b)
    r = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "IterationStats(" in r.stdout


def documented_commands(text: str) -> list[list[str]]:
    """Every `carpool ...` line of the bash blocks of a markdown file, continuation lines joined and
    shell variables ($W) expanded from assignments in the same block."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        variables = dict(re.findall(r'^(\w+)="([^"]*)"', joined, flags=re.M))
        for line in joined.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("carpool "):
                line = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), line)
                commands.append(shlex.split(line)[1:])
    return commands


def test_readme_is_short():
    """A newcomer's page: what carpool is, two commands, two examples, links to the rest."""
    assert len(README.read_text().splitlines()) <= 200


PAGES = ["serving", "models", "scheduling", "parallelism", "simulator", "kernels", "architecture"]


def test_readme_links_every_docs_page():
    text = README.read_text()
    for page in PAGES:
        assert (ROOT / "docs" / f"{page}.md").is_file(), page
        assert f"docs/{page}.md" in text, f"README.md does not link docs/{page}.md"
    assert "BENCHMARKS.md" in text


@pytest.mark.parametrize("doc", DOCS)
def test_documented_commands_parse(doc):
    from carpool.cli import build_parser

    commands = documented_commands((ROOT / doc).read_text())
    assert commands, f"{doc} documents no `carpool` command"
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{doc}: `carpool {' '.join(argv)}` does not parse")

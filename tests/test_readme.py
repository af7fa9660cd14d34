"""The README's Python example runs as written; every documented `carpool` command parses."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


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


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md"])
def test_documented_commands_parse(doc):
    from carpool.cli import build_parser

    commands = documented_commands((README.parent / doc).read_text())
    assert len(commands) >= 5
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{doc}: `carpool {' '.join(argv)}` does not parse")

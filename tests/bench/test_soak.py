"""`carpool bench soak`, briefly: a real server process under mixed hostile traffic passes."""

from __future__ import annotations

import json

import pytest

from carpool.cli import main


@pytest.mark.slow  # ~40 s: the CLI end to end (make test-slow)
def test_short_soak_passes(tmp_path):
    out = tmp_path / "soak"
    rc = main(["bench", "soak", "--duration", "8", "--clients", "3", "--max-waiting-requests", "4",
               "--kv-cache-memory", "64MiB", "--output", str(out)])
    summary = json.loads((out / "soak.json").read_text())
    assert rc == 0 and summary["passed"], summary
    assert summary["requests"] > 5 and summary["valid_5xx"] == 0 and summary["leaked_blocks"] == 0
    assert summary["running_at_end"] == 0 and summary["server_exit_code"] == 0
    kinds = {key.split()[0] for key in summary["by_outcome"]}
    assert any(k.startswith("malformed-") for k in kinds) and any(k.startswith("valid-") for k in kinds)
    assert (out / "soak.png").exists()

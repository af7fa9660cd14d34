"""A clone of the repository works on its own: traces and GPU profiles ship inside the package.

Clones the committed HEAD into a temp folder with nothing beside it (no ../shared), then, with the
clone first on PYTHONPATH and as cwd, builds a trace workload and runs a GPU-cost-model simulation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
from pathlib import Path
import carpool
from carpool.harness.workload import PromptSource, WorkloadConfig, build_workload, load_trace
from carpool.cli import main

clone = Path.cwd().resolve()
assert Path(carpool.__file__).resolve().is_relative_to(clone), carpool.__file__
trace = load_trace("arxiv")
assert Path(trace.path).resolve().is_relative_to(clone), trace.path
cfg = WorkloadConfig(num_requests=20, lengths="trace", trace="arxiv", length_scale=0.25, qps=1.0)
specs = build_workload(cfg, PromptSource(word_ids=[1, 2, 3]))
assert all(s.prompt_len >= 1 for s in specs)
rc = main(["simulate", "--cost-model", "gpu", "--gpu", "h100", "--model-shape", "llama-2-70b", "--tp", "2",
           "--pp", "2", "--lengths", "trace", "--trace", "splitwise", "--arrivals", "trace",
           "--num-requests", "20", "--qps", "2", "--no-plots", "--output", sys.argv[1]])
print(json.dumps({"carpool": carpool.__file__, "trace": trace.path, "rows": len(trace),
                  "requests": len(specs), "rc": rc}))
"""


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_fresh_clone_runs_trace_workload_and_gpu_simulation(tmp_path):
    clone = tmp_path / "carpool"
    subprocess.run(["git", "clone", "--quiet", "--no-local", str(REPO), str(clone)], check=True, timeout=60)
    assert not (clone.parent / "shared").exists() and not (clone / "shared").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("CARPOOL_TRACES_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = str(clone)
    out = tmp_path / "sim"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], cwd=clone, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0 and result["rows"] == 28257 and result["requests"] == 20
    report = json.loads((out / "simulation.json").read_text())
    assert report["schedulers"]["sarathi"]["summary"]["num_completed"] == 20

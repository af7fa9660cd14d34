"""A worker that dies fails the engine's requests with a clear error (ExecutorError, raised by
step) and stops the other workers; a worker that cannot load its shard fails the engine start.
Nothing hangs (every wait is bounded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from carpool.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2]

# Runs in its own process: the test process keeps a usable torch.distributed state whatever
# happens, and the subprocess timeout bounds the whole scenario.
KILL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time

    def main():
        from carpool.executor import ExecutorError
        from carpool.engine import LLMEngine
        from carpool.sampling_params import SamplingParams

        model, tp, pp, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        engine = LLMEngine(model=model, dtype="float32", kv_cache_memory=16 << 20, num_threads=1,
                           tensor_parallel_size=tp, pipeline_parallel_size=pp)
        sp = SamplingParams(max_tokens=400, ignore_eos=True)
        requests = [engine.add_request(list(range(100, 130 + i)), sp) for i in range(4)]
        for _ in range(4):
            engine.step()
        processes = engine.executor.processes
        os.kill(processes[victim].pid, signal.SIGKILL)
        start = time.monotonic()
        raised = None
        try:
            while engine.has_unfinished_requests() and time.monotonic() - start < 60:
                engine.step()
        except ExecutorError as e:
            raised = str(e)
        elapsed = time.monotonic() - start
        time.sleep(0.5)
        refused = []
        for call in (lambda: engine.add_request([1, 2, 3]), engine.step):
            try:
                call()
            except ExecutorError as e:
                refused.append(str(e))
        print(json.dumps({"elapsed": elapsed, "raised": raised,
                          "requests": [[r.finish_reason, r.error] for r in requests],
                          "unfinished": engine.has_unfinished_requests(),
                          "alive": [p.is_alive() for p in processes.values()], "refused": refused}))

    if __name__ == "__main__":
        main()
""")


@pytest.mark.parametrize("tp,pp,victim", [(2, 1, 1), *(pytest.param(*p, marks=pytest.mark.slow) for p in [(1, 2, 1), (2, 2, 3)])])
def test_dead_worker_fails_requests_and_stops_the_rest(tmp_path, tiny_llama, tp, pp, victim):
    script = tmp_path / "kill_worker.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), tiny_llama, str(tp), str(pp), str(victim)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["elapsed"] < 20
    assert f"worker rank {victim}" in result["raised"] and "SIGKILL" in result["raised"]
    for reason, error in result["requests"]:
        assert reason == "error" and error == result["raised"]
    assert not result["unfinished"]
    assert not any(result["alive"])
    assert len(result["refused"]) == 2 and all(r == result["raised"] for r in result["refused"])


def test_worker_that_cannot_load_fails_the_start(tmp_path, tiny_llama):
    """Layer 0 is missing: only the stage-0 worker notices; the driver reports its error."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(tiny_llama).iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v for k, v in load_file(f).items() if not k.startswith("model.layers.0.")}
            save_file(tensors, broken / f.name, metadata={"format": "pt"})
        elif f.name != "model.safetensors.index.json":
            (broken / f.name).write_bytes(f.read_bytes())
    threads = torch.get_num_threads()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 \(pipeline stage 0.*lacks weights"):
            LLMEngine(model=str(broken), dtype="float32", kv_cache_memory=16 << 20, num_threads=1,
                      pipeline_parallel_size=2)
    finally:
        torch.set_num_threads(threads)
    assert time.monotonic() - start < 60
    import torch.distributed as dist

    assert not dist.is_initialized()  # the process group was left, so a next engine can start

"""The README's two-host command, with both "hosts" on loopback: torchrun node ranks 0 and 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.engine import LLMEngine
from tests.distributed.test_equivalence import TINY
from tests.distributed.test_serving import final_texts

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_torchrun_on_loopback(tiny_llama):
    engine = LLMEngine(model=tiny_llama, **TINY)
    expected = final_texts(engine, [engine.tokenizer.encode(PROMPT)], 12)[0]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    carpool = ["-m", "carpool.distributed.launch", "generate", "--raw", PROMPT, "--max-tokens", "12",
               "--model", tiny_llama, "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "16MiB",
               "--pipeline-parallel-size", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    node1 = subprocess.Popen(torchrun + ["--node-rank", "1"] + carpool, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        node0 = subprocess.run(torchrun + ["--node-rank", "0"] + carpool, capture_output=True, text=True,
                               timeout=150, env=env, cwd=ROOT)
        out1, _ = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, out1[-3000:]
    assert node0.stdout.strip().splitlines()[-1] == expected.strip()

"""Start `carpool serve` as a real process for the tests that need one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*flags: str, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`carpool serve` with `flags` on a free port, once /health says 200: (process, base url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), *flags]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if p.poll() is not None:
            pytest.fail(f"carpool serve exited with {p.returncode}:\n{p.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            p.kill()
            pytest.fail("carpool serve did not become healthy")
        time.sleep(0.2)

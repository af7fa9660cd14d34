"""`carpool bench startup`: seconds from `carpool serve` to its first answer, by phase.

Starts a real `carpool serve` process, timestamps each line it logs as it arrives (the phases:
reading the model, loading weights, compiling, allocating the KV cache), polls /health until it
answers, then times one one-token completion. Writes JSON, a table and a timeline plot.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_startup_bench(args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), *args.serve_args]
    if args.model:
        cmd += ["--model", args.model]
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    healthy = first = None
    try:
        with httpx.Client(timeout=10) as client:
            while healthy is None:
                if proc.poll() is not None:
                    raise RuntimeError("carpool serve exited:\n" + "\n".join(line for _, line in lines[-20:]))
                if time.perf_counter() - start > args.timeout:
                    raise TimeoutError(f"carpool serve not healthy after {args.timeout} s")
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        healthy = time.perf_counter() - start
                except httpx.TransportError:
                    time.sleep(0.05)
            response = client.post(f"{url}/v1/completions", timeout=args.timeout,
                                   json={"model": client.get(f"{url}/v1/models").json()["data"][0]["id"],
                                         "prompt": "Hello", "max_tokens": 1})
            response.raise_for_status()
            first = time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(timeout=5)
    result = {"command": cmd, "model": args.model, "log": [{"seconds": t, "line": line} for t, line in lines],
              "healthy_s": healthy, "first_answer_s": first}
    write_outputs(result, Path(args.output))
    return result


def write_outputs(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(result, indent=2))
    rows = ["| seconds since start | event |", "|---|---|"]
    rows += [f"| {e['seconds']:.2f} | {e['line'][:140].replace('|', '/')} |" for e in result["log"]
             if " carpool" in e["line"] or "Uvicorn" in e["line"]]
    rows += [f"| {result['healthy_s']:.2f} | /health answers 200 |",
             f"| {result['first_answer_s']:.2f} | first completion answered (1 token) |"]
    (out / "startup.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    plot(result, out / "startup.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [(e["seconds"], e["line"].split("carpool:", 1)[-1].strip()[:60]) for e in result["log"]
              if " carpool" in e["line"]]
    events += [(result["healthy_s"], "/health 200"), (result["first_answer_s"], "first answer")]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(events) + 1))
    for i, (t, label) in enumerate(events):
        ax.barh(i, t, color="tab:blue" if i < len(events) - 2 else "tab:green")
        ax.text(t, i, f" {t:.1f} s  {label}", va="center", fontsize=7)
    ax.set_yticks([])
    ax.set_xlabel("seconds since `carpool serve` started")
    ax.set_xlim(0, result["first_answer_s"] * 1.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

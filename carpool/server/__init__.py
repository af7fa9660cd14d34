"""`carpool serve`: an OpenAI-compatible HTTP server over LLMEngine.

This package's __init__ stays light (argparse only) so that `carpool --help` does not import
FastAPI; the app lives in `carpool.server.api_server`.
"""

from __future__ import annotations

import argparse
import os


def add_server_args(p: argparse.ArgumentParser) -> None:
    """HTTP flags of `carpool serve`, named as in `vllm serve`."""
    g = p.add_argument_group("server (named as in vllm serve)")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("CARPOOL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(default: $CARPOOL_API_KEY, else no key)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients may ask for; the first is reported "
                        "(default: --model, or the embedded model's file name)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After instead of queueing past this many waiting requests")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")

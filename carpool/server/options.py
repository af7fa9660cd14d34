"""How the HTTP server is set up: a plain dataclass, and the `carpool serve` flags that fill it
(named as in `vllm serve`). Kept free of FastAPI so that `carpool --help` stays light."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

from carpool.server.protocol import MAX_LOGPROBS, MAX_N
from carpool.tools.parsers import TOOL_PARSERS, get_tool_parser


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | list[str] | None = None  # several: any of them is accepted (vLLM's --api-key K1 K2)
    served_model_name: list[str] | None = None
    max_waiting_requests: int | None = None
    # Engine requests (prompts x n) one HTTP request may create.
    max_choices_per_request: int = MAX_N
    # Bodies past this get 413 before they are parsed (a 128k-token prompt is ~0.6 MB of JSON).
    max_request_body_bytes: int = 2 << 20
    metrics_namespace: str = "carpool"  # or "vllm": the same metrics under vLLM's names
    chat_template: str | None = None  # a Jinja template (or a file holding one) instead of the model's
    default_chat_template_kwargs: dict | None = None  # template variables; a request's chat_template_kwargs win
    allowed_origins: list[str] | None = None  # CORS; none by default (same-origin only)
    allow_credentials: bool = False
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse calls out of the text...
    tool_call_parser: str | None = None  # ...with this parser (carpool/tools/parsers.py)
    enable_log_requests: bool = False  # log each request's prompt, cut to max_log_len characters
    disable_log_stats: bool = False  # no stats line every LOG_STATS_INTERVAL seconds (server/metrics.py)
    max_log_len: int | None = None
    shutdown_timeout: float = 30.0
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    root_path: str = ""  # the path prefix a proxy serves the app under (FastAPI's root_path)
    response_role: str = "assistant"  # the role of the message chat responses carry
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (a request may say otherwise)
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs / top_logprobs / prompt_logprobs a request may ask for
    disable_fastapi_docs: bool = False  # no /openapi.json (carpool serves no /docs or /redoc UI either way)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (it shows the chat template)

    def __post_init__(self) -> None:
        if self.max_choices_per_request < 1:
            raise ValueError("max_choices_per_request must be >= 1")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be >= 1024")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser)")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError("root_path must start with '/' and not end with one, e.g. /api")

    def model_names(self, model_path: str) -> list[str]:
        """Names clients may ask for: --served-model-name, else the model's repo id or file or
        folder name (never a local path: responses must not reveal the server's file system)."""
        if self.served_model_name:
            return list(self.served_model_name)
        if not Path(model_path).exists():  # a Hugging Face repo id (from the local cache): as given
            return [model_path]
        return [Path(model_path).name.removesuffix(".gguf")]

    def chat_template_text(self) -> str | None:
        if self.chat_template and Path(self.chat_template).is_file():
            return Path(self.chat_template).read_text()
        return self.chat_template

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = [text]  # a single bare value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerOptions()
    g = p.add_argument_group("server (named as in vllm serve)")
    g.add_argument("--host", default=d.host, help=f"bind address (default: {d.host})")
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", nargs="+", default=os.environ.get("CARPOOL_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize, KEY one of "
                        "these (default: $CARPOOL_API_KEY, else $VLLM_API_KEY, else no key)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients may ask for; the first is reported "
                        "(default: the model's file or folder name)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After instead of queueing past this many waiting requests")
    g.add_argument("--max-choices-per-request", type=int, default=d.max_choices_per_request,
                   help=f"most engine requests (prompts x n) one HTTP request may ask for "
                        f"(default: {d.max_choices_per_request})")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help=f"larger request bodies get 413 (default: {d.max_request_body_bytes})")
    g.add_argument("--metrics-namespace", choices=("carpool", "vllm"), default=d.metrics_namespace,
                   help="prefix of the /metrics names: carpool:... (default) or vllm:..., so that dashboards "
                        "and gateways that read vllm:num_requests_waiting work unchanged")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the model's own)")
    g.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   help='chat template variables for every chat request, as a JSON object, e.g. '
                        '\'{"enable_thinking": false}\'; a request\'s chat_template_kwargs override them')
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help='answer tool_choice "auto" (the default when tools are given) by parsing the '
                        "model's calls out of its text; needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>)")
    g.add_argument("--allowed-origins", type=json_list, default=None,
                   help='CORS origins, as a JSON list, e.g. \'["https://app.example"]\' (default: none)')
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--allowed-methods", type=json_list, default=None, help='CORS methods (default: ["*"])')
    g.add_argument("--allowed-headers", type=json_list, default=None, help='CORS headers (default: ["*"])')
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log every request's prompt (default: off)")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="vLLM's older spelling of --no-enable-log-requests")
    g.add_argument("--no-disable-log-requests", dest="enable_log_requests", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--max-log-len", type=int, default=None, help="characters of a prompt to log")
    g.add_argument("--disable-log-stats", action=argparse.BooleanOptionalAction, default=False,
                   help="no stats line (throughput, queues, step times) in the log every 10 s while busy")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    g.add_argument("--uvicorn-log-level", default=d.uvicorn_log_level,
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--root-path", default=d.root_path,
                   help="the path prefix a reverse proxy serves this server under, e.g. /api (FastAPI's root_path)")
    g.add_argument("--response-role", default=d.response_role,
                   help=f"the role of the message in chat responses (default: {d.response_role})")
    g.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                   help="write logprob tokens as 'token_id:N' (a request's return_tokens_as_token_ids overrides it)")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help=f"the most logprobs, top_logprobs or prompt_logprobs a request may ask for "
                        f"(default and most: {MAX_LOGPROBS})")
    g.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                   help="do not serve the OpenAPI schema at /openapi.json (no /docs or /redoc page is served "
                        "either way)")
    g.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=False,
                   help="serve GET /tokenizer_info: the tokenizer's configuration (tokenizer_config.json, "
                        "chat template included), as vLLM does")
    g.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM's command lines: usage.prompt_tokens_details.cached_tokens is always "
                        "reported")

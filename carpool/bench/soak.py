"""`carpool bench soak`: minutes of mixed, hostile traffic against a real `carpool serve` process.

Clients run concurrently for `--duration` seconds, each picking what to do next at random:
valid requests (completions and chat, streamed or not), malformed ones (bad JSON, bad values,
wrong content type, oversized bodies), streams dropped at a random point, slow readers, and
bursts past `--max-waiting-requests`. A sample of greedy requests (fixed prompts, served once
alone before the soak) is sent again and again during it and must come back identical.

Pass criteria, reported in the JSON summary: no 5xx for any valid request, every greedy output
equal to its reference, 0 requests running or waiting and 0 KV blocks in use once the load
stops; RSS of the server process at start and end (and sampled over time, for the plot).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

GREEDY_PROMPTS = ["The capital of France is", "Write a haiku about carpools.", "1, 2, 3, 4,",
                  "def fibonacci(n):", "Once upon a time"]
TOPICS = ["the sea", "trains", "prime numbers", "bread", "a lighthouse", "the moon", "chess", "rain"]
GREEDY_TOKENS = 24


@dataclass
class Outcome:
    kind: str
    valid: bool  # a well-formed request that the server should serve
    status: int | None  # HTTP status (None: the client went away before one)
    ok: bool  # what the kind expects happened
    detail: str = ""
    t: float = 0.0


@dataclass
class SoakReport:
    duration_s: float
    requests: int
    by_outcome: dict[str, int]
    valid_5xx: int
    greedy_checked: int
    greedy_mismatches: int
    unexpected: list[str]
    running_at_end: float
    waiting_at_end: float
    kv_usage_at_end: float
    leaked_blocks: int
    rss_start_mb: float
    rss_end_mb: float
    rss_peak_mb: float
    # RSS grows while the KV cache's pages are first touched, then stays flat: growth over the
    # second half of the run is what a leak would show.
    rss_second_half_growth_mb: float
    rss_samples: list[tuple[float, float]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (self.valid_5xx == 0 and self.greedy_mismatches == 0 and self.leaked_blocks == 0
                and self.running_at_end == 0 and self.waiting_at_end == 0 and not self.unexpected)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def num_blocks(text: str) -> int:
    m = re.search(r'cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    return int(m.group(1)) if m else 0


class Soak:
    def __init__(self, url: str, model: str, max_waiting: int, references: dict[str, str], seed: int):
        self.url, self.model, self.max_waiting = url, model, max_waiting
        self.references = references
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.start = time.monotonic()

    def record(self, o: Outcome) -> None:
        o.t = time.monotonic() - self.start
        self.outcomes.append(o)

    # ------------------------------------------------------------ request kinds
    def valid_body(self, chat: bool, stream: bool) -> dict:
        rng = self.rng
        body = {"model": self.model, "max_tokens": rng.randint(4, 48), "stream": stream,
                "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 10**6)}
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(["\n\n", ".", " the"])]
        if rng.random() < 0.2:
            body["n"] = 2
        text = f"Tell me about {rng.choice(TOPICS)}."
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    async def valid(self, http) -> None:
        chat, stream = self.rng.random() < 0.5, self.rng.random() < 0.5
        body = self.valid_body(chat, stream)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        kind = f"valid-{'chat' if chat else 'completion'}-{'stream' if stream else 'full'}"
        if stream:
            async with http.stream("POST", self.url + path, json=body) as r:
                if r.status_code != 200:
                    self.record(Outcome(kind, True, r.status_code, r.status_code == 503, await _text(r)))
                    return
                error = None
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        error = line
                self.record(Outcome(kind, True, 200, error is None, error or ""))
        else:
            r = await http.post(self.url + path, json=body)
            self.record(Outcome(kind, True, r.status_code, r.status_code in (200, 503), r.text[:200]))

    async def greedy(self, http) -> None:
        prompt = self.rng.choice(GREEDY_PROMPTS)
        stream = self.rng.random() < 0.5
        body = {"model": self.model, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if stream:
            text = ""
            async with http.stream("POST", self.url + "/v1/completions", json=body) as r:
                status = r.status_code
                if status == 200:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk.get("choices"):
                                text += chunk["choices"][0]["text"]
        else:
            r = await http.post(self.url + "/v1/completions", json=body)
            status = r.status_code
            text = r.json()["choices"][0]["text"] if status == 200 else ""
        if status == 503:  # overloaded by a burst: refused cleanly, nothing to compare
            self.record(Outcome("greedy-check", True, status, True, "overloaded"))
            return
        same = status == 200 and text == self.references[prompt]
        self.record(Outcome("greedy-check", True, status, same, "" if same else f"{prompt!r}: {text!r}"))

    async def malformed(self, http) -> None:
        rng = self.rng
        cases = [
            ("bad-json", b'{"prompt": "Hi", ', "application/json", 400),
            ("bad-value", json.dumps({"prompt": "Hi", "temperature": -1}).encode(), "application/json", 400),
            ("infinite", b'{"prompt": "Hi", "temperature": Infinity}', "application/json", 400),
            ("bad-type", json.dumps({"prompt": 5}).encode(), "application/json", 400),
            ("too-many-stops", json.dumps({"prompt": "Hi", "stop": ["x"] * 1000}).encode(), "application/json", 400),
            ("bad-token", json.dumps({"prompt": [10**9]}).encode(), "application/json", 400),
            ("too-long", json.dumps({"prompt": "hi " * 20000, "max_tokens": 4}).encode(), "application/json", 400),
            ("wrong-content-type", b'{"prompt": "Hi"}', "text/plain", 415),
            ("oversized", json.dumps({"prompt": "x" * (3 << 20)}).encode(), "application/json", 413),
        ]
        name, body, ctype, expected = rng.choice(cases)
        r = await http.post(self.url + "/v1/completions", content=body, headers={"Content-Type": ctype})
        # A full queue answers 503 before the body is read (OverloadGuard), malformed or not.
        refused_unread = r.status_code == 503 and '"code":"overloaded"' in r.text
        self.record(Outcome(f"malformed-{name}", False, r.status_code, r.status_code == expected or refused_unread,
                            r.text[:200]))

    async def disconnect(self, http) -> None:
        body = self.valid_body(chat=self.rng.random() < 0.5, stream=True)
        body["max_tokens"], body["ignore_eos"] = 200, True
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        keep = self.rng.randint(0, 10)
        async with http.stream("POST", self.url + path, json=body) as r:
            status = r.status_code
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen > keep:
                        break  # leaving the block closes the connection mid-stream
        self.record(Outcome("disconnect", True, status, status in (200, 503)))

    async def slow_reader(self, http) -> None:
        body = self.valid_body(chat=False, stream=True)
        body["max_tokens"], body["ignore_eos"] = 64, True
        text, status = "", None
        async with http.stream("POST", self.url + "/v1/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    await asyncio.sleep(self.rng.uniform(0.05, 0.3))
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        text += chunk["choices"][0]["text"]
        self.record(Outcome("slow-reader", True, status, status in (200, 503)))

    async def burst(self, http) -> None:
        n = 2 * self.max_waiting + 4
        body = {"model": self.model, "prompt": "Burst!", "max_tokens": 4}
        rs = await asyncio.gather(*(http.post(self.url + "/v1/completions", json=body) for _ in range(n)),
                                  return_exceptions=True)
        for r in rs:
            status = getattr(r, "status_code", None)
            ok = status == 200 or (status == 503 and "retry-after" in r.headers)
            self.record(Outcome("burst", True, status, ok, "" if ok else str(r)[:200]))

    # ------------------------------------------------------------ the clients
    async def client(self, http, deadline: float) -> None:
        kinds = [(self.valid, 40), (self.greedy, 15), (self.malformed, 20), (self.disconnect, 10),
                 (self.slow_reader, 8), (self.burst, 2)]
        funcs, weights = zip(*kinds)
        while time.monotonic() < deadline:
            fn = self.rng.choices(funcs, weights)[0]
            try:
                await fn(http)
            except Exception as exc:  # a transport error: the server must never cause one
                self.record(Outcome(fn.__name__, True, None, False, f"{type(exc).__name__}: {exc}"))


async def _text(r) -> str:
    await r.aread()
    return r.text[:200]


def _start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), "--served-model-name", "soak",
           "--max-waiting-requests", str(args.max_waiting_requests), "--uvicorn-log-level", "warning",
           "--disable-uvicorn-access-log", "--dtype", args.dtype, "--max-num-batched-tokens",
           str(args.max_num_batched_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    log = open(Path(args.output) / "server.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"carpool serve exited with {proc.returncode}; see server.log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("carpool serve did not become healthy")


async def _soak(args, url: str, pid: int) -> SoakReport:
    import httpx
    import psutil

    proc = psutil.Process(pid)
    limits = httpx.Limits(max_connections=4 * args.clients + 64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        references = {}
        for prompt in GREEDY_PROMPTS:  # each alone, before any load
            r = await http.post(url + "/v1/completions", json={"model": "soak", "prompt": prompt, "temperature": 0,
                                                               "max_tokens": GREEDY_TOKENS, "ignore_eos": True})
            references[prompt] = r.json()["choices"][0]["text"]
        soak = Soak(url, "soak", args.max_waiting_requests, references, args.seed)
        rss_start = proc.memory_info().rss / 2**20
        samples = [(0.0, rss_start)]
        deadline = time.monotonic() + args.duration

        async def sample_rss():
            while time.monotonic() < deadline:
                await asyncio.sleep(5)
                samples.append((time.monotonic() - soak.start, proc.memory_info().rss / 2**20))

        await asyncio.gather(sample_rss(), *(soak.client(http, deadline) for _ in range(args.clients)))
        # Idle: give aborted requests a moment to be freed, then read the engine's state.
        for _ in range(60):
            text = (await http.get(url + "/metrics")).text
            if metric(text, "carpool:num_requests_running") == 0 and metric(text, "carpool:kv_cache_usage_perc") == 0:
                break
            await asyncio.sleep(0.5)
    rss_end = proc.memory_info().rss / 2**20
    outcomes = soak.outcomes
    by = Counter(f"{o.kind} {o.status}" for o in outcomes)
    usage = metric(text, "carpool:kv_cache_usage_perc")
    greedy = [o for o in outcomes if o.kind == "greedy-check" and o.status == 200]
    return SoakReport(
        duration_s=args.duration, requests=len(outcomes), by_outcome=dict(sorted(by.items())),
        valid_5xx=sum(1 for o in outcomes if o.valid and o.status is not None and o.status >= 500 and o.status != 503),
        greedy_checked=len(greedy), greedy_mismatches=sum(1 for o in greedy if not o.ok),
        unexpected=[f"{o.kind} {o.status} {o.detail}" for o in outcomes if not o.ok][:50],
        running_at_end=metric(text, "carpool:num_requests_running"),
        waiting_at_end=metric(text, "carpool:num_requests_waiting"), kv_usage_at_end=usage,
        leaked_blocks=round(usage * num_blocks(text)), rss_start_mb=rss_start, rss_end_mb=rss_end,
        rss_peak_mb=max(v for _, v in samples + [(0, rss_end)]),
        rss_second_half_growth_mb=rss_end - next(v for t, v in samples if t >= args.duration / 2 - 5),
        rss_samples=samples)


def run_soak(args) -> SoakReport:
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start_server(args, port)
    try:
        _wait_healthy(url, server)
        report = asyncio.run(_soak(args, url, server.pid))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    summary = asdict(report) | {"passed": report.passed, "server_exit_code": server.returncode}
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    _plot(report, out / "soak.png")
    print(f"soak: {report.requests} requests in {report.duration_s:.0f} s; valid 5xx {report.valid_5xx}; "
          f"greedy mismatches {report.greedy_mismatches}/{report.greedy_checked}; leaked blocks "
          f"{report.leaked_blocks}; RSS {report.rss_start_mb:.0f} -> {report.rss_end_mb:.0f} MiB "
          f"(peak {report.rss_peak_mb:.0f}, second half {report.rss_second_half_growth_mb:+.0f}); "
          f"server exit {server.returncode}; "
          f"{'PASSED' if report.passed else 'FAILED'}", file=sys.stderr)
    for key, n in report.by_outcome.items():
        print(f"  {key:<40} {n}", file=sys.stderr)
    for line in report.unexpected[:10]:
        print(f"  unexpected: {line}", file=sys.stderr)
    return report


def _plot(report: SoakReport, path: Path) -> None:
    from carpool.harness.plots import _plt, _save

    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    t, rss = zip(*report.rss_samples) if report.rss_samples else ((), ())
    a.plot(t, rss, marker=".")
    a.set_xlabel("time (s)")
    a.set_ylabel("server RSS (MiB)")
    a.set_title("RSS during the soak")
    kinds = Counter()
    for key, n in report.by_outcome.items():
        kinds[key] += n
    b.barh(list(kinds), list(kinds.values()))
    b.set_xlabel("requests")
    b.set_title("requests by kind and status")
    fig.tight_layout()
    _save(fig, path)

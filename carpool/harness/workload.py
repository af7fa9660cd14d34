"""Workloads for benchmarks and the simulator: request lengths, arrival times and prompt tokens,
deterministic per seed.

A workload is a list of `RequestSpec`s (arrival offset in seconds, prompt token ids, output
length). Drivers replay it; nothing here knows about engines or HTTP.

Lengths come from `fixed`, `uniform`, `zipf` or a trace CSV (a path, or the name of one shipped
in `carpool/data/traces/`). Trace lengths are tokens of another tokenizer, so they are *scaled*
into the serving model's context:

    prompt = clip(round(num_prefill_tokens * length_scale), min_prompt_len, max_prompt_len)
    output = clip(round(num_decode_tokens  * length_scale), min_output_len, max_output_len)

One factor for both keeps each request's prompt:decode (P:D) ratio unless a clip bites; a final
cut keeps prompt + output within `max_model_len`.

Shared prefixes (for prefix caching): `system_prompt_len` puts the same tokens in front of every
request's prompt. `turns` > 1 makes each request of the workload a *conversation*: its first turn
arrives as above, and each later turn arrives `think_time` seconds (exponential, that mean) after
the previous one finished, with the previous prompt + the previous answer + a new user message as
its prompt. Each turn draws its message and answer lengths like a single request (a trace's row,
scaled and clipped); a conversation ends early where the next turn would not fit `max_model_len`.
Since an answer is known only once generated, a follow-up turn's spec holds only its new message
and the index of the turn before (`parent`); drivers build the prompt when that turn finishes.

Arrivals: `poisson` (exponential gaps) or `gamma` (gaps with coefficient of variation
`burstiness`; 1 is Poisson, larger is burstier) at `qps`; `trace` (the trace's own `arrived_at`,
rescaled to `qps` when one is given); `burst` (everything at t=0). The unit gaps are drawn once
per seed and divided by `qps`, so changing the rate stretches the same workload in time; lengths,
prompts and arrivals use independent random streams, and every draw is sequential, so the first
k requests of a workload are the same whatever `num_requests` is (a longer run extends a shorter
one) and changing the rate never reshuffles lengths or prompts.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from carpool.data import TRACES_DIR

LENGTH_KINDS = ("fixed", "uniform", "zipf", "trace")
ARRIVAL_KINDS = ("poisson", "gamma", "trace", "burst")
TRACE_NAMES = {
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "arxiv_summarization": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "splitwise": "splitwise_conv.csv",
    "splitwise_conv": "splitwise_conv.csv",
}
PREFILL_COLUMN, DECODE_COLUMN, ARRIVAL_COLUMN = "num_prefill_tokens", "num_decode_tokens", "arrived_at"


class WorkloadError(ValueError):
    """A workload setting or trace file that cannot produce requests; the message says which."""


@dataclass
class RequestSpec:
    """One request to replay: when it arrives (s after the start), what it sends, how much it gets.
    A follow-up turn of a conversation (`parent` set) arrives `arrival_time` s after its previous
    turn finished and sends that turn's prompt and answer (`history_len` tokens in all) followed by
    its own `prompt_token_ids`: see `followup_prompt`."""

    index: int
    arrival_time: float
    prompt_token_ids: list[int]
    output_len: int
    parent: int | None = None
    history_len: int = 0

    @property
    def prompt_len(self) -> int:
        return self.history_len + len(self.prompt_token_ids)


def followup_prompt(spec: RequestSpec, previous_turn: list[int]) -> list[int]:
    """The exact prompt of a follow-up turn: the previous turn's prompt and answer tokens (as the
    engine holds them, so that every token of the conversation so far repeats), then the new
    message."""
    return list(previous_turn) + spec.prompt_token_ids


def split_conversations(specs: list[RequestSpec]) -> tuple[list[RequestSpec], dict[int, list[RequestSpec]]]:
    """First turns (or single requests) sorted by arrival, and follow-ups by their parent index."""
    followups: dict[int, list[RequestSpec]] = {}
    for s in specs:
        if s.parent is not None:
            followups.setdefault(s.parent, []).append(s)
    return sorted((s for s in specs if s.parent is None), key=lambda s: s.arrival_time), followups


@dataclass
class WorkloadConfig:
    num_requests: int = 100
    lengths: str = "fixed"
    prompt_len: int = 512  # fixed
    output_len: int = 128  # fixed
    min_prompt_len: int = 1  # uniform/zipf range, trace clip
    max_prompt_len: int = 2048
    min_output_len: int = 1
    max_output_len: int = 256
    zipf_theta: float = 1.0
    trace: str | None = None  # path or a name in TRACE_NAMES
    length_scale: float = 1.0
    trace_offset: int | None = None  # first row of a contiguous window (trace arrivals); None: 0
    arrivals: str = "poisson"
    qps: float | None = 1.0  # None with trace arrivals: the trace's own rate
    burstiness: float = 1.0  # gamma: coefficient of variation of the gaps
    max_model_len: int | None = None
    seed: int = 0
    system_prompt_len: int = 0  # shared tokens in front of every (first-turn) prompt
    turns: int = 1  # > 1: each request is a conversation of this many turns
    think_time: float = 1.0  # mean s between a turn's answer and the next turn

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.lengths not in LENGTH_KINDS:
            raise WorkloadError(f"unknown lengths {self.lengths!r}; choose from {', '.join(LENGTH_KINDS)}")
        if self.arrivals not in ARRIVAL_KINDS:
            raise WorkloadError(f"unknown arrivals {self.arrivals!r}; choose from {', '.join(ARRIVAL_KINDS)}")
        for name in ("prompt_len", "output_len", "min_prompt_len", "min_output_len"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_prompt_len > self.max_prompt_len:
            raise WorkloadError(f"min_prompt_len {self.min_prompt_len} > max_prompt_len {self.max_prompt_len}")
        if self.min_output_len > self.max_output_len:
            raise WorkloadError(f"min_output_len {self.min_output_len} > max_output_len {self.max_output_len}")
        if not self.zipf_theta > 0:
            raise WorkloadError(f"zipf_theta must be > 0, got {self.zipf_theta}")
        if not self.length_scale > 0:
            raise WorkloadError(f"length_scale must be > 0, got {self.length_scale}")
        if self.qps is not None and not (self.qps > 0 and math.isfinite(self.qps)):
            raise WorkloadError(f"qps must be a positive number, got {self.qps}")
        if self.qps is None and self.arrivals in ("poisson", "gamma"):
            raise WorkloadError(f"{self.arrivals} arrivals need a qps")
        if not self.burstiness > 0:
            raise WorkloadError(f"burstiness must be > 0, got {self.burstiness}")
        if self.lengths == "trace" and not self.trace:
            raise WorkloadError("lengths 'trace' needs a trace file (--trace PATH or arxiv / splitwise)")
        if self.arrivals == "trace" and not self.trace:
            raise WorkloadError("arrivals 'trace' needs a trace file with an arrived_at column")
        if self.trace_offset is not None and self.trace_offset < 0:
            raise WorkloadError(f"trace_offset must be >= 0, got {self.trace_offset}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise WorkloadError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.system_prompt_len < 0:
            raise WorkloadError(f"system_prompt_len must be >= 0, got {self.system_prompt_len}")
        if self.max_model_len is not None and self.system_prompt_len + 2 > self.max_model_len:
            raise WorkloadError(f"system_prompt_len {self.system_prompt_len} leaves no room in max_model_len "
                                f"{self.max_model_len}")
        if self.turns < 1:
            raise WorkloadError(f"turns must be >= 1, got {self.turns}")
        if not (self.think_time >= 0 and math.isfinite(self.think_time)):
            raise WorkloadError(f"think_time must be >= 0 seconds, got {self.think_time}")


# ---------------------------------------------------------------- traces
@dataclass
class Trace:
    """Columns of a trace CSV: per-row prompt and output lengths, and arrival times if present."""

    path: str
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    arrivals: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompt_lens)


def trace_dirs() -> list[Path]:
    """Where trace names are looked up: $CARPOOL_TRACES_DIR (users' own files), then the traces
    shipped in the package."""
    dirs = [Path(os.environ["CARPOOL_TRACES_DIR"])] if os.environ.get("CARPOOL_TRACES_DIR") else []
    return dirs + [TRACES_DIR]


def resolve_trace(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = TRACE_NAMES.get(name_or_path, name_or_path)
    for d in trace_dirs():
        if (d / name).is_file():
            return d / name
    raise WorkloadError(f"trace {name_or_path!r} not found: not a file, and not in "
                        f"{', '.join(str(d) for d in trace_dirs())} (names: {', '.join(sorted(TRACE_NAMES))})")


def load_trace(name_or_path: str) -> Trace:
    """Parse a trace CSV with num_prefill_tokens, num_decode_tokens (and optional arrived_at)."""
    path = resolve_trace(name_or_path)
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = [c.strip() for c in (reader.fieldnames or [])]
            missing = [c for c in (PREFILL_COLUMN, DECODE_COLUMN) if c not in columns]
            if missing:
                raise WorkloadError(f"trace {path}: missing column(s) {', '.join(missing)}; "
                                    f"found {', '.join(columns) or 'no header'}")
            has_arrivals = ARRIVAL_COLUMN in columns
            prompts, outputs, arrivals = [], [], []
            for lineno, row in enumerate(reader, start=2):
                row = {(k or "").strip(): v for k, v in row.items()}
                try:
                    p, d = float(row[PREFILL_COLUMN]), float(row[DECODE_COLUMN])
                    a = float(row[ARRIVAL_COLUMN]) if has_arrivals else 0.0
                except (TypeError, ValueError):
                    raise WorkloadError(f"trace {path}, line {lineno}: not a number in {dict(row)}") from None
                if not (math.isfinite(p) and math.isfinite(d) and math.isfinite(a)) or p < 1 or d < 1 or a < 0:
                    raise WorkloadError(f"trace {path}, line {lineno}: lengths must be >= 1 and arrived_at "
                                        f">= 0, got {dict(row)}")
                prompts.append(p)
                outputs.append(d)
                arrivals.append(a)
    except UnicodeDecodeError:
        raise WorkloadError(f"trace {path}: not a text CSV file") from None
    if not prompts:
        raise WorkloadError(f"trace {path}: no rows")
    arr = np.asarray(arrivals) if has_arrivals else None
    if arr is not None and np.any(np.diff(arr) < 0):
        raise WorkloadError(f"trace {path}: arrived_at must not decrease from row to row")
    return Trace(str(path), np.asarray(prompts), np.asarray(outputs), arr)


# ---------------------------------------------------------------- lengths and arrivals
def bounded_zipf(rng: np.random.Generator, lo: int, hi: int, theta: float, n: int) -> np.ndarray:
    """Values lo..hi with P(lo + k) proportional to 1 / (k + 1)^theta: short is common, long is rare."""
    ranks = np.arange(1, hi - lo + 2, dtype=np.float64)
    p = ranks ** -theta
    return lo + rng.choice(len(ranks), size=n, p=p / p.sum())


def scale_lengths(prompts: np.ndarray, outputs: np.ndarray, cfg: WorkloadConfig) -> tuple[np.ndarray, np.ndarray]:
    """Trace lengths -> this model: one scale for both (keeps P:D), then clip to the ranges."""
    p = np.clip(np.rint(prompts * cfg.length_scale), cfg.min_prompt_len, cfg.max_prompt_len).astype(int)
    d = np.clip(np.rint(outputs * cfg.length_scale), cfg.min_output_len, cfg.max_output_len).astype(int)
    return p, d


def unit_gaps(rng: np.random.Generator, kind: str, burstiness: float, n: int) -> np.ndarray:
    """Inter-arrival gaps with mean 1 (divide by qps). The first request arrives at t=0."""
    if kind == "poisson":
        gaps = rng.exponential(1.0, n)
    else:  # gamma with mean 1 and CV = burstiness: shape 1/cv^2, scale cv^2
        shape = 1.0 / burstiness ** 2
        gaps = rng.gamma(shape, 1.0 / shape, n)
    gaps[0] = 0.0
    return gaps


def make_lengths_and_arrivals(cfg: WorkloadConfig, trace: Trace | None, streams: tuple
                              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = cfg.num_requests
    prompt_rng, output_rng, arr_rng = streams
    arrivals = None
    if cfg.lengths == "fixed":
        prompts, outputs = np.full(n, cfg.prompt_len), np.full(n, cfg.output_len)
    elif cfg.lengths == "uniform":
        prompts = prompt_rng.integers(cfg.min_prompt_len, cfg.max_prompt_len, n, endpoint=True)
        outputs = output_rng.integers(cfg.min_output_len, cfg.max_output_len, n, endpoint=True)
    elif cfg.lengths == "zipf":
        prompts = bounded_zipf(prompt_rng, cfg.min_prompt_len, cfg.max_prompt_len, cfg.zipf_theta, n)
        outputs = bounded_zipf(output_rng, cfg.min_output_len, cfg.max_output_len, cfg.zipf_theta, n)
    else:
        assert trace is not None
        if cfg.arrivals == "trace":  # a contiguous window: lengths and times of the same rows
            rows = trace_window(trace, cfg)
        else:  # a seeded sample of rows, with replacement so that the first k never depend on n
            rows = prompt_rng.integers(len(trace), size=n)
        prompts, outputs = scale_lengths(trace.prompt_lens[rows], trace.output_lens[rows], cfg)
    if cfg.arrivals == "trace":
        assert trace is not None
        if trace.arrivals is None:
            raise WorkloadError(f"trace {trace.path} has no {ARRIVAL_COLUMN} column, so it cannot give "
                                "arrival times; use poisson or gamma arrivals")
        rows = trace_window(trace, cfg)
        times = trace.arrivals[rows] - trace.arrivals[rows[0]]
        if cfg.qps is not None and len(times) > 1:
            if times[-1] <= 0:
                raise WorkloadError(f"trace {trace.path}: the chosen rows all arrive at once; no rate to rescale")
            times = times * ((len(times) - 1) / times[-1]) / cfg.qps  # mean rate -> qps, shape kept
        arrivals = times
    elif cfg.arrivals == "burst":
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(unit_gaps(arr_rng, cfg.arrivals, cfg.burstiness, n)) / cfg.qps
    prompts, outputs = np.asarray(prompts, dtype=int), np.asarray(outputs, dtype=int)
    if cfg.max_model_len is not None:  # leave room for the output; never below one prompt token
        outputs = np.minimum(outputs, cfg.max_model_len - 1)
        prompts = np.clip(np.minimum(prompts, cfg.max_model_len - outputs), 1, None)
    return prompts, outputs, np.asarray(arrivals, dtype=float)


def trace_window(trace: Trace, cfg: WorkloadConfig) -> np.ndarray:
    start = cfg.trace_offset or 0
    if start + cfg.num_requests > len(trace):
        raise WorkloadError(f"trace {trace.path} has {len(trace)} rows; rows {start}..{start + cfg.num_requests - 1} "
                            "do not fit (lower --num-requests or --trace-offset)")
    return np.arange(start, start + cfg.num_requests)


# ---------------------------------------------------------------- prompt tokens
@dataclass
class PromptSource:
    """Where prompt tokens come from. `word_ids`: token ids that are one whole English word with
    a leading space; sequences of them decode to text that tokenizes back to the same ids, so a
    prompt keeps its length whether it is sent as ids or as text. `corpus_ids`: a tokenized text
    file, from which each prompt takes a window at a seeded offset."""

    word_ids: list[int] = field(default_factory=list)
    corpus_ids: list[int] | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer, corpus: str | None = None) -> PromptSource:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        words = [i for i, s in enumerate(pieces)
                 if s and s[0] in ("Ġ", "▁") and len(s) > 2 and s[1:].isascii() and s[1:].isalpha()]
        if not words:  # an unusual vocabulary: any non-special token will do
            special = set(tokenizer.all_special_ids)
            words = [i for i in range(len(tokenizer)) if i not in special]
        corpus_ids = None
        if corpus is not None:
            try:
                text = Path(corpus).read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise WorkloadError(f"prompt corpus {corpus}: {e}") from None
            corpus_ids = tokenizer.encode(text, add_special_tokens=False)
            if not corpus_ids:
                raise WorkloadError(f"prompt corpus {corpus} has no tokens")
        return cls(words, corpus_ids)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.corpus_ids is not None:
            c = self.corpus_ids
            start = int(rng.integers(len(c)))
            reps = -(-(start + n) // len(c))
            return (c * reps)[start:start + n]
        if not self.word_ids:
            raise WorkloadError("the prompt source has no tokens to draw from")
        return [self.word_ids[i] for i in rng.integers(len(self.word_ids), size=n)]


def build_workload(cfg: WorkloadConfig, prompts: PromptSource) -> list[RequestSpec]:
    """The requests of `cfg`: single requests and first turns sorted by arrival (indices by
    conversation), then follow-up turns (indices after those). Same config and prompt source,
    same requests."""
    cfg.validate()
    trace = load_trace(cfg.trace) if cfg.trace and (cfg.lengths == "trace" or cfg.arrivals == "trace") else None
    seqs = np.random.SeedSequence(cfg.seed).spawn(6)  # spawn(k)[:4] == spawn(4): older workloads unchanged
    n, turns, limit = cfg.num_requests, cfg.turns, cfg.max_model_len
    # One row of lengths per turn, conversation by conversation; the first n arrivals start them.
    rows_cfg = cfg if turns == 1 else replace(cfg, num_requests=n * turns)
    prompt_lens, output_lens, arrivals = make_lengths_and_arrivals(
        rows_cfg, trace, tuple(np.random.default_rng(s) for s in seqs[:3]))
    prompt_rng, think_rng = np.random.default_rng(seqs[3]), np.random.default_rng(seqs[4])
    system = prompts.sample(np.random.default_rng(seqs[5]), cfg.system_prompt_len) if cfg.system_prompt_len else []
    if system and limit is not None:  # the system prompt, a message and an answer fit
        output_lens = np.minimum(output_lens, limit - len(system) - 1)
        prompt_lens = np.clip(np.minimum(prompt_lens, limit - len(system) - output_lens), 1, None)
    firsts: list[RequestSpec] = []
    followups: list[RequestSpec] = []
    for c in range(n):
        previous = None
        for t in range(turns):
            row = c * turns + t
            message = prompts.sample(prompt_rng, int(prompt_lens[row]))
            if previous is None:
                previous = RequestSpec(c, float(arrivals[c]), system + message, int(output_lens[row]))
                firsts.append(previous)
                continue
            think = float(think_rng.exponential(cfg.think_time)) if cfg.think_time > 0 else 0.0
            history = previous.prompt_len + previous.output_len
            if limit is not None and history + len(message) + int(output_lens[row]) > limit:
                break  # the conversation has filled the context
            previous = RequestSpec(n + len(followups), think, message, int(output_lens[row]),
                                   parent=previous.index, history_len=history)
            followups.append(previous)
    return sorted(firsts, key=lambda s: (s.arrival_time, s.index)) + followups


def describe(specs: list[RequestSpec]) -> dict:
    """Length and rate statistics of a workload, for reports. The rate is that of first turns
    (conversations) when the workload has follow-ups."""
    p = np.array([s.prompt_len for s in specs])
    d = np.array([s.output_len for s in specs])
    firsts = [s.arrival_time for s in specs if s.parent is None]
    span = max(firsts) - min(firsts) if firsts else 0.0
    q = lambda a, x: float(np.percentile(a, x))
    return {"num_requests": len(specs), "num_conversations": len(firsts),
            "prompt_len": {"mean": float(p.mean()), "p50": q(p, 50), "p90": q(p, 90), "max": int(p.max())},
            "output_len": {"mean": float(d.mean()), "p50": q(d, 50), "p90": q(d, 90), "max": int(d.max())},
            "pd_ratio_median": float(np.median(p / d)),
            "arrival_span_s": span,
            "offered_qps": (len(firsts) - 1) / span if span > 0 else None}

"""Prometheus metrics, named like vLLM's with a `carpool:` prefix so its dashboards map over
(`vllm:time_to_first_token_seconds` -> `carpool:time_to_first_token_seconds`, ...).

Everything is recorded on the engine thread right after each step (`on_step`), from the
per-request timestamps the engine keeps (arrival, first scheduled, every token, finished), so
the numbers are the engine's own, not the HTTP layer's.

Generation stalls (`carpool:generation_stalls_total`): a stall is counted whenever a running
request's gap between two consecutive output tokens exceeds STALL_FACTOR (5) times the median
iteration time of the last STALL_WINDOW (256) iterations. Those are the user-visible hiccups
that Sarathi-Serve's stall-free batching aims to remove (a long prefill or a preemption
recompute landing between two decodes). No stall is counted before MIN_HISTORY iterations.

Speculative decoding (`--speculative-config`): vLLM's four spec_decode counters, registered only
when the engine speculates (as vLLM registers them only with a speculative config), so a server
without speculation shows no always-zero series. They follow the engine's `SpecDecodeStats`
totals (carpool/spec/acceptance.py): verifications that had drafts, draft tokens scored, drafts
kept, and drafts kept at each position (label `position`, 0 = the first draft). Acceptance rate
is accepted / draft tokens; tokens per verification is 1 + accepted / drafts.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from carpool.outputs import RequestOutput

STALL_FACTOR = 5.0
STALL_WINDOW = 256
MIN_HISTORY = 8

# Buckets as in vLLM's metrics.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

NAMESPACES = ("carpool", "vllm")  # `--metrics-namespace vllm`: vLLM's own names, for its dashboards

disable_created_metrics()  # no `*_created` series beside every counter (vLLM's output has none)


log = logging.getLogger("carpool")

LOG_STATS_INTERVAL = 10.0  # seconds between two stats lines, as vLLM's default


class StatsLog:
    """A line in the log every `interval` seconds while the engine works, as vLLM logs one:
    throughputs, queue lengths, cache use and step times; with --target-tbt-ms, how the
    SLO policy's plans fared (its fit's margin and the steps that ran over the target); with
    --speculative-config, how many of the interval's draft tokens verification kept."""

    def __init__(self, interval: float = LOG_STATS_INTERVAL, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self._since = clock()
        self._durations: list[float] = []
        self._prompt_tokens = self._generated_tokens = 0
        self._prefix: tuple[int, int] | None = None  # the scheduler's prefix-cache queries and hits at the last line
        self._spec: tuple[int, int, int] | None = None  # the engine's drafts, draft tokens, accepted at the last line

    def on_step(self, engine, stats, num_generated: int) -> str | None:
        """Count a step; returns (and logs) the line when one is due. A line covers the time
        since the first step after the last line, so an idle spell does not dilute its rates."""
        sched = engine.scheduler
        speculating = getattr(engine, "spec_config", None) is not None
        if self._prefix is None:
            self._prefix = (sched.prefix_cache_queries, sched.prefix_cache_hits)
        if self._spec is None and speculating:
            self._spec = self._spec_totals(engine)
        if not self._durations:
            self._since = max(self._since, self.clock() - (stats.duration if stats is not None else 0.0))
        if stats is not None:
            self._durations.append(stats.duration)
            self._prompt_tokens += stats.num_prefill_tokens
        self._generated_tokens += num_generated
        now = self.clock()
        elapsed = now - self._since
        if elapsed < self.interval or not self._durations:
            return None
        queries = sched.prefix_cache_queries - self._prefix[0]
        hits = sched.prefix_cache_hits - self._prefix[1]
        d = sorted(self._durations)
        line = (f"{self._prompt_tokens / elapsed:.1f} prompt tokens/s, {self._generated_tokens / elapsed:.1f} "
                f"generated tokens/s, running {len(sched.running)}, waiting {len(sched.waiting)}, KV cache "
                f"{100 * engine.block_manager.usage:.1f}%, prefix cache hits {100 * hits / max(queries, 1):.1f}%; "
                f"{len(d)} steps, p50 {1e3 * d[len(d) // 2]:.1f} ms, max {1e3 * d[-1]:.1f} ms")
        target = getattr(sched, "target_tbt", None)
        if target is not None:
            over = sum(x > target for x in d)
            line += f"; target {1e3 * target:.0f} ms: {over} steps over it, fit margin {sched.cost.margin:.2f}x"
        if speculating:
            totals = self._spec_totals(engine)
            line += "; " + self._spec_line(*(t - seen for t, seen in zip(totals, self._spec)))
            self._spec = totals
        log.info("%s", line)
        self._since, self._durations = now, []
        self._prompt_tokens = self._generated_tokens = 0
        self._prefix = (sched.prefix_cache_queries, sched.prefix_cache_hits)
        return line

    @staticmethod
    def _spec_totals(engine) -> tuple[int, int, int]:
        s = engine.spec_stats
        return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens

    @staticmethod
    def _spec_line(drafts: int, draft_tokens: int, accepted: int) -> str:
        """Acceptance over the interval; tokens per verification counts the token each
        verification samples itself, as vLLM's mean acceptance length does."""
        if not draft_tokens:
            return "spec decode: no draft tokens"
        return (f"spec decode: {100 * accepted / draft_tokens:.1f}% of {draft_tokens} draft tokens accepted, "
                f"{1 + accepted / drafts:.1f} tokens per verification")


def num_speculative_tokens(engine) -> int:
    """The engine's draft length, 0 when it does not speculate: ServerMetrics registers the
    spec_decode counters, one per-position series per draft place, only when it is not 0."""
    spec = engine.spec_config
    return 0 if spec is None else spec.num_speculative_tokens


def buckets_1_2_5(maximum: int) -> list[int]:
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > maximum:
                return out
            out.append(v)
        exp += 1


class ServerMetrics:
    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None,
                 namespace: str = "carpool", stats_log: StatsLog | None = None, num_speculative_tokens: int = 0):
        self.stats_log = stats_log
        if namespace not in NAMESPACES:
            raise ValueError(f"metrics namespace must be one of {NAMESPACES}, not {namespace!r}")
        self.registry = registry or CollectorRegistry()
        r, L, name = self.registry, ["model_name"], model_name
        PREFIX = namespace + ":"

        def gauge(n, doc):
            return Gauge(PREFIX + n, doc, L, registry=r).labels(name)

        def counter(n, doc):
            return Counter(PREFIX + n, doc, L, registry=r).labels(name)

        def hist(n, doc, buckets):
            return Histogram(PREFIX + n, doc, L, buckets=buckets, registry=r).labels(name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc",
                                     "Same as kv_cache_usage_perc (older vLLM name, for old dashboards).")
        self.num_preemptions = counter("num_preemptions", "Cumulative preemptions (recompute).")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache (at first scheduling).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (counted at first token).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.generation_stalls = counter(
            "generation_stalls",
            f"Inter-token gaps longer than {STALL_FACTOR:g}x the median iteration time.")
        self.slo_unreachable_iterations = counter(
            "slo_unreachable_iterations",
            "Iterations whose decodes alone were predicted over --target-tbt-ms (run decode-only).")
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens (prefill + decode) per engine iteration.",
                                     ITERATION_TOKEN_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token (from arrival).", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Time per output token (older vLLM name; same observations as inter_token_latency).",
                         ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds", "First scheduled to finish.", LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt length of finished requests.",
                                          token_buckets)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Output length of finished requests.", token_buckets)
        success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.request_success = {reason: success.labels(name, reason) for reason in self.FINISH_REASONS}

        # As vLLM's cache_config_info: the KV cache's size, so that usage converts to blocks.
        self.cache_config_info = Gauge(PREFIX + "cache_config_info", "KV cache configuration (labels).",
                                       ["num_gpu_blocks", "block_size"], registry=r)

        # Only when the engine speculates (num_speculative_tokens: its config's draft length).
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = None
        self.spec_accepted_per_pos: list = []
        if num_speculative_tokens:
            self.spec_drafts = counter("spec_decode_num_drafts", "Verifications that scored at least one draft.")
            self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens scored by the model.")
            self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                         "Draft tokens kept (equal to the token sampled at their place).")
            per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                              "Draft tokens kept at each position of a draft (0 = the first).",
                              ["model_name", "position"], registry=r)
            self.spec_accepted_per_pos = [per_pos.labels(name, str(i)) for i in range(num_speculative_tokens)]
        self._durations: deque[float] = deque(maxlen=STALL_WINDOW)
        self._seen_preemptions: int | None = None
        self._seen_prefix = (0, 0)  # scheduler's prefix-cache queries and hits already counted
        self._seen_spec = (0, 0, 0, [])  # engine's spec_stats already counted

    # ------------------------------------------------------------ engine thread
    def set_cache_config(self, num_blocks: int, block_size: int) -> None:
        self.cache_config_info.labels(str(num_blocks), str(block_size)).set(1)

    def update_gauges(self, engine) -> None:
        sched = engine.scheduler
        self.num_requests_running.set(len(sched.running))
        self.num_requests_waiting.set(len(sched.waiting))
        usage = engine.block_manager.usage
        self.kv_cache_usage.set(usage)
        self.gpu_cache_usage.set(usage)
        total = sched.num_preemptions
        if self._seen_preemptions is None:
            self._seen_preemptions = 0
        if total > self._seen_preemptions:
            self.num_preemptions.inc(total - self._seen_preemptions)
        self._seen_preemptions = total
        queries, hits = sched.prefix_cache_queries, sched.prefix_cache_hits
        self.prefix_cache_queries.inc(max(0, queries - self._seen_prefix[0]))
        self.prefix_cache_hits.inc(max(0, hits - self._seen_prefix[1]))
        self._seen_prefix = (queries, hits)
        if self.spec_drafts is not None:
            self._update_spec(engine.spec_stats)

    def _update_spec(self, stats) -> None:
        """The spec_decode counters follow the engine's totals, as the prefix-cache ones do."""
        drafts, draft_tokens, accepted, per_pos = self._seen_spec
        self.spec_drafts.inc(max(0, stats.num_drafts - drafts))
        self.spec_draft_tokens.inc(max(0, stats.num_draft_tokens - draft_tokens))
        self.spec_accepted.inc(max(0, stats.num_accepted_tokens - accepted))
        for i, total in enumerate(stats.accepted_per_position[:len(self.spec_accepted_per_pos)]):
            self.spec_accepted_per_pos[i].inc(max(0, total - (per_pos[i] if i < len(per_pos) else 0)))
        self._seen_spec = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                           list(stats.accepted_per_position))

    def stall_threshold(self) -> float | None:
        if len(self._durations) < MIN_HISTORY:
            return None
        return STALL_FACTOR * statistics.median(self._durations)

    def on_step(self, engine, outputs: list[RequestOutput], stats) -> None:
        if stats is not None:
            self._durations.append(stats.duration)
            self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
            if stats.slo_unreachable:
                self.slo_unreachable_iterations.inc()
        threshold = self.stall_threshold()
        for out in outputs:
            self._observe_output(out, threshold)
        self.update_gauges(engine)
        if self.stats_log is not None:
            self.stats_log.on_step(engine, stats, sum(len(out.new_token_ids) for out in outputs))

    def on_abort(self, engine, num_aborted: int) -> None:
        self.request_success["abort"].inc(num_aborted)
        self.update_gauges(engine)

    def _observe_output(self, out: RequestOutput, threshold: float | None) -> None:
        m = out.metrics
        n_new = len(out.new_token_ids)
        if m is None:
            return
        times = m.token_times
        if n_new:
            self.generation_tokens.inc(n_new)
            k = len(times)
            if k == n_new:  # the first token(s) of this request
                self.ttft.observe(times[0] - m.arrival_time)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            for i in range(max(1, k - n_new), k):
                gap = times[i] - times[i - 1]
                self.itl.observe(gap)
                self.tpot.observe(gap)
                if threshold is not None and gap > threshold:
                    self.generation_stalls.inc()
        if out.finished:
            reason = out.finish_reason if out.finish_reason in self.request_success else "error"
            self.request_success[reason].inc()
            end = m.finished_time
            if end is not None:
                self.e2e.observe(end - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                    self.inference_time.observe(end - m.first_scheduled_time)
                    if times:
                        self.prefill_time.observe(times[0] - m.first_scheduled_time)
                if times:
                    self.decode_time.observe(end - times[0])
            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
            self.request_generation_tokens.observe(len(times))  # one time per token, whatever the output kind

    # ------------------------------------------------------------ exposition
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

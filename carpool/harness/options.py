"""Command-line options of the commands that replay a workload: `carpool bench serving` and its
kin (carpool/bench), `carpool simulate` and `carpool fidelity` (carpool/sim). Argparse only, so
`carpool --help` stays light.

Bad values fail in argparse with the option named.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from carpool.harness.workload import ARRIVAL_KINDS, LENGTH_KINDS


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return v
    return parse


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return v


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def int_range(text: str) -> tuple[int, int]:
    """'LO,HI' (or 'LO..HI') with 1 <= LO <= HI."""
    parts = text.replace("..", ",").split(",")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO,HI (two integers)") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return lo, hi


def float_list(text: str) -> list[float]:
    try:
        values = [positive_float(p) for p in text.split(",") if p.strip()]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def int_list(text: str) -> list[int]:
    try:
        values = [positive_int(p.strip()) for p in text.split(",") if p.strip()]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


@dataclass(frozen=True)
class SchedulerSpec:
    """`NAME[:BUDGET][@SLO]`: a policy, optionally its token budget, optionally the one SLO
    (of a capacity run) it is meant for. `sarathi:dynamic`: the budget follows the SLO's TBT
    target (or --target-tbt-ms) instead of a token count."""

    name: str
    budget: int | None = None
    slo: str | None = None
    dynamic: bool = False

    @property
    def label(self) -> str:
        if self.dynamic:
            return f"{self.name}:dynamic"
        return self.name if self.budget is None else f"{self.name}:{self.budget}"


def scheduler_list(text: str) -> list[SchedulerSpec]:
    specs = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        rest, _, slo = item.partition("@")
        name, _, budget = rest.partition(":")
        if not name:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME[:BUDGET|:dynamic][@SLO]")
        b = None
        if budget == "dynamic":
            if name != "sarathi":
                raise argparse.ArgumentTypeError(f"{item!r}: only sarathi has a dynamic (SLO-following) budget")
            specs.append(SchedulerSpec(name, None, slo or None, dynamic=True))
            continue
        if budget:
            try:
                b = positive_int(budget)
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{item!r}: token budget {e}") from None
        specs.append(SchedulerSpec(name, b, slo or None))
    if not specs:
        raise argparse.ArgumentTypeError("empty scheduler list")
    return specs


def str_list(text: str) -> list[str]:
    values = [p.strip() for p in text.split(",") if p.strip()]
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


# Workload presets: each command's defaults. `long-prompt` is arxiv_summarization scaled by 1/4
# (prompts p50 ~680 / max ~1010 tokens, outputs p50 ~42), clipped to 128..1024 and 16..256.
LONG_PROMPT = dict(lengths="trace", trace="arxiv", length_scale=0.25, prompt_range=(128, 1024),
                   output_range=(16, 256), arrivals="poisson")
BURST = dict(lengths="uniform", prompt_range=(64, 1024), output_range=(64, 256), arrivals="burst",
             num_requests=16)


def add_workload_args(p: argparse.ArgumentParser, **defaults) -> None:
    g = p.add_argument_group("workload (deterministic under --seed)")
    g.add_argument("--num-requests", type=positive_int, default=64)
    g.add_argument("--lengths", choices=LENGTH_KINDS, default="fixed",
                   help="request lengths: fixed, uniform or zipf over the ranges, or a trace's rows")
    g.add_argument("--prompt-len", type=positive_int, default=512, help="fixed lengths: prompt tokens")
    g.add_argument("--output-len", type=positive_int, default=128, help="fixed lengths: output tokens")
    g.add_argument("--prompt-range", type=int_range, default=(128, 2048), metavar="LO,HI",
                   help="uniform/zipf range of prompt lengths; trace lengths are clipped to it")
    g.add_argument("--output-range", type=int_range, default=(16, 256), metavar="LO,HI",
                   help="uniform/zipf range of output lengths; trace lengths are clipped to it")
    g.add_argument("--zipf-theta", type=positive_float, default=1.0)
    g.add_argument("--trace", default=None,
                   help="trace CSV: a path, or arxiv / splitwise (shipped in carpool/data/traces; "
                        "$CARPOOL_TRACES_DIR is searched first)")
    g.add_argument("--length-scale", type=positive_float, default=1.0,
                   help="multiply trace prompt AND output lengths by this (keeps P:D), then clip to the ranges")
    g.add_argument("--trace-offset", type=nonneg_int, default=None,
                   help="trace arrivals: first row of the window replayed (default 0)")
    g.add_argument("--arrivals", choices=ARRIVAL_KINDS, default="poisson")
    g.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma arrivals: coefficient of variation of the gaps (1 = Poisson)")
    g.add_argument("--prompt-corpus", default=None,
                   help="text file to cut prompts from (default: random whole-word tokens)")
    g.add_argument("--system-prompt-len", type=nonneg_int, default=0,
                   help="the same N tokens in front of every (first-turn) prompt: a shared system prompt")
    g.add_argument("--turns", type=positive_int, default=1,
                   help="> 1: each request starts a conversation of this many turns; a turn's prompt is the "
                        "previous prompt + its answer + a new message (lengths as for a request)")
    g.add_argument("--think-time", type=nonneg_float, default=1.0,
                   help="mean seconds (exponential) between a turn's answer and the next turn")
    p.set_defaults(**defaults)


def add_driver_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("driver (default: this engine in process; --base-url: any OpenAI-compatible server)")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (streams /v1/completions)")
    g.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="send prompts as token ids (exact lengths) or as text")
    g.add_argument("--no-logprobs", action="store_true",
                   help="do not ask for logprobs (then each non-empty chunk counts as one token)")


def add_output_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--output", default=default, help="folder for JSON, CSV and PNG results")
    p.add_argument("--stall-threshold", type=positive_float, default=None,
                   help="seconds; default 5x the reference (single-request) decode iteration time")
    p.add_argument("--no-plots", action="store_true")
    g = p.add_argument_group("shared-host guard (in process only)")
    g.add_argument("--no-contention-check", action="store_true",
                   help="do not wait for a quiet host nor rerun runs that other processes slowed down")
    g.add_argument("--contention-cores", type=positive_float, default=0.25,
                   help="a run is redone if other processes use more CPU cores than this for 1 s")
    g.add_argument("--retries", type=nonneg_int, default=10, help="reruns of a contended run before giving up")

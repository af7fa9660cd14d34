"""`carpool bench spec`: speculative decoding against the same engine without it, in one process.

Two engines are built from the same settings, one with `speculative_config` and one without, and
each workload runs on both, off then on, `--repeats` times (interleaved, so both see the same host):

- editing: chat prompts asking for one small change to a Python function (EDITS, 15-40 lines
  each), one request at a time, greedy, max_tokens = the function's tokens + 32. What an
  answer copies from its prompt, prompt lookup (n-gram) guesses. Decode tokens/s per request
  counts the tokens after the first over the time from the first token to the last; the total
  is the sum of those tokens over the sum of those times. Target: on >= 2x off.
- random: prompts of distinct random token ids (seeded), so that the prompt offers nothing to
  look up; 128 greedy tokens each, one at a time, under a repetition penalty (1.3 by default):
  plain greedy decoding falls into loops on such prompts ("SpectraSpectraSpectra..."), which
  prompt lookup predicts from the output itself, and this workload is meant to show what
  speculation costs when it cannot help. Target: on >= 0.97x off.
- burst: 16 editing requests added at once; output tokens/s over the burst (first arrival to
  last token) and the largest gap between two tokens of any request. Target: on >= 1.3x off,
  largest gap no worse.
- repeat (not run by default): REPEAT_QUESTIONS, each asked twice in turn, one request at a
  time, greedy, 128 tokens (at most --max-tokens): an answer given before, asked for again (an
  agent's loop, a retried request). Its text is in no prompt, so prompt lookup finds little;
  `--method suffix` drafts from the earlier answers (carpool/spec/suffix.py). No target.
- draft: the target model drafting for itself (`{"method": "draft_model"}`) on the editing
  prompts, and the cost of a verification step scoring 1 + k tokens against a 1-token decode
  step (k = 0..8, the real runner on a synthetic request at the editing prompts' context).

Tokens per step = decode tokens / the steps each request decoded in (summed over requests);
acceptance = drafts kept / drafts scored; the accepted fraction = output tokens that were kept
drafts / output tokens. `same_outputs` is the fraction of requests whose output ids match with
and without speculation. Greedy ids also move with batching alone: a step's token count picks
the kernels, which round differently, and a near-tie in the logits flips. The burst's
`off_same_as_alone` is the same fraction between the engine without speculation and the same
requests run on it one at a time: what batching changes with no speculation at all.

What a draft model of a given cost would give. With k drafts per step, a draft forward costing
c times a target decode step T (c = `draft_cost_ratio`), and a verification step of 1 + k
tokens costing V(k) (V(0) = T, a plain decode step), one step costs k c T + V(k) and yields
tau tokens, against one token per T without speculation:

    speedup(k) = tau(k) / (k c + V(k) / V(0))

With a per-draft acceptance a, independent from draft to draft, tau(k) = (1 - a^(k+1)) / (1 - a)
(the kept drafts plus the token verification samples itself). The JSON gives this for each k,
at c = --draft-cost-ratio (0.1), at the acceptance the self-draft run measured ("projection":
an upper end, a model drafting for itself agrees with itself) and at the editing run's n-gram
acceptance ("projection_at_ngram_acceptance").
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from carpool.config import EngineConfig, SpeculativeConfig
from carpool.harness.metrics import RequestTimeline, summarize, tbts
from carpool.sampling_params import SamplingParams
from carpool.server.startup import startup_objects_frozen

# Of the wordings tried on the embedded SmolLM2-135M-Instruct (the code before or after the
# request, "copy it exactly", "rewrite ... with one change", "keep every other line"), this one
# had its answers copy the most lines of their function and the longest accepted n-gram runs.
EDIT_PROMPT = ("Edit this code: {change}. Return the complete edited code, every other line unchanged.\n\n"
               "```python\n{code}```")
RANDOM_PROMPT_LEN = 256
BURST_SIZE = 16
WORKLOADS = ("editing", "random", "burst", "repeat", "draft")
REPEAT_QUESTIONS = ("Write a Python function that returns the n-th Fibonacci number.",
                    "Explain what a hash table is in three sentences.",
                    "Write a Python function that checks whether a string is a palindrome.",
                    "List five tips for writing readable code.")
REPEAT_TOKENS = 128
TARGETS = {"editing": 2.0, "random": 0.97, "burst": 1.3}


@dataclass(frozen=True)
class Edit:
    change: str
    code: str


EDITS = tuple(Edit(change, code) for change, code in (
    ("change the default `tax_rate` from 0.08 to 0.1", '''def order_total(items, tax_rate=0.08, discount=None):
    """Price of an order: items are (name, unit price, quantity) tuples."""
    total = 0.0
    for name, price, quantity in items:
        if quantity <= 0:
            raise ValueError(f"bad quantity for {name}: {quantity}")
        total += price * quantity
    if discount is not None:
        if discount.endswith("%"):
            total *= 1 - float(discount[:-1]) / 100
        else:
            total -= float(discount)
    total = max(total, 0.0)
    tax = round(total * tax_rate, 2)
    return round(total + tax, 2)
'''),
    ("change the default `width` from 80 to 100", '''def wrap_text(text, width=80, indent=""):
    """Greedy word wrap: each line at most `width` characters, indent included."""
    if width <= len(indent):
        raise ValueError("the indent leaves no room for words")
    lines = []
    current = indent
    for word in text.split():
        if len(current) + len(word) + 1 > width and current.strip():
            lines.append(current.rstrip())
            current = indent
        if current.strip():
            current += " "
        current += word
    if current.strip():
        lines.append(current.rstrip())
    return "\\n".join(lines)
'''),
    ("make it skip lines that start with `#`", '''def parse_config(path):
    """Read `key = value` lines into a dict; values that look like numbers become numbers."""
    config = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            if "=" not in line:
                raise SyntaxError(f"{path}:{number}: expected key = value")
            key, value = line.split("=", 1)
            key, value = key.strip(), value.strip()
            if value.isdigit():
                value = int(value)
            else:
                try:
                    value = float(value)
                except ValueError:
                    pass
            config[key] = value
    return config
'''),
    ("rename the function to `shortest_path`", '''def dijkstra(graph, source):
    """Distances from `source` in a graph given as {node: [(neighbour, weight), ...]}."""
    import heapq

    distances = {source: 0}
    previous = {}
    queue = [(0, source)]
    visited = set()
    while queue:
        distance, node = heapq.heappop(queue)
        if node in visited:
            continue
        visited.add(node)
        for neighbour, weight in graph.get(node, []):
            candidate = distance + weight
            if candidate < distances.get(neighbour, float("inf")):
                distances[neighbour] = candidate
                previous[neighbour] = node
                heapq.heappush(queue, (candidate, neighbour))
    return distances, previous
'''),
    ("change the default `timeout` from 10.0 to 30.0", '''def fetch_with_retries(url, session, timeout=10.0):
    """GET `url`, retrying on connection errors with exponential backoff."""
    import time

    attempts = 3
    delay = 0.5
    last_error = None
    for attempt in range(attempts):
        try:
            response = session.get(url, timeout=timeout)
            if response.status_code >= 500:
                raise ConnectionError(f"server error {response.status_code}")
            response.raise_for_status()
            return response.json()
        except ConnectionError as error:
            last_error = error
            if attempt + 1 < attempts:
                time.sleep(delay)
                delay *= 2
    raise RuntimeError(f"giving up on {url} after {attempts} attempts") from last_error
'''),
    ("rename the class `Stack` to `LifoStack`", '''class Stack:
    """A stack with a size limit."""

    def __init__(self, limit=100):
        self.items = []
        self.limit = limit

    def push(self, item):
        if len(self.items) >= self.limit:
            raise OverflowError("stack is full")
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            return None
        return self.items[-1]

    def __len__(self):
        return len(self.items)
'''),
    ("add \"or\" to the default stop words", '''def word_counts(text, stop_words=("the", "a", "an", "and", "of"), limit=None):
    """How often each word occurs, ignoring case, punctuation and stop words; the most common
    first, ties in alphabetical order, at most `limit` of them."""
    counts = {}
    longest = ""
    for raw in text.split():
        word = raw.strip(".,;:!?\\"'()[]").lower()
        if not word or word in stop_words:
            continue
        counts[word] = counts.get(word, 0) + 1
        if len(word) > len(longest):
            longest = word
    ranked = sorted(counts.items(), key=lambda pair: (-pair[1], pair[0]))
    if limit is not None:
        ranked = ranked[:limit]
    return ranked, longest
'''),
    ("change the default `threshold` from 0.5 to 0.75", '''def classify_scores(scores, labels, threshold=0.5):
    """Split labelled scores into true/false positives and negatives at `threshold`."""
    true_positive = false_positive = true_negative = false_negative = 0
    for score, label in zip(scores, labels):
        predicted = score >= threshold
        if predicted and label:
            true_positive += 1
        elif predicted and not label:
            false_positive += 1
        elif not predicted and label:
            false_negative += 1
        else:
            true_negative += 1
    precision = true_positive / max(true_positive + false_positive, 1)
    recall = true_positive / max(true_positive + false_negative, 1)
    if precision + recall == 0:
        return precision, recall, 0.0
    f1 = 2 * precision * recall / (precision + recall)
    return precision, recall, f1
'''),
))


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def editing_requests(tokenizer, num: int, cap: int | None = None) -> list[tuple[list[int], SamplingParams]]:
    """The first `num` edits (cycling) as chat prompts, greedy, with room for the whole function
    (at most `cap` tokens)."""
    out = []
    for i in range(num):
        edit = EDITS[i % len(EDITS)]
        max_tokens = len(tokenizer.encode(edit.code, add_special_tokens=False)) + 32
        max_tokens = min(max_tokens, cap or max_tokens)
        prompt = chat_ids(tokenizer, EDIT_PROMPT.format(change=edit.change, code=edit.code))
        out.append((prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    return out


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` distinct token ids each (drawn without replacement, so no
    n-gram repeats inside a prompt), from the ids above the special tokens' low range."""
    rng = np.random.default_rng(seed)
    low = min(1000, vocab_size // 4)
    return [(rng.choice(vocab_size - low, size=length, replace=False) + low).tolist() for _ in range(num)]


@dataclass
class Run:
    """What one workload did on one engine: its requests' timelines and outputs, and the steps."""

    timelines: list[RequestTimeline]
    outputs: list[list[int]]
    num_decode_slots: int  # decodes summed over steps: a request decoding in a step is one
    num_draft_tokens: int
    num_accepted_tokens: int


def run(engine, requests: list[tuple[list[int], SamplingParams]], together: bool) -> Run:
    """Run `requests` one at a time, or (together) all added at once, on a cold prefix cache."""
    engine.reset_prefix_cache()
    start = time.monotonic()
    added = []
    for prompt, params in requests:
        added.append(engine.add_request(prompt, params))
        while not together and engine.has_unfinished_requests():
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    steps = [s for s in engine.iteration_stats if s.start_time >= start]
    timelines = [RequestTimeline(r.request_id, r.arrival_time, list(r.token_times), r.num_prompt_tokens,
                                 r.first_scheduled_time, r.finished_time, r.num_preemptions, error=r.error)
                 for r in added]
    return Run(timelines, [list(r.output_token_ids) for r in added],
               sum(s.num_decode_tokens for s in steps),
               sum(s.num_draft_tokens for s in steps), sum(s.num_accepted_tokens for s in steps))


def single_stream_stats(runs: list[Run]) -> dict:
    """Decode tokens/s (first token to last, per request, summed), TTFT, tokens per step and
    acceptance over all `runs` of one mode."""
    timelines = [t for r in runs for t in r.timelines]
    decode_tokens = sum(max(len(t.token_times) - 1, 0) for t in timelines)
    decode_seconds = sum(t.token_times[-1] - t.token_times[0] for t in timelines if t.token_times)
    per_repeat = [sum(max(len(t.token_times) - 1, 0) for t in r.timelines) /
                  max(sum(t.token_times[-1] - t.token_times[0] for t in r.timelines), 1e-9) for r in runs]
    summary, _ = summarize(timelines)
    return {
        "requests": len(timelines), "output_tokens": sum(len(t.token_times) for t in timelines),
        "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,
        "decode_tokens_per_s": decode_tokens / decode_seconds if decode_seconds > 0 else 0.0,
        "decode_tokens_per_s_per_repeat": per_repeat,
        "ttft_s": dataclasses.asdict(summary.ttft),
        **spec_counts(runs, decode_tokens),
    }


def spec_counts(runs: list[Run], decode_tokens: int) -> dict:
    """Tokens per step counts per request: its decode tokens over the steps it decoded in."""
    steps = sum(r.num_decode_slots for r in runs)
    drafts, accepted = sum(r.num_draft_tokens for r in runs), sum(r.num_accepted_tokens for r in runs)
    outputs = sum(len(o) for r in runs for o in r.outputs)
    return {"decode_steps": steps, "tokens_per_step": decode_tokens / steps if steps else None,
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "accepted_fraction_of_output": accepted / outputs if outputs else None}


def burst_stats(runs: list[Run]) -> dict:
    """Output tokens/s over each burst (first arrival to last token), and the largest gap."""
    rates, gaps, ttfts = [], [], []
    for r in runs:
        summary, _ = summarize(r.timelines)
        rates.append(summary.output_tokens_per_s)
        gaps.append(max((g for t in r.timelines for g in tbts(t)), default=0.0))
        ttfts.append(summary.ttft.max)
    output_tokens = sum(len(t.token_times) for r in runs for t in r.timelines)
    decode_tokens = sum(max(len(t.token_times) - 1, 0) for r in runs for t in r.timelines)
    return {"requests": sum(len(r.timelines) for r in runs), "output_tokens": output_tokens,
            "output_tokens_per_s": statistics.fmean(rates), "output_tokens_per_s_per_repeat": rates,
            "largest_gap_s": max(gaps), "largest_gap_s_per_repeat": gaps, "ttft_max_s": max(ttfts),
            **spec_counts(runs, decode_tokens)}


def same_outputs(off: list[Run], on: list[Run]) -> float:
    """Fraction of requests whose output ids match with and without speculation (greedy output
    is the same unless batching changes a near-tie in the logits)."""
    pairs = [(a, b) for x, y in zip(off, on) for a, b in zip(x.outputs, y.outputs)]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else 1.0


def compare(name: str, engines: dict, requests, together: bool, repeats: int, stats,
            alone: Run | None = None) -> dict:
    """`requests` on each engine (off, then on), `repeats` times, and the ratio of their speeds.
    `alone`: the same requests run one at a time on the off engine, to set its outputs against."""
    runs: dict[str, list[Run]] = {mode: [] for mode in engines}
    for _ in range(repeats):
        for mode, engine in engines.items():
            runs[mode].append(run(engine, requests, together))
    result = {mode: stats(r) for mode, r in runs.items()}
    key = "output_tokens_per_s" if together else "decode_tokens_per_s"
    result["ratio"] = result["on"][key] / result["off"][key] if result["off"][key] else None
    result["same_outputs"] = same_outputs(runs["off"], runs["on"])
    if alone is not None:
        result["off_same_as_alone"] = same_outputs([alone] * len(runs["off"]), runs["off"])
    result["target"] = TARGETS.get(name)
    met = None
    if result["target"] is not None:
        met = result["ratio"] is not None and result["ratio"] >= result["target"]
        if together:
            met = met and result["on"]["largest_gap_s"] <= result["off"]["largest_gap_s"]
    result["met"] = met
    return result


def verify_costs(engine, context: int, max_drafts: int, rounds: int) -> list[float]:
    """Median seconds of one step that decodes a request at `context` with k = 0..max_drafts
    drafts (1 + k tokens scored, all their logits computed), through the real runner; the k
    take turns round by round, so that a busy moment of the host does not land on one k."""
    from carpool.harness.synthetic import SyntheticBatches

    batches = SyntheticBatches(engine)
    try:
        request = batches.with_cached_context(context, torch.Generator().manual_seed(0))
        if not engine.block_manager.allocate(request, context + 1 + max_drafts):
            raise ValueError("KV cache too small for the verification timing")
        vocab = engine.model_config.vocab_size
        steps = []
        for k in range(max_drafts + 1):
            steps.append(batches.batch([(request, 1)]))
            steps[-1].set_drafts(0, [(7919 * (i + 1)) % vocab for i in range(k)])
        times: list[list[float]] = [[] for _ in steps]
        for round in range(rounds + 1):  # round 0 warms up
            for k, batch in enumerate(steps):
                t = time.perf_counter()
                engine.runner.execute(batch)
                if round:
                    times[k].append(time.perf_counter() - t)
        return [statistics.median(t) for t in times]
    finally:
        batches.close()


def tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens from a step verifying k drafts, each kept with probability `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def projection(costs: list[float], acceptance: float, draft_cost_ratio: float) -> list[dict]:
    """The module docstring's speedup(k) for each k >= 1 at `acceptance` and `draft_cost_ratio`."""
    rows = []
    for k in range(1, len(costs)):
        tau = tokens_per_step(acceptance, k)
        rows.append({"k": k, "tokens_per_step": tau, "verify_cost_ratio": costs[k] / costs[0],
                     "speedup": tau / (k * draft_cost_ratio + costs[k] / costs[0])})
    return rows


def draft_workload(config: EngineConfig, off_engine, editing, args, ngram_acceptance: float | None) -> dict:
    """The target drafting for itself on the editing stream; verification costs; the projection."""
    result: dict = {}
    prompt_len = round(statistics.fmean(len(p) for p, _ in editing))
    costs = verify_costs(off_engine, prompt_len, 8, max(9, 5 * args.repeats))
    result["verify_context"] = prompt_len
    result["verify_step_s"] = costs
    result["verify_cost_ratio"] = [c / costs[0] for c in costs]
    draft_config = dataclasses.replace(config, speculative_config=SpeculativeConfig(
        method="draft_model", model=config.model, num_speculative_tokens=args.num_speculative_tokens))
    from carpool.engine import LLMEngine

    engine = LLMEngine(draft_config)
    warm_up(engine)
    result["self_draft"] = compare("draft", {"off": off_engine, "on": engine}, editing, False, args.repeats,
                                   single_stream_stats)
    engine.shutdown()
    acceptance, source = result["self_draft"]["on"]["acceptance_rate"], "self_draft (draft_model)"
    if acceptance is None:
        acceptance, source = ngram_acceptance, "editing (ngram)"
    result["projection_acceptance"] = acceptance
    result["projection_acceptance_from"] = source
    result["draft_cost_ratio"] = args.draft_cost_ratio
    result["projection"] = projection(costs, acceptance or 0.0, args.draft_cost_ratio)
    if ngram_acceptance is not None:
        result["ngram_acceptance"] = ngram_acceptance
        result["projection_at_ngram_acceptance"] = projection(costs, ngram_acceptance, args.draft_cost_ratio)
    return result


def warm_up(engine) -> None:
    """One short request, so first-call costs stay out of the measurements."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    request = engine.add_request(chat_ids(engine.tokenizer, EDIT_PROMPT.format(**vars(EDITS[0]))), params)
    while not request.is_finished:
        engine.step()


def proposer_workloads(engines: dict, editing, args) -> dict:
    """The editing, random, burst and repeat workloads that `args.workloads` names, off and on."""
    off, w = engines["off"], {}
    if "editing" in args.workloads:
        w["editing"] = compare("editing", engines, editing, False, args.repeats, single_stream_stats)
    if "random" in args.workloads:
        prompts = random_prompts(off.model_config.vocab_size, args.num_random, RANDOM_PROMPT_LEN, args.workload_seed)
        params = SamplingParams(max_tokens=args.random_tokens, temperature=0.0, ignore_eos=True,
                                repetition_penalty=args.random_repetition_penalty)
        w["random"] = compare("random", engines, [(p, params) for p in prompts], False, args.repeats,
                              single_stream_stats)
        w["random"].update(prompt_len=RANDOM_PROMPT_LEN, seed=args.workload_seed,
                           repetition_penalty=args.random_repetition_penalty)
    if "burst" in args.workloads:
        burst = editing_requests(off.tokenizer, args.burst_size, args.max_tokens)
        alone = run(off, burst, together=False)
        w["burst"] = compare("burst", engines, burst, True, args.repeats, burst_stats, alone)
    if "repeat" in args.workloads:
        params = SamplingParams(max_tokens=min(REPEAT_TOKENS, args.max_tokens or REPEAT_TOKENS), temperature=0.0)
        asked = [(chat_ids(off.tokenizer, q), params) for q in REPEAT_QUESTIONS] * 2
        w["repeat"] = compare("repeat", engines, asked, False, args.repeats, single_stream_stats)
    return w


def run_spec_bench(config: EngineConfig, args) -> dict:
    from carpool.harness.metrics import cpu_name
    from carpool.engine import LLMEngine

    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    started = time.time()
    spec = SpeculativeConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                             prompt_lookup_max=args.prompt_lookup_max)
    engines = {"off": LLMEngine(dataclasses.replace(config, speculative_config=None)),
               "on": LLMEngine(dataclasses.replace(config, speculative_config=spec))}
    for engine in engines.values():
        warm_up(engine)
    off = engines["off"]
    editing = editing_requests(off.tokenizer, args.num_functions, args.max_tokens)
    result: dict = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "model": off.config.model, "dtype": str(off.dtype),
        "num_threads": torch.get_num_threads(), "speculative_config": dataclasses.asdict(spec),
        "repeats": args.repeats, "workloads": {},
    }
    w = result["workloads"]
    with startup_objects_frozen():
        w.update(proposer_workloads(engines, editing, args))
    if "draft" in args.workloads:
        engines.pop("on").shutdown()  # its memory goes to the draft engine
        ngram = w.get("editing", {}).get("on", {}).get("acceptance_rate")
        w["draft"] = draft_workload(config, off, editing, args, ngram)
    for engine in engines.values():
        engine.shutdown()
    result["seconds"] = time.time() - started
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "spec.png")
    print(summary_table(result))
    print(f"wrote {out / 'spec.json'} and {out / 'spec.png'}")
    return result


def speeds(name: str, r: dict) -> tuple[float, float]:
    key = "output_tokens_per_s" if name == "burst" else "decode_tokens_per_s"
    return r["off"][key], r["on"][key]


def summary_table(result: dict) -> str:
    rows = ["| workload | off tok/s | on tok/s | on/off | target | met | tokens/step on | acceptance | "
            "from drafts | largest gap off/on (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    w = dict(result["workloads"])
    if "draft" in w:
        w["draft (self)"] = w.pop("draft")["self_draft"]
    for name, r in w.items():
        off, on = speeds(name, r)
        fmt = lambda x, f: "-" if x is None else format(x, f)
        target = r.get("target")
        gap = (f"{r['off']['largest_gap_s']:.3f} / {r['on']['largest_gap_s']:.3f}"
               if "largest_gap_s" in r["on"] else "-")
        rows.append(f"| {name} | {off:.1f} | {on:.1f} | {fmt(r['ratio'], '.2f')} | "
                    f"{'-' if target is None else ('>= ' + format(target, 'g'))} | "
                    f"{'-' if target is None else ('yes' if r['met'] else 'NO')} | "
                    f"{fmt(r['on']['tokens_per_step'], '.2f')} | {fmt(r['on']['acceptance_rate'], '.2f')} | "
                    f"{fmt(r['on']['accepted_fraction_of_output'], '.2f')} | {gap} |")
    burst = result["workloads"].get("burst", {})
    if "off_same_as_alone" in burst:
        rows.append(f"\nburst outputs identical with and without speculation: {burst['same_outputs']:.0%}; "
                    f"without it, the burst's against the same requests one at a time: {burst['off_same_as_alone']:.0%}")
    if "draft" in result["workloads"]:
        d = result["workloads"]["draft"]
        best = max(d["projection"], key=lambda p: p["speedup"])
        rows.append(f"\ndraft model at {d['draft_cost_ratio']:g}x the target's step cost, acceptance "
                    f"{d['projection_acceptance']:.2f} ({d['projection_acceptance_from']}): best k = {best['k']}, "
                    f"{best['tokens_per_step']:.2f} tokens/step, verify cost {best['verify_cost_ratio']:.2f}x, "
                    f"speedup {best['speedup']:.2f}x")
        if "ngram_acceptance" in d:
            best = max(d["projection_at_ngram_acceptance"], key=lambda p: p["speedup"])
            rows.append(f"  at the n-gram acceptance {d['ngram_acceptance']:.2f}: best k = {best['k']}, "
                        f"{best['tokens_per_step']:.2f} tokens/step, speedup {best['speedup']:.2f}x")
    return "\n".join(rows)


def plot(result: dict, path: Path) -> None:
    from carpool.harness.plots import _plt, _save

    plt = _plt()
    w = dict(result["workloads"])
    draft = w.pop("draft", None)
    if draft is not None:
        w["draft (self)"] = draft["self_draft"]
    fig, axes = plt.subplots(1, 2 if draft else 1, figsize=(11 if draft else 6.5, 4), squeeze=False)
    ax = axes[0][0]
    names = list(w)
    x = np.arange(len(names))
    pairs = [speeds(n, w[n]) for n in names]
    ax.bar(x - 0.2, [p[0] for p in pairs], 0.4, label="speculation off")
    ax.bar(x + 0.2, [p[1] for p in pairs], 0.4, label="speculation on")
    for i, n in enumerate(names):
        if w[n]["ratio"] is not None:
            ax.text(i + 0.2, pairs[i][1], f"{w[n]['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel("output tokens/s (single stream: decode phase)")
    ax.set_title(f"k = {result['speculative_config']['num_speculative_tokens']}, {result['model'].split('/')[-1]}")
    ax.legend(fontsize=8)
    if draft is not None:
        b = axes[0][1]
        ks = [p["k"] for p in draft["projection"]]
        b.plot(range(len(draft["verify_cost_ratio"])), draft["verify_cost_ratio"], "o-",
               label="verify step cost V(k) / V(0)")
        b.plot(ks, [p["speedup"] for p in draft["projection"]], "s-",
               label=f"speedup, draft at {draft['draft_cost_ratio']:g}x, acceptance "
                     f"{draft['projection_acceptance']:.2f}")
        b.set_xlabel("drafts per step k")
        b.axhline(1.0, color="k", lw=0.8)
        b.legend(fontsize=8)
        b.set_title(f"verification at context {draft['verify_context']}")
    _save(fig, path)

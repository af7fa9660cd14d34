"""How long the next iteration will take, learned from the iterations that already ran.

`StepCostModel` is a least-squares fit of step time over a few features of a batch's shape
(tokens, rows, decode contexts, chunk attention), refreshed with every observed step. The
SLO-following Sarathi policy asks it, while it builds a batch, how long the batch would take
with one more prefill chunk. The engine feeds it measured step times and the simulator feeds it
simulated ones, so the same class makes the same choices in both. It starts empty, or seeded
with the predictions of a `CostModel` (`seeded_step_cost`: the engine's --cost-profile, a fit
over the whole steps `carpool profile` measured (cost_profile.py), or a simulated replica's model).

Why these features: on a CPU a step costs a fixed overhead, a per-token GEMM cost, a cost per
decode row (sampling, inputs) and a larger one per prefill chunk (each chunk is its own attention
call per layer, with its block table, mask and gathered prefix), a fixed cost that steps from
SMALL_STEP_TOKENS up pay on top (they leave the fused path), decode attention over each
context (SDPA over gathered blocks pads every row to the longest, hence both the sum and
`decodes x longest`; and a row's attention splits over the threads only so far, so the longest
context costs on its own: without that term a profile's fit, Xeon 480M, put lone decodes at
contexts near 200 12.5% high and past 1000 15.7% low), and chunk attention over each chunk's
query-key pairs. On a GPU the per-token cost is flat up to a few hundred tokens and then linear:
hinges in the token count (`max(0, tokens - k)`) let a fit with non-negative weights bend there.
Non-negative weights also keep the prediction monotone in a chunk's length, which the policy's
search relies on.

The fit, its speeds and margins are numpy over 15 features and the last 512 steps: a refit
every 4 steps took 0.3 ms (best of 7 timings of 200 refits over a full window, Intel Xeon with
AMX), about 75 us a step, under 1% of a 135M decode step (in plain Python the fit alone took
0.29 ms a step, 7%).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from carpool.core.scheduler import ScheduledBatch


@dataclass(frozen=True)
class BatchShape:
    """What a cost model may know about an iteration."""

    prefills: tuple[tuple[int, int], ...] = ()  # (chunk tokens, tokens already cached)
    decode_contexts: tuple[int, ...] = ()  # context length of each decode, its new token included
    num_sampled: int = 0
    num_drafts: int = 0  # speculative tokens scored beside the decodes (carpool/spec)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefills) + len(self.decode_contexts) + self.num_drafts

    @classmethod
    def of(cls, batch: ScheduledBatch) -> BatchShape:
        """The shape of a batch as scheduled (before `commit` advances its requests)."""
        prefills, decodes, sampled = [], [], 0
        for r, n, is_decode, drafts in zip(batch.requests, batch.num_tokens, batch.is_decode, batch.drafts):
            if is_decode:
                decodes.append(r.num_computed_tokens + 1)
            else:
                prefills.append((n, r.num_computed_tokens))
            sampled += r.num_computed_tokens + n - len(drafts) == r.num_tokens
        return cls(tuple(prefills), tuple(decodes), sampled, batch.num_draft_tokens)

    def with_chunk(self, n: int, prefix: int, sampled: bool = False) -> BatchShape:
        return BatchShape(self.prefills + ((n, prefix),), self.decode_contexts, self.num_sampled + sampled,
                          self.num_drafts)


# Token counts where the per-token cost may bend (GPU tiles/waves); see the module docstring.
HINGES = (64, 256, 1024)
# Below this many tokens a step may run another path with its own fixed cost: on CPU the fused
# layers (all layers in one C call) up to 95 tokens, compiled graphs past that (model/paths.py);
# on a GPU, CUDA graphs end at a batch size likewise. A 24-token fused step took 16 ms and a
# 32-token compiled one 33 ms (`carpool bench hybrid`): a jump, not a bend. The scheduler's layer
# may not import the model's, so test_fused_layers pins this to model.paths.FUSED_MAX_TOKENS + 1.
SMALL_STEP_TOKENS = 96
MIN_KIND_STEPS = 8  # steps of a kind (with or without a prefill chunk) that give it its own margin
SPEED_STEPS = 16  # the last this many steps of a kind (half as many chunk steps) give its speed
SMALL_HINGE = 8  # where a small step's per-token cost bends (see FEATURES)
# A draft token costs a token (`tokens`) plus what its own feature learns (its row of attention,
# of the LM head, its verification). A fit that has seen no drafts prices that part at 0, so the
# first drafts are granted and the fit learns their cost from the steps that ran them.
# The last two let small steps bend on their own: on CPU a step of a few tokens streams the
# weights once whatever its rows, and each further row costs more than the one before, so one
# slope under-predicted the single decodes that dominate light load (by 6-8% on Intel Xeon with
# AMX: `carpool fidelity`'s steps.jsonl on the code-completion workload of BENCHMARKS.md
# "Simulator fidelity").
FEATURES = ("fixed", "tokens", *(f"tokens>{h}" for h in HINGES), "decode_rows", "prefill_chunks",
            "decode_context_sum", "decode_context_padded", "decode_context_longest", "chunk_attention",
            f"tokens>={SMALL_STEP_TOKENS}", "drafts", f"tokens {SMALL_HINGE}..{SMALL_STEP_TOKENS}",
            f"tokens up to {SMALL_STEP_TOKENS}")
# Scales that bring each feature near 1 for a typical batch, so the normal equations stay well conditioned.
_SCALE = (1.0, 1e-3, 1e-3, 1e-3, 1e-3, 1e-2, 1e-2, 1e-5, 1e-5, 1e-3, 1e-6, 1.0, 1e-1, 1e-1, 1e-1)


def features(shape: BatchShape) -> list[float]:
    t = shape.num_tokens
    d = shape.decode_contexts
    attn = sum(n * (p + (n + 1) / 2) for n, p in shape.prefills)
    # the small-step slopes saturate rather than drop past SMALL_STEP_TOKENS: every feature stays
    # non-decreasing in a chunk's length, so the prediction does too (the policy's search needs it)
    raw = (1.0, t, *(max(0, t - h) for h in HINGES), len(d), len(shape.prefills), sum(d),
           len(d) * max(d, default=0), max(d, default=0), attn, float(t >= SMALL_STEP_TOKENS),
           shape.num_drafts, min(max(0, t - SMALL_HINGE), SMALL_STEP_TOKENS - SMALL_HINGE), min(t, SMALL_STEP_TOKENS))
    return [x * s for x, s in zip(raw, _SCALE)]


def _medians(a: np.ndarray) -> np.ndarray:
    """Medians along the last axis, by one sort (np.median took 4x as long: half of a refit)."""
    s = np.sort(a, axis=-1)
    m = s.shape[-1]
    return 0.5 * (s[..., (m - 1) // 2] + s[..., m // 2])


def speed_window(chunks: bool) -> int:
    """How many of a kind's last steps give its speed: SPEED_STEPS, half as many for steps with a
    chunk (a burst holds few of those, and each is long)."""
    return SPEED_STEPS // 2 if chunks else SPEED_STEPS


def recent_speed(ratios: np.ndarray, chunks: bool) -> float:
    """A kind's speed from its steps' measured / predicted ratios, oldest first: the median of the
    last `speed_window`; 1 until there are 4."""
    return float(_medians(ratios[-speed_window(chunks):])) if len(ratios) >= 4 else 1.0


def nonnegative_least_squares(ata: np.ndarray, atb: np.ndarray, ridge: float | np.ndarray,
                              free: Sequence[int] | None = None) -> list[float]:
    """min |A w - y|^2 + sum(ridge * w^2) subject to w >= 0, from the normal equations, by an active
    set: solve over the free weights; pin the most negative one to 0 while any is negative; free
    the pinned weight that most lowers the objective while any would. `free`: where to start (the
    last fit's nonzero weights: the set moves little between refits, so a refit is one or two
    solves)."""
    k = len(atb)
    a = ata + np.diag(np.broadcast_to(ridge, (k,)))
    free = list(range(k)) if free is None else sorted(free)
    w = np.zeros(k)
    for _ in range(4 * k):  # an active set can cycle on ties; this is many times what a fit takes
        w = np.zeros(k)
        if free:
            try:
                w[free] = np.linalg.solve(a[np.ix_(free, free)], atb[free])
            except np.linalg.LinAlgError:
                return [0.0] * k
        worst = min(free, key=lambda i: w[i], default=None)
        if worst is not None and w[worst] < 0:
            free.remove(worst)
            continue
        gradient = atb - a @ w  # minus half the objective's gradient: > 0 where w_j should grow
        pinned = [j for j in range(k) if j not in free and gradient[j] > 1e-12 * abs(atb[j]) + 1e-300]
        if not pinned:
            break
        free.append(max(pinned, key=lambda j: gradient[j]))
        free.sort()
    return np.maximum(w, 0.0).tolist()


@dataclass
class StepCostModel:
    """Online fit of step seconds over `features(shape)`.

    decay: each observation's weight shrinks by this factor per later observation (the fit follows
        a machine whose speed drifts; 0.998 ~ the last 500 steps).
    quantile: `upper` scales the fit by this quantile of measured / predicted ratios over the last
        `window` steps, each step counted once per decode row in it (at least once), so a plan
        that keeps `upper` under a target keeps about that share of *token gaps* under it (a P99
        TBT counts a step once per stream it delays; 0.99: under load nearly every step is full;
        with 0.95 a first measured run on this CPU missed its target's P99 by 13%).
        The ratios are taken against the current fit at every refit: ratios kept from the fit of
        their day let a poor early fit hold the margin at its 2x cap for hundreds of steps, and
        the policy then planned 250 ms steps for a 500 ms target; a margin retaken only every 32
        steps lagged the fit, and the simulated SLO budget (Mistral-7B on an A100, strict) then
        put 2% of its token gaps over target and held 3.67 QPS against the fixed 512 budget's 4.56
        (4.36 with the margin retaken at each refit and counted per decode row).
    margin_from: only steps predicted at least this long (seconds) set a margin, once enough of
        them are in the window: a few ms of jitter is 70% of a lone decode and 1% of a full
        step, and a margin of 1.75x from served decodes held full steps to 70% of their target.
        The SLO policy sets it to half its target.
    refit_every, refit_seconds: a solve waits for this many observations and for steps adding up
        to this many seconds since the last. A solve and its margins (numpy over the window) take
        a few tenths of a ms of Python, which after every 4th of a small model's ~5 ms decode steps
        was a few percent of each step; a tenth of a second of steps holds it near 1%, and steps
        of 25 ms or more still refit every 4th.

    Predictions follow the host's speed: the weights remember ~500 steps, but a shared host's
    speed drifts by 10% within minutes, so each kind's prediction is scaled by its recent steps'
    median ratio to the weights (`speed`). Replayed over a served code-completion workload
    (`carpool fidelity`'s steps.jsonl, Intel Xeon with AMX), that took the median one-step-ahead
    error from 5.3-7.0% to 4.0-4.3%, and P90 from 15-17% to 11.5-13%.

    Steps that carry a prefill chunk and steps that do not each get a margin from their own kind
    once `MIN_KIND_STEPS` of it are in the window (its long steps if that many, else all of it),
    and from all steps (the long ones if 16) before that, each step's ratio taken over its
    kind's speed just before it. The fit learns mostly from the many decode steps and can be off
    on the few chunk steps in its own direction: in a 16-request burst with speculation (Intel
    Xeon with AMX) the first burst's chunk steps ran 1.07x their plan (up to 1.32x) while its
    decode steps ran 0.67x, and one margin over both left the chunk steps, which set the largest
    token gap, unguarded.
    """

    decay: float = 0.998
    ridge: float = 1e-6
    quantile: float = 0.99
    window: int = 512
    refit_every: int = 4
    refit_seconds: float = 0.1
    margin_from: float = 0.0
    weights: list[float] = field(default_factory=lambda: [0.0] * len(FEATURES))
    num_observations: int = 0
    max_tokens_seen: int = 0

    def __post_init__(self) -> None:
        k = len(FEATURES)
        self._ata = np.zeros((k, k))
        self._atb = np.zeros(k)
        # The last `window` steps as a ring: features, seconds, decode rows.
        self._recent_x = np.zeros((self.window, k))
        self._recent_y = np.zeros(self.window)
        self._recent_rows = np.zeros(self.window)
        self._recent_chunks = np.zeros(self.window, dtype=bool)  # the step carried a prefill chunk
        self._num_recent = 0
        self._margins = {False: 1.0, True: 1.0}  # by whether a step carries a prefill chunk
        self._speeds = {False: 1.0, True: 1.0}  # likewise
        self._pending, self._pending_seconds = 0, 0.0

    # ------------------------------------------------------------ predictions
    def predict(self, shape: BatchShape) -> float:
        return self._speeds[bool(shape.prefills)] * self.predict_by_weights(shape)

    def predict_by_weights(self, shape: BatchShape) -> float:
        """The weights' prediction alone: the machine's speed over the steps they remember."""
        return sum(w * x for w, x in zip(self.weights, features(shape)))

    def speed(self, chunks: bool = False) -> float:
        """Recent steps of one kind (with a prefill chunk or without) over what the weights
        predict for them: the median of the last SPEED_STEPS (chunk steps: half as many)."""
        return self._speeds[chunks]

    @property
    def margin(self) -> float:
        """The larger of the two kinds' margins (for reports; plans use `upper`)."""
        return max(self._margins.values())

    def margin_for(self, shape: BatchShape) -> float:
        """The `quantile` of recent measured / predicted ratios of steps of this shape's kind
        (with or without a prefill chunk), clamped to [1, 2]."""
        return self._margins[bool(shape.prefills)]

    def upper(self, shape: BatchShape) -> float:
        return self.predict(shape) * self.margin_for(shape)

    @property
    def ready(self) -> bool:
        """Enough steps seen to trust the fit for anything but its trust region."""
        return self.num_observations >= 8

    def trusted_tokens(self, floor: int = 64) -> int:
        """Largest batch (tokens) to plan with: a linear fit is trusted to twice what it saw."""
        return max(floor, 2 * self.max_tokens_seen)

    # ------------------------------------------------------------ learning
    def observe(self, shape: BatchShape, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds > 0) or shape.num_tokens == 0:
            return
        x = features(shape)
        i = self._num_recent % self.window
        self._recent_x[i], self._recent_y[i], self._recent_rows[i] = x, seconds, len(shape.decode_contexts)
        self._recent_chunks[i] = bool(shape.prefills)
        self._num_recent += 1
        self._add(x, seconds, 1.0 / seconds**2)  # relative errors: see _add
        self.num_observations += 1
        self.max_tokens_seen = max(self.max_tokens_seen, shape.num_tokens)
        self._pending += 1
        self._pending_seconds += seconds
        if (self._pending >= self.refit_every and self._pending_seconds >= self.refit_seconds) or not self.ready:
            self.refit()

    def seed(self, predict: Callable[[BatchShape], float], shapes: Iterable[BatchShape], weight: float = 1.0) -> int:
        """Start from a profiled cost model: fit its predictions over `shapes` (each counted as
        `weight` observations; real steps replace them as the decay forgets them)."""
        return self.fit_steps(((shape, predict(shape)) for shape in shapes), weight)

    def fit_steps(self, steps: Iterable[tuple[BatchShape, float]], weight: float = 1.0) -> int:
        """Add (shape, seconds) points at once, each counted as `weight` observations, and solve
        once. Returns how many were usable."""
        n = 0
        for shape, seconds in steps:
            if not (math.isfinite(seconds) and seconds > 0) or shape.num_tokens == 0:
                continue
            self._add(features(shape), seconds, weight / seconds**2)
            self.max_tokens_seen = max(self.max_tokens_seen, shape.num_tokens)
            n += 1
        self.num_observations += n
        self.refit()
        return n

    def _add(self, x: list[float], y: float, weight: float) -> None:
        """One point of the weighted fit. Points are weighted by 1 / seconds^2, so the fit
        minimises relative errors: in absolute terms a 600 ms prefill step would outweigh a
        hundred 4 ms decode steps, which then came out 6-8% high."""
        v = np.asarray(x)
        self._ata *= self.decay
        self._ata += weight * np.outer(v, v)
        self._atb *= self.decay
        self._atb += (weight * y) * v

    def refit(self) -> None:
        """Solve for the weights, then take each kind's speed and margin against them."""
        self._pending, self._pending_seconds = 0, 0.0
        trace = float(np.trace(self._ata))
        if trace <= 0:
            return
        free = [i for i, w in enumerate(self.weights) if w > 0] if any(self.weights) else None
        # The ridge scales with each feature's own weight in the fit (and a floor for features
        # no step has shown, e.g. drafts before any): one ridge over all, a share of the trace,
        # pulled the features a profile shows least toward zero and cost a recovered synthetic
        # cost up to 9.6% on some batches (0.7% this way: tests/sim/test_profile.py).
        ridge = self.ridge * (np.diag(self._ata) + 1e-6 * trace / len(FEATURES))
        self.weights = nonnegative_least_squares(self._ata, self._atb, ridge, free)
        n = min(self._num_recent, self.window)
        if not (self.ready and n >= 16):
            return
        order = np.arange(self._num_recent - n, self._num_recent) % self.window  # oldest first
        predicted = self._recent_x[order] @ np.asarray(self.weights)
        measured, rows, chunks = self._recent_y[order], self._recent_rows[order], self._recent_chunks[order]
        usable = predicted > 0
        # Each step's ratio over its kind's speed just before it: what is left once the host's
        # drift is followed, and what the margin has to cover.
        adjusted = np.full(n, np.nan)
        for kind in (False, True):
            steps = np.flatnonzero(usable & (chunks == kind))
            ratios = measured[steps] / predicted[steps]
            last = speed_window(kind)
            self._speeds[kind] = recent_speed(ratios, kind)
            if len(ratios) > last:
                adjusted[steps[last:]] = ratios[last:] / _medians(sliding_window_view(ratios[:-1], last))
        seen = ~np.isnan(adjusted)
        long = seen & (predicted >= self.margin_from)
        pooled = long if long.sum() >= 16 else seen
        for kind in (False, True):
            of_kind = chunks == kind
            chosen = next((c for c in (long & of_kind, seen & of_kind) if c.sum() >= MIN_KIND_STEPS), pooled)
            if chosen.any():
                self._margins[kind] = self._quantile_ratio(adjusted[chosen], rows[chosen])

    def _quantile_ratio(self, ratios: np.ndarray, rows: np.ndarray) -> float:
        """The `quantile` of the ratios, each counted once per decode row (at least once), in [1, 2]."""
        counts = np.maximum(rows, 1.0)
        order = np.argsort(ratios)
        share = np.cumsum(counts[order]) / counts.sum()
        q = ratios[order][min(int(np.searchsorted(share, self.quantile, side="right")), len(order) - 1)]
        return min(max(float(q), 1.0), 2.0)

    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each raw feature (for reports)."""
        return {name: w * s for name, w, s in zip(FEATURES, self.weights, _SCALE)}


def seed_shapes(max_tokens: int = 2048, max_context: int = 2048) -> list[BatchShape]:
    """Batches that span what serving runs: decode-only batches over counts and contexts, and one
    chunk over lengths and prefixes beside a few decodes."""
    shapes = []
    for d in (1, 4, 16, 32, 64):
        for ctx in (128, 512, 1024, 2048):
            if ctx <= max_context and d <= max_tokens:
                shapes.append(BatchShape(decode_contexts=(ctx,) * d, num_sampled=d))
    for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
        for prefix in (0, 512, 1536):
            for d in (0, 8):
                if n + d <= max_tokens and n + prefix <= max_context:
                    shapes.append(BatchShape(((n, prefix),), (max(prefix, 256),) * d, d))
    return shapes


# ---------------------------------------------------------------- chunk sizes the machine likes

@dataclass(frozen=True)
class ChunkSizes:
    """Chunk lengths to snap to, from a measured sweep of step time over token count.

    On a GPU a GEMM's time is a staircase in its token count (tile and wave quantisation): 264
    tokens cost as much as 384. A smooth fit cannot see that, so a chunk the fit allows is cut back
    to a shorter one that does more tokens per second, when the sweep says one within
    `max_loss` of it does at least `min_gain` better. On a flat sweep (this CPU) nothing snaps."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    max_loss: float = 0.25
    min_gain: float = 0.05

    @classmethod
    def from_sweep(cls, points: Sequence[tuple[int, float]], **kw) -> ChunkSizes:
        pts = sorted((int(n), float(t)) for n, t in points if n > 0 and t > 0)
        if len(pts) < 2:
            raise ValueError("a chunk-size sweep needs at least two (tokens, seconds) points")
        return cls(tuple(n for n, _ in pts), tuple(t for _, t in pts), **kw)

    def time(self, n: int) -> float:
        i = min(max(bisect.bisect_left(self.sizes, n), 1), len(self.sizes) - 1)
        x0, x1, y0, y1 = self.sizes[i - 1], self.sizes[i], self.seconds[i - 1], self.seconds[i]
        if n == x1:
            return y1
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def snap(self, n: int) -> int:
        """The chunk to run in place of `n` tokens (`n` itself unless a measured size does better)."""
        if n < self.sizes[0] or n > self.sizes[-1]:
            return n
        rate = n / self.time(n)
        best, best_rate = n, rate * (1 + self.min_gain)
        lo = bisect.bisect_left(self.sizes, math.ceil(n * (1 - self.max_loss)))
        for m, t in zip(self.sizes[lo:], self.seconds[lo:]):
            if m >= n:
                break
            if m / t > best_rate:
                best, best_rate = m, m / t
        return best

    def slow_sizes(self) -> list[int]:
        """Swept sizes that snap to a smaller one (for reports)."""
        return [n for n in self.sizes if self.snap(n) != n]


# ---------------------------------------------------------------- starting from a cost model

class CostModel(Protocol):
    """Predicts an iteration's time from its shape, without running it: a fit over profiled
    steps (cost_profile.py), the simulator's GPU and formula models (carpool/sim)."""

    num_stages: int

    def stage_time(self, shape: BatchShape, stage: int) -> float:
        """Seconds stage `stage` (of num_stages) is busy with this batch, incl. sending it on."""
        ...


def step_time(cost: CostModel, shape: BatchShape) -> float:
    """A whole step through every pipeline stage (what one engine step measures without PP)."""
    return sum(cost.stage_time(shape, s) for s in range(cost.num_stages))


def chunk_sweep(cost: CostModel, max_tokens: int, step: int = 8) -> list[tuple[int, float]]:
    """Step time of one prompt chunk alone, every `step` tokens up to `max_tokens`: the sweep
    `ChunkSizes` snaps chunks by (tile-quantised GEMMs show as steps in it)."""
    return [(n, step_time(cost, BatchShape(((n, 0),), (), 0))) for n in range(step, max_tokens + 1, step)]


def seeded_step_cost(cost: CostModel, max_tokens: int, max_context: int, seed: bool = True,
                     snap: bool = True) -> tuple[StepCostModel, ChunkSizes | None]:
    """What an SLO-following sarathi starts from when a cost model is at hand (the engine's
    --cost-profile, a simulated replica): the fit seeded with its predictions over
    `seed_shapes`, and the chunk sizes its sweep says run fastest."""
    fit = StepCostModel()
    if seed:
        fit.seed(lambda shape: step_time(cost, shape), seed_shapes(max_tokens, max_context))
    sizes = ChunkSizes.from_sweep(chunk_sweep(cost, max_tokens)) if snap and max_tokens >= 16 else None
    return fit, sizes

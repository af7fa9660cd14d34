"""This machine's step cost as measured by `carpool profile`: the CSV table, and predictions from it.

`ProfiledCostModel` reads the table and predicts the time of a batch from its shape. The engine
seeds its step-time fit from it (`--cost-profile`, see `step_cost.seeded_step_cost`), the
simulator runs on it (`carpool simulate --cost-model profile`), and `carpool profile` writes it
with `Profile`.

Interpolation rather than a fitted black box: the profiles are dense where serving lives
(token counts up to the budget, contexts up to a few thousand), piecewise-linear interpolation
reproduces their kinks (tile and wave quantisation) that a smooth fit would blur, and every
prediction can be traced to two measured points.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from carpool.core.step_cost import BatchShape


def interp1(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear; linear extrapolation from the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class Grid2:
    """Bilinear interpolation over a full grid z[i][j] at (xs[i], ys[j])."""

    xs: list[float]
    ys: list[float]
    z: list[list[float]]

    def __call__(self, x: float, y: float) -> float:
        col = [interp1(self.ys, row, y) for row in self.z]
        return interp1(self.xs, col, x)


PROFILE_COLUMNS = ("op", "x", "y", "seconds")


@dataclass
class ProfiledCostModel:
    """Predicts from `carpool profile` tables of the real runner (whole model, one process):

    linear(tokens)            every non-attention op of all layers, embedding included
    prefill_attn(chunk, prefix)   attention of one prefill chunk, all layers
    decode_attn(batch, context)  batched decode attention, all layers, equal contexts; a real
                              batch is looked up at its longest context, since the CPU kernel
                              pads every row to it (a mean under-predicted mixed batches ~2x)
    decode_step(batch, context)  a whole decode-only forward, where the runner fuses small steps
                              into one call (model/fused_layers.py), equal contexts; a step of
                              up to its largest batch in tokens takes it instead of the parts:
                              there a chunk token costs what a decode at its context does, so
                              a hybrid step is looked up at its token count and longest context
    sample(rows)              LM head + sampling for the rows sampled
    overhead                  per-iteration CPU work outside the model (scheduling, inputs)
    calibration               measured / predicted step time on real engine steps (median)

    The parts are timed one at a time; a whole step runs them interleaved (caches, allocator,
    the other core), which costs more than their sum. `calibration` is that ratio, measured on
    real engine steps when the profile is taken, and scales every prediction.

    Pipeline stages split layers evenly: each stage gets 1/num_stages of the layer-wise terms;
    the last also samples."""

    linear: tuple[list[float], list[float]]
    prefill_attn: Grid2
    decode_attn: Grid2
    sample: tuple[list[float], list[float]]
    overhead: float
    calibration: float = 1.0
    num_stages: int = 1
    source: str = ""
    decode_step: Grid2 | None = None

    def stage_time(self, shape: BatchShape, stage: int) -> float:
        decodes = len(shape.decode_contexts)
        if self.decode_step is not None and 0 < shape.num_tokens <= self.decode_step.xs[-1]:
            contexts = [*shape.decode_contexts, *(p + n for n, p in shape.prefills)]
            t = self.decode_step(shape.num_tokens, max(contexts))
        else:
            t = interp1(*self.linear, shape.num_tokens) if shape.num_tokens else 0.0
            t += sum(self.prefill_attn(n, p) for n, p in shape.prefills)
            if decodes:
                t += self.decode_attn(decodes, max(shape.decode_contexts))
        t /= self.num_stages
        if stage == self.num_stages - 1:
            t += (interp1(*self.sample, shape.num_sampled) if shape.num_sampled else 0.0) + self.overhead
        return max(t * self.calibration, 0.0)

    @classmethod
    def load(cls, path: str | Path, num_stages: int = 1) -> ProfiledCostModel:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"profile {path} not found; create it with `carpool profile --output {path}`")
        rows: dict[str, list[tuple[float, float, float]]] = {}
        with path.open() as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != PROFILE_COLUMNS:
                raise ValueError(f"{path}: expected columns {','.join(PROFILE_COLUMNS)}, got {reader.fieldnames}")
            for line, row in enumerate(reader, start=2):
                try:
                    x, y, s = float(row["x"]), float(row["y"] or 0), float(row["seconds"])
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{line}: not a number in {row}") from e
                if not (math.isfinite(s) and s >= 0):
                    raise ValueError(f"{path}:{line}: bad time {row['seconds']!r}")
                rows.setdefault(row["op"], []).append((x, y, s))
        missing = {"linear", "prefill_attn", "decode_attn", "sample", "overhead"} - rows.keys()
        if missing:
            raise ValueError(f"{path}: no rows for {', '.join(sorted(missing))}")

        def curve(op):
            pts = sorted((x, s) for x, _, s in rows[op])
            return [p[0] for p in pts], [p[1] for p in pts]

        def grid(op):
            xs = sorted({x for x, _, _ in rows[op]})
            ys = sorted({y for _, y, _ in rows[op]})
            table = {(x, y): s for x, y, s in rows[op]}
            if len(table) != len(xs) * len(ys):
                raise ValueError(f"{path}: {op} is not a full grid over its x and y values")
            return Grid2(xs, ys, [[table[(x, y)] for y in ys] for x in xs])

        calibration = rows["calibration"][0][2] if "calibration" in rows else 1.0
        return cls(curve("linear"), grid("prefill_attn"), grid("decode_attn"), curve("sample"),
                   rows["overhead"][0][2], calibration, num_stages, source=str(path),
                   decode_step=grid("decode_step") if "decode_step" in rows else None)


@dataclass
class Profile:
    """Rows being collected by `carpool profile`."""

    rows: list[tuple[str, float, float, float]] = field(default_factory=list)

    def add(self, op: str, x: float, y: float, seconds: float) -> None:
        self.rows.append((op, x, y, seconds))

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(PROFILE_COLUMNS)
            w.writerows(self.rows)

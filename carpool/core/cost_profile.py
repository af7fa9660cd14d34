"""This machine's step cost, as `carpool profile` measured it: whole engine steps, and a fit over them.

`carpool profile` (sim/profile.py) has the engine serve designed workloads and records every
step it ran: the batch's shape and the step's measured time, which holds all the per-step work
the engine does (scheduling, the forward down whichever path the runner picks for that many
tokens, the LM head, sampling, detokenizing and stop checks). `FittedCostModel.load` fits the
step-time model the SLO policy also learns online (step_cost.StepCostModel) to those steps at
once, every step weighted alike, and predicts from it. The engine seeds its own fit from it
(`--cost-profile`, see `step_cost.seeded_step_cost`), the simulator runs on it (`carpool
simulate --cost-model profile`), and `carpool fidelity` checks it against real runs.

Why whole steps: an earlier profile timed the parts one at a time (the linear layers with a
stand-in for attention, attention alone, the LM head) and scaled their sum by one calibration
factor for every shape. The parts ran down other paths than serving runs (the stand-in forced
the eager layers) and the factor, taken on one workload, mis-scaled the others: 0.72 on Intel
Xeon with AMX, which left a workload's decode steps 21% short and its prefill steps 34% short
(BENCHMARKS.md "Simulator fidelity").
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from carpool.core.step_cost import BatchShape, StepCostModel

PROFILE_FORMAT = "carpool-profile/2"


@dataclass
class Profile:
    """Steps measured by `carpool profile`: (shape, seconds), and where they were measured."""

    steps: list[tuple[BatchShape, float]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # cpu, model, threads, ...: for readers, not for fitting

    def add(self, shape: BatchShape, seconds: float) -> None:
        self.steps.append((shape, seconds))

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        steps = [{"prefills": [list(c) for c in s.prefills], "decode_contexts": list(s.decode_contexts),
                  "num_sampled": s.num_sampled, "num_drafts": s.num_drafts, "seconds": t} for s, t in self.steps]
        path.write_text(json.dumps({"format": PROFILE_FORMAT, "meta": self.meta, "steps": steps}, indent=None))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"profile {path} not found; create it with `carpool profile --output {path}`")
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a carpool profile ({e}); `carpool profile` writes one") from e
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path}: not a {PROFILE_FORMAT} profile; take a new one with `carpool profile`")
        profile = cls(meta=data.get("meta") or {})
        for i, step in enumerate(data.get("steps") or []):
            try:
                shape = BatchShape(tuple((int(n), int(p)) for n, p in step["prefills"]),
                                   tuple(int(c) for c in step["decode_contexts"]), int(step["num_sampled"]),
                                   int(step.get("num_drafts", 0)))
                seconds = float(step["seconds"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: step {i} is malformed: {step!r}") from e
            if not (math.isfinite(seconds) and seconds > 0) or shape.num_tokens == 0:
                raise ValueError(f"{path}: step {i} has no tokens or a bad time {seconds!r}")
            profile.add(shape, seconds)
        if not profile.steps:
            raise ValueError(f"{path}: holds no steps")
        return profile


@dataclass
class FittedCostModel:
    """A `StepCostModel` frozen as a cost model: fitted to a profile's steps (`load`), or taken
    as it stood after a real run (`carpool fidelity`). It predicts by the weights alone, not at
    the speed of the host's last few steps, which a simulated run has no reason to keep. Layers
    split evenly over pipeline stages."""

    fit: StepCostModel
    num_stages: int = 1
    source: str = ""
    scale: float = 1.0  # times the weights' prediction (see from_profile)
    residuals: tuple[float, ...] = ()  # each profiled step's measured / predicted time, in step order

    def stage_time(self, shape: BatchShape, stage: int) -> float:
        return max(self.scale * self.fit.predict_by_weights(shape), 0.0) / self.num_stages

    @classmethod
    def from_profile(cls, profile: Profile, num_stages: int = 1, source: str = "") -> FittedCostModel:
        fit = StepCostModel(decay=1.0)  # a profile's steps all count: none is older than another
        fit.fit_steps(profile.steps)
        return cls.from_fit(fit, profile.steps, num_stages, source)

    @classmethod
    def from_fit(cls, fit: StepCostModel, steps: list[tuple[BatchShape, float]], num_stages: int = 1,
                 source: str = "") -> FittedCostModel:
        """`fit` frozen, scaled to the median of `steps` (those it learnt from). The fit minimises
        relative errors, which on noisy steps comes out low (a step 20% slow counts for less than
        one 20% fast): on Intel Xeon with AMX the median profiled step ran 1.034x its fit, and
        after a served run (Xeon 480M) the median step ran 1.05x the online fit's weights. The
        model is scaled by that median, and its residuals by its inverse."""
        ratios = [seconds / predicted for shape, seconds in steps if (predicted := fit.predict_by_weights(shape)) > 0]
        scale = statistics.median(ratios) if ratios else 1.0
        return cls(fit, num_stages, source, scale, tuple(r / scale for r in ratios))

    @classmethod
    def load(cls, path: str | Path, num_stages: int = 1) -> FittedCostModel:
        return cls.from_profile(Profile.load(path), num_stages, source=str(path))

"""The simulator's cost models beside the profiled and GPU ones.

A cost model (`carpool.core.step_cost.CostModel`) sees the shape of a scheduled batch (prefill
chunks with their cached prefixes, decodes with their contexts, rows sampled) and predicts the
time of one pipeline stage. The simulator runs on any of:

- `FormulaCostModel`: a known closed form, for tests that check timelines by hand.
- `FittedCostModel` (carpool/core/cost_profile.py): the step-time fit over whole engine steps
  measured on this machine by `carpool profile`, or learned during a real run (`carpool fidelity`).
- `GpuCostModel` (gpu.py): operator timings measured on A100/H100 plus roofline attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.core.step_cost import BatchShape


@dataclass
class FormulaCostModel:
    """time = fixed + per_token * tokens + per_context * (sum of attended contexts), split evenly
    over stages; the last stage adds per_sample * rows sampled."""

    fixed: float = 0.01
    per_token: float = 0.001
    per_context: float = 0.0
    per_sample: float = 0.0
    num_stages: int = 1

    def stage_time(self, shape: BatchShape, stage: int) -> float:
        context = sum(c for c in shape.decode_contexts) + sum(n * (p + n) for n, p in shape.prefills)
        t = (self.fixed + self.per_token * shape.num_tokens + self.per_context * context) / self.num_stages
        return t + (self.per_sample * shape.num_sampled if stage == self.num_stages - 1 else 0.0)

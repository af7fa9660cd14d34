"""Which rank holds which shard of the model.

Rank r is tensor-parallel rank `r % tp` of pipeline stage `pp - 1 - r // tp`. So rank 0, the
driver (scheduler, block manager, sampler), holds the *last* stage and samples from the logits it
gathers itself, and the TP ranks of one stage are consecutive (one host under torchrun, where
each host runs a contiguous block of ranks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage(self, rank: int) -> int:
        return self.pipeline_parallel_size - 1 - rank // self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def rank(self, stage: int, tp_rank: int) -> int:
        return (self.pipeline_parallel_size - 1 - stage) * self.tensor_parallel_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, t) for t in range(self.tensor_parallel_size)]

    def layer_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """Contiguous [first, last) layers per stage; earlier stages take the remainder, since the
        last stage also runs the LM head and the driver."""
        pp = self.pipeline_parallel_size
        if num_layers < pp:
            raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages")
        base, extra = divmod(num_layers, pp)
        ranges, first = [], 0
        for s in range(pp):
            last = first + base + (1 if s < extra else 0)
            ranges.append((first, last))
            first = last
        return ranges

    def describe(self, rank: int) -> str:
        return f"rank {rank} (pipeline stage {self.stage(rank)}, tensor rank {self.tp_rank(rank)})"

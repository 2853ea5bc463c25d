"""The learning-rate schedule as a function of the run's optimizer step: one definition for train.py and the gate.

The factor multiplies the base learning rate after `step` optimizer steps, whatever the number of processes,
gradient accumulation or resume: train.py steps the scheduler exactly once per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch


@dataclass(frozen=True)
class Schedule:
    kind: str  # cosine | linear | constant
    total_steps: int
    warmup_steps: int
    base_lr: float

    @classmethod
    def for_run(cls, kind: str, total_steps: int, warmup_ratio: float, base_lr: float) -> "Schedule":
        return cls(kind, total_steps, int(warmup_ratio * total_steps), base_lr)

    def lr_at(self, step: int) -> float:
        """The learning rate in force after `step` optimizer steps (step 0: before the first)."""
        return self.base_lr * lr_factor(step, self.kind, self.total_steps, self.warmup_steps)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_factor, kind=self.kind, total_steps=self.total_steps, warmup_steps=self.warmup_steps)
        )


def lr_factor(step: int, kind: str, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine or linear decay to 0 at `total_steps` (constant: 1)."""
    if kind == "constant":
        return 1.0
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown scheduler {kind!r} (cosine, linear or constant)")

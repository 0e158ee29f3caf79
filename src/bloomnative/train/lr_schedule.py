"""Megatron's learning-rate schedule: linear warm-up, then cosine or linear decay to min_lr,
then constant at min_lr. Counted in steps, or in consumed samples (the form to use with
batch-size rampup, where steps and samples are not proportional)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bloomnative.config import LRSchedulerConfig, OptimizerConfig


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup: int
    decay_end: int
    style: str
    by_samples: bool

    @classmethod
    def from_config(
        cls, sched: LRSchedulerConfig, opt: OptimizerConfig, total_steps: int
    ) -> LRSchedule:
        by_samples = sched.warmup_samples > 0 or sched.decay_samples > 0
        if by_samples:
            warmup, decay_end = sched.warmup_samples, sched.decay_samples
            if decay_end <= 0:
                raise ValueError("lr_scheduler.decay_samples must be set with warmup_samples")
        else:
            warmup, decay_end = sched.warmup_steps, sched.decay_steps or total_steps
        return cls(opt.lr, opt.min_lr, warmup, decay_end, sched.decay_style, by_samples)

    def __call__(self, step: int, consumed_samples: int) -> float:
        """Learning rate for optimizer step `step` (1-based) having consumed `consumed_samples`
        samples before it."""
        t = consumed_samples if self.by_samples else step
        if self.warmup > 0 and t <= self.warmup:
            return self.lr * t / self.warmup
        if self.style == "constant":
            return self.lr
        if t >= self.decay_end:
            return self.min_lr
        progress = (t - self.warmup) / max(1, self.decay_end - self.warmup)
        if self.style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

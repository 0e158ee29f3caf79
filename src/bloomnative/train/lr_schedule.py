"""Megatron's learning-rate schedule (megatron.core's OptimizerParamScheduler): linear warm-up
from 0, then cosine or linear decay to min_lr, then constant at min_lr.

Like Megatron, the schedule's clock is the number of samples of the steps applied so far: the
learning rate of a step is the schedule at the samples of the steps before it (so the first
step's is 0 under warm-up), and a step skipped for a non-finite loss or gradient does not move
the clock. A schedule given in steps is converted at global_batch_size samples per step, which
is exact without batch-size rampup; with rampup, warmup_samples and decay_samples give the
recipe exactly.

The clock lives on the device and the learning rate is computed there, so the step loop never
waits for the device to learn whether a step was skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bloomnative.config import LRSchedulerConfig, OptimizerConfig


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int
    style: str

    @classmethod
    def from_config(
        cls,
        sched: LRSchedulerConfig,
        opt: OptimizerConfig,
        total_steps: int,
        global_batch_size: int,
    ) -> LRSchedule:
        """The configured schedule in samples (config.validate has checked the keys)."""
        if sched.warmup_samples or sched.decay_samples:
            warmup, decay = sched.warmup_samples, sched.decay_samples
        else:
            warmup = sched.warmup_steps * global_batch_size
            decay = (sched.decay_steps or total_steps) * global_batch_size
        return cls(opt.lr, opt.min_lr, warmup, decay, sched.decay_style)

    def __call__(self, applied_samples: torch.Tensor | int) -> torch.Tensor:
        """Learning rate (float64, on the clock's device) after `applied_samples` samples of
        applied steps."""
        t = torch.as_tensor(applied_samples, dtype=torch.float64)
        if self.style == "constant":
            decayed = torch.full_like(t, self.lr)
        else:
            span = max(self.decay_samples - self.warmup_samples, 1)
            ratio = ((t - self.warmup_samples) / span).clamp(0.0, 1.0)
            if self.style == "linear":
                coeff = 1.0 - ratio
            else:
                coeff = 0.5 * (torch.cos(math.pi * ratio) + 1.0)
            decayed = self.min_lr + coeff * (self.lr - self.min_lr)
        if not self.warmup_samples:
            return decayed
        warm = self.lr * t / self.warmup_samples
        return torch.where(t <= self.warmup_samples, warm, decayed)


class LRClock:
    """The schedule's clock: samples of the applied steps (a skipped step does not count), kept
    on the device because only the device knows whether a step was skipped."""

    def __init__(self, schedule: LRSchedule, device: torch.device):
        self.schedule = schedule
        self.applied_samples = torch.zeros((), dtype=torch.int64, device=device)

    def lr(self) -> torch.Tensor:
        """The learning rate of the next step (a 0-d float64 tensor on the device)."""
        return self.schedule(self.applied_samples)

    def advance(self, applied: torch.Tensor, samples: int) -> None:
        """Counts a step of `samples` samples if `applied` (a 0-d 0/1 tensor on the device)."""
        self.applied_samples += applied * samples

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"applied_samples": self.applied_samples}

    def load_state_dict(self, state: dict) -> None:
        self.applied_samples.fill_(int(state["applied_samples"]))

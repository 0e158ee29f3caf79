"""Batch-size rampup, as Megatron's ``RampupBatchsizeNumMicroBatches`` computes it."""

from __future__ import annotations

from dataclasses import dataclass


def rampup_batch_size(
    consumed_samples: int,
    start: int,
    increment: int,
    ramp_samples: int,
    global_batch_size: int,
) -> int:
    """The global batch size of the step that begins after ``consumed_samples`` samples.

    The batch starts at ``start`` and grows by ``increment`` every
    ``ramp_samples / ((global_batch_size - start) / increment)`` samples until it reaches
    ``global_batch_size`` (BLOOM-176B: 192 -> 2048 by 16 over 9,765,625 samples).
    """
    if start <= 0 or increment <= 0:
        raise ValueError(
            f"batch-size rampup needs a positive start and increment, got start={start} "
            f"increment={increment}"
        )
    if start > global_batch_size or (global_batch_size - start) % increment:
        raise ValueError(
            f"batch-size rampup from {start} by {increment} must land exactly on the global "
            f"batch size {global_batch_size}: (global_batch_size - start) must be a "
            "non-negative multiple of increment"
        )
    num_increments = (global_batch_size - start) // increment
    if num_increments == 0 or ramp_samples <= 0 or consumed_samples > ramp_samples:
        return global_batch_size
    samples_per_increment = ramp_samples / num_increments
    steps = int(consumed_samples / samples_per_increment)
    return min(start + steps * increment, global_batch_size)


def rampup_sizes(start: int, increment: int, global_batch_size: int) -> list[int]:
    """Every global batch size a rampup steps through: start, start + increment, ...,
    global_batch_size."""
    return list(range(start, global_batch_size + 1, increment))


@dataclass(frozen=True)
class BatchSizeSchedule:
    """The global batch size of every step, as a function of the samples consumed before it:
    `global_batch_size` throughout, or Megatron's rampup to it."""

    global_batch_size: int
    rampup: tuple[int, int, int] | None = None
    """(start, increment, samples), as `training.rampup_batch_size` gives them; None: no rampup."""

    def __call__(self, consumed_samples: int) -> int:
        """The global batch size of the step that begins after `consumed_samples` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        return rampup_batch_size(
            consumed_samples, start, increment, samples, self.global_batch_size
        )

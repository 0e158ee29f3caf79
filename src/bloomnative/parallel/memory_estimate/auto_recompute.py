"""`activation_checkpoint.mode = "auto"`: the least recomputation the planner says fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from bloomnative.config import Config
from bloomnative.model.args import BloomArgs
from bloomnative.parallel.memory_estimate.from_config import (
    layout_from_config,
    workload_from_config,
)
from bloomnative.parallel.memory_estimate.inputs import GiB, Layout, Overhead, PlanError, Workload
from bloomnative.parallel.memory_estimate.rank_estimate import Plan
from bloomnative.parallel.memory_estimate.search import least_recompute_that_fits


@dataclass(frozen=True)
class RecomputeChoice:
    """What the planner chose, and the memory it predicts for the worst rank."""

    mode: str
    every: int
    predicted_device_gib: float
    predicted_allocated_gib: float
    capacity_gib: float

    def describe(self) -> str:
        setting = f"selective every {self.every}" if self.mode == "selective" else self.mode
        return (
            f"activation checkpointing chosen by the planner: {setting} (predicted "
            f"{self.predicted_device_gib:.1f} of {self.capacity_gib:.1f} GiB per device)"
        )


def least_recompute_or_raise(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    capacity_bytes: int,
    overhead: Overhead,
    device_type: str,
) -> tuple[Workload, Plan]:
    """`least_recompute_that_fits`, or a PlanError saying what to change when even full
    recomputation does not fit."""
    found = least_recompute_that_fits(args, layout, workload, capacity_bytes, overhead, device_type)
    if found is None:
        raise PlanError(
            f'activation_checkpoint.mode = "auto": even full recomputation does not fit in '
            f"{capacity_bytes / GiB:.1f} GiB per device; lower training.micro_batch_size, "
            f"shard more (parallelism.dp_shard, tp, pp) or turn on model.fused_loss"
        )
    return found


def choose_recompute(
    config: Config,
    args: BloomArgs,
    world_size: int,
    device_type: str,
    capacity_bytes: int,
) -> RecomputeChoice:
    """The activation checkpointing with the least recomputation whose worst rank fits in
    `capacity_bytes` for the run `config` describes on `world_size` devices (the default
    framework overhead on CUDA, none on CPU)."""
    layout = layout_from_config(config.parallelism, world_size)
    workload = dataclasses.replace(
        workload_from_config(config, layout, device_type), recompute="none", recompute_every=1
    )
    overhead = Overhead() if device_type == "cuda" else Overhead.none()
    chosen, plan = least_recompute_or_raise(
        args, layout, workload, capacity_bytes, overhead, device_type
    )
    return RecomputeChoice(
        mode=chosen.recompute,
        every=chosen.recompute_every,
        predicted_device_gib=plan.worst.device_bytes / GiB,
        predicted_allocated_gib=plan.worst.allocated_peak / GiB,
        capacity_gib=capacity_bytes / GiB,
    )


def auto_recompute(
    config: Config,
    args: BloomArgs,
    world_size: int,
    device_type: str,
    device_memory: Callable[[], int],
) -> RecomputeChoice | None:
    """What `activation_checkpoint.mode = "auto"` stands for: the planner's least recomputation
    within memory_budget_gib or, without one, `device_memory()` (the smallest device of the job;
    only called on CUDA). None when the mode is not "auto", or on CPU without a budget (no
    recomputation). Raises PlanError when even full recomputation does not fit."""
    ac = config.activation_checkpoint
    if ac.mode != "auto":
        return None
    if ac.memory_budget_gib:
        capacity = int(ac.memory_budget_gib * GiB)
    elif device_type == "cuda":
        capacity = device_memory()
    else:
        return None
    return choose_recompute(config, args, world_size, device_type, capacity)


def with_recompute(config: Config, choice: RecomputeChoice | None) -> Config:
    """A copy of `config` whose activation checkpointing is the resolved `choice` ("none" for an
    "auto" left without one); `config` itself is not changed."""
    ac = config.activation_checkpoint
    if ac.mode != "auto":
        return config
    mode, every = (choice.mode, choice.every) if choice else ("none", ac.every)
    resolved = dataclasses.replace(ac, mode=mode, every=every)
    return dataclasses.replace(config, activation_checkpoint=resolved)

"""Searches over the estimate: the largest micro batch that fits, and the least activation
checkpointing that fits."""

from __future__ import annotations

import dataclasses

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.dims import LayoutError
from bloomnative.parallel.layout_check import check_pipeline_microbatches
from bloomnative.parallel.memory_estimate.inputs import Layout, Overhead, Workload
from bloomnative.parallel.memory_estimate.rank_estimate import Plan, estimate
from bloomnative.parallel.memory_estimate.recompute import is_checkpointed, recompute_options


def largest_fitting_micro_batch(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    device_bytes: int,
    local_batch: int,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> tuple[int, Plan | None]:
    """The largest micro batch dividing `local_batch` (samples per data-parallel rank per step)
    whose worst rank fits in `device_bytes`, and its plan; (0, None) if none fits."""
    best: tuple[int, Plan | None] = (0, None)
    for micro in range(1, local_batch + 1):
        if local_batch % micro:
            continue
        try:
            check_pipeline_microbatches(local_batch // micro, layout.pp, layout.pp_schedule)
        except LayoutError:
            continue
        candidate = dataclasses.replace(
            workload, micro_batch=micro, microbatches=local_batch // micro
        )
        plan = estimate(args, layout, candidate, overhead, device_type)
        if plan.worst.device_bytes <= device_bytes:
            best = (micro, plan)
    return best


def least_recompute_that_fits(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    device_bytes: int,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> tuple[Workload, Plan] | None:
    """The activation-checkpointing setting with the least recomputation that fits: recompute
    costs a forward per checkpointed block, so fewer checkpointed blocks is faster."""
    seen_counts = set()
    for mode, every in recompute_options(args.n_layer):
        candidate = dataclasses.replace(workload, recompute=mode, recompute_every=max(every, 1))
        checkpointed = sum(is_checkpointed(i, candidate) for i in range(args.n_layer))
        if checkpointed in seen_counts:
            continue  # same blocks checkpointed as a cheaper option already tried
        seen_counts.add(checkpointed)
        plan = estimate(args, layout, candidate, overhead, device_type)
        if plan.worst.device_bytes <= device_bytes:
            return candidate, plan
    return None

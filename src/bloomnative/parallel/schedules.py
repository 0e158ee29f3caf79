"""Facts about the pipeline schedules, in one place: their names, which run several stages per
rank or in rounds, how many blocks each stage gets and which rank runs which stage. The
pipeline (parallel/pipeline.py), the layout checks (parallel/layout_check.py) and the memory
planner read them here; none of this builds anything."""

from __future__ import annotations

import typing
from collections.abc import Sequence

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from bloomnative.config import PipelineSchedule

SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)


def is_multi_stage(schedule: str) -> bool:
    """Whether the schedule runs several stages per rank."""
    return issubclass(get_schedule_class(schedule), PipelineScheduleMulti)


def is_interleaved(schedule: str) -> bool:
    """Whether the schedule runs its micro batches in rounds of pp (torch's looped schedules),
    which needs a micro-batch count divisible by the number of rounds."""
    return schedule in ("Interleaved1F1B", "InterleavedZeroBubble")


def stage_layer_counts(
    n_layer: int,
    num_stages: int,
    embedding_as_layer: bool,
    explicit: Sequence[int] | None = None,
) -> list[int]:
    """Blocks per stage. BLOOM balanced by counting the embedding and the head as one layer
    each (70 blocks on 12 stages: [5, 6 x 10, 5]); a remainder goes to the middle stages.
    `layout_check.check_pipeline_split` has checked the split is possible."""
    if explicit:
        return list(explicit)
    extra = 2 if embedding_as_layer and num_stages > 1 else 0
    units = n_layer + extra
    base, rem = divmod(units, num_stages)
    counts = [base] * num_stages
    middle_first = sorted(range(num_stages), key=lambda s: abs(s - (num_stages - 1) / 2))
    for s in middle_first[:rem]:
        counts[s] += 1
    if extra:
        counts[0] -= 1
        counts[-1] -= 1
    return counts


def stage_ids_of_rank(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Loop placement (rank r holds r, r + pp, ...) or V placement for ZBV (r and 2pp-1-r)."""
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def stage_owner(stage_id: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs `stage_id` (inverse of `stage_ids_of_rank`)."""
    if schedule == "ZBVZeroBubble":
        return stage_id if stage_id < pp else 2 * pp - 1 - stage_id
    return stage_id % pp

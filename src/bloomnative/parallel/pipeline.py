"""Pipeline parallelism with torch.distributed.pipelining.

A stage is a deep copy of the (meta-device) model with the entries it does not own removed: the
first stage keeps the embedding, the last keeps the final norm and the head, which holds its own
copy of the tied embedding weight. Both copies start equal (the init is a function of the
parameter name) and `sync_tied_weights` sums their gradients, so they stay equal.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _PipelineSchedule,
    get_schedule_class,
)

from bloomnative.model import Bloom

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


def is_multi_stage(schedule: str) -> bool:
    return issubclass(get_schedule_class(schedule), PipelineScheduleMulti)


def stage_layer_counts(
    n_layer: int, num_stages: int, embedding_as_layer: bool, explicit: list[int] | None = None
) -> list[int]:
    """Blocks per stage. BLOOM balanced by counting the embedding and the head as one layer
    each (70 blocks on 12 stages: [5, 6 x 10, 5]); a remainder goes to the middle stages."""
    if explicit:
        if len(explicit) != num_stages or sum(explicit) != n_layer or min(explicit) < 0:
            raise ValueError(
                f"parallelism.pp_layers_per_stage = {explicit} must have {num_stages} entries "
                f">= 0 summing to n_layer = {n_layer}"
            )
        return list(explicit)
    extra = 2 if embedding_as_layer and num_stages > 1 else 0
    units = n_layer + extra
    if num_stages > n_layer:
        raise ValueError(
            f"{num_stages} pipeline stages but only {n_layer} layers: lower parallelism.pp or "
            f"pp_stages_per_rank"
        )
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
        if stages_per_rank != 2:
            raise ValueError("ZBVZeroBubble needs parallelism.pp_stages_per_rank = 2")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def split_model(model: Bloom, stage_id: int, counts: list[int]) -> Bloom:
    """A copy of `model` (meta device) keeping only what stage `stage_id` runs."""
    stage = copy.deepcopy(model)
    first = sum(counts[:stage_id])
    keep = {str(i) for i in range(first, first + counts[stage_id])}
    for name in list(stage.layers):
        if name not in keep:
            del stage.layers[name]
    if stage_id != 0:
        stage.word_embeddings = None
        stage.word_embeddings_layernorm = None
    if stage_id != len(counts) - 1:
        stage.ln_f = None
        stage.lm_head = None
    elif stage.word_embeddings is None:
        # Untie: the last stage owns a separate copy of the head weight.
        stage.lm_head.weight = nn.Parameter(torch.empty_like(model.word_embeddings.weight))
    return stage


@dataclass
class Pipeline:
    schedule: _PipelineSchedule
    stages: list[PipelineStage]
    parts: list[Bloom]
    has_first: bool
    has_last: bool


def build_pipeline(
    parts: list[Bloom],
    stage_ids: list[int],
    num_stages: int,
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    pp_group: dist.ProcessGroup,
) -> Pipeline:
    """Wraps this rank's stage modules and builds the named schedule. `loss_fn` returns a sum
    normalised by the caller, so the schedule does not rescale gradients."""
    if schedule_name not in SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule = {schedule_name!r}; valid: {SCHEDULES}")
    pp = num_stages // len(stage_ids)
    if n_microbatches < pp:
        raise ValueError(
            f"{n_microbatches} pipeline micro batches for {pp} pipeline ranks: give at least one "
            f"per rank (parallelism.pp_microbatches, or a larger batch per data-parallel rank)"
        )
    stages = [
        PipelineStage(part, sid, num_stages, device, group=pp_group)
        for part, sid in zip(parts, stage_ids, strict=True)
    ]
    cls = get_schedule_class(schedule_name)
    if issubclass(cls, PipelineScheduleMulti):
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        if len(stages) != 1:
            raise ValueError(f"{schedule_name} runs one stage per rank; set pp_stages_per_rank=1")
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(
        schedule=schedule,
        stages=stages,
        parts=parts,
        has_first=0 in stage_ids,
        has_last=num_stages - 1 in stage_ids,
    )


def tied_weights(parts: list[Bloom]) -> list[nn.Parameter]:
    """This rank's copies of the tied embedding / head weight (0, 1 or 2 of them)."""
    found = []
    for part in parts:
        if part.word_embeddings is not None:
            found.append(part.word_embeddings.weight)
        elif part.lm_head is not None:
            found.append(part.lm_head.weight)
    return found


class TiedWeightSync:
    """Sums the gradients of the copies of the tied weight (first stage's embedding, last
    stage's head) so each copy gets the gradient the single model's shared weight gets.

    One process group per (dp_replicate, dp_shard, cp, tp) coordinate joins the pipeline rank of the
    first stage and that of the last; ranks holding both (V schedules) sum locally.
    """

    def __init__(self, parts: list[Bloom], mesh: DeviceMesh, first_pp_rank: int, last_pp_rank: int):
        self.copies = tied_weights(parts)
        self.group = None
        if first_pp_rank == last_pp_rank:
            return
        ranks = mesh.mesh  # [pp, dp_replicate, dp_shard, cp, tp]
        me = dist.get_rank()
        for coord in torch.cartesian_prod(*(torch.arange(n) for n in ranks.shape[1:])).view(
            -1, ranks.dim() - 1
        ):
            pair = [int(ranks[(first_pp_rank, *coord)]), int(ranks[(last_pp_rank, *coord)])]
            group = dist.new_group(pair)  # every rank takes part in creating every group
            if me in pair:
                self.group = group

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.copies:
            return
        total = _local(self.copies[0].grad).clone()
        for p in self.copies[1:]:
            total += _local(p.grad)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for p in self.copies:
            _local(p.grad).copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stage_owner(stage_id: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs `stage_id` (inverse of `stage_ids_of_rank`)."""
    if schedule == "ZBVZeroBubble":
        return stage_id if stage_id < pp else 2 * pp - 1 - stage_id
    return stage_id % pp

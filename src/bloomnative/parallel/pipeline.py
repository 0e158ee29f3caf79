"""Pipeline parallelism with torch.distributed.pipelining.

A stage is a deep copy of the (meta-device) model with the entries it does not own removed: the
first stage keeps the embedding, the last keeps the final norm and the head, which holds its own
copy of the tied embedding weight. Both copies start equal (the init is a function of the
parameter name) and `sync_tied_weights` sums their gradients, so they stay equal.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class

from bloomnative.model import Bloom
from bloomnative.model.attention import Segments
from bloomnative.parallel.layout_check import check_pipeline_split
from bloomnative.parallel.schedules import (
    is_multi_stage,
    stage_ids_of_rank,
    stage_layer_counts,
    stage_owner,
)


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
        assert stage.lm_head is not None and model.word_embeddings is not None
        stage.lm_head.weight = nn.Parameter(torch.empty_like(model.word_embeddings.weight))
    if stage_id != len(counts) - 1:
        stage.register_forward_hook(_carry_gradient)
    return stage


def _carry_gradient(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A stage's output needs a gradient even where nothing in or before the stage trains (a
    LoRA run's frozen embedding stage): torch's pipelining gives the next stage's input a
    gradient only if it had one on the sending stage (torch 2.13), and the zero-bubble
    schedules' weight backward finds a stage's weights through the graph from its input."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return output


@dataclass(frozen=True)
class PipelineStages:
    """This rank's stage modules and where every stage of the pipeline runs."""

    parts: list[Bloom]
    stage_ids: list[int]
    num_stages: int
    schedule: str
    group: dist.ProcessGroup
    """The pipeline group of this rank (one per data-parallel and tensor-parallel coordinate)."""

    @property
    def pp(self) -> int:
        return self.num_stages // len(self.stage_ids)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def owner(self, stage_id: int) -> int:
        """The rank in `group` that runs `stage_id`."""
        return stage_owner(stage_id, self.pp, self.schedule)


def split_for_pipeline(
    model: Bloom,
    pp_mesh: DeviceMesh,
    *,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    layers_per_stage: Sequence[int] | None = None,
    embedding_as_layer: bool = True,
) -> PipelineStages:
    """This rank's pipeline stages of `model` (a meta-device `Bloom`) for the 1-D `pp_mesh`:
    the stage modules and where every stage runs. With a pp mesh of size 1 the one stage is
    `model` itself.

    Where it goes among the plans (first, the others then applied to each of `.parts`), and
    why: docs/architecture.md (the order of the parallel plans).

    `schedule` is a torch.distributed.pipelining schedule name (SCHEDULES); multi-stage ones
    (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble) need `stages_per_rank` >= 2 (ZBV
    exactly 2). Layers are balanced over `pp_mesh.size() * stages_per_rank` stages, counting
    the embedding and the head as a layer each when `embedding_as_layer` (BLOOM's partition),
    unless `layers_per_stage` gives the counts.
    """
    pp = pp_mesh.size()
    check_pipeline_split(model.args, pp, schedule, stages_per_rank, layers_per_stage or ())
    group = pp_mesh.get_group()
    if pp == 1:
        return PipelineStages([model], [0], 1, schedule, group)
    num_stages = pp * stages_per_rank
    counts = stage_layer_counts(
        model.args.n_layer, num_stages, embedding_as_layer, layers_per_stage
    )
    ids = stage_ids_of_rank(pp_mesh.get_local_rank(), pp, stages_per_rank, schedule)
    parts = [split_model(model, sid, counts) for sid in ids]
    return PipelineStages(parts, ids, num_stages, schedule, group)


class _StepLoss:
    """The loss function a schedule is built with. torch fixes it at construction, but the
    trainer's changes every step (it divides by the step's token count): `Pipeline.step` hands
    in the step's closure for the length of the step."""

    def __init__(self) -> None:
        self.current: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.current is not None, "a schedule's loss is called only inside Pipeline.step"
        return self.current(output, target)


@dataclass
class Pipeline:
    """A schedule built for one micro-batch count, and the torch stages it runs."""

    schedule: _PipelineSchedule
    stages: Sequence[PipelineStage]
    n_microbatches: int
    placement: PipelineStages
    loss: _StepLoss

    def step(
        self,
        inputs: torch.Tensor,
        target: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        segments: Segments | None = None,
    ) -> list[torch.Tensor]:
        """Forward and backward of one batch (all ranks pass the same `inputs`, `target` and
        `segments`; only the first stage reads the inputs, the last the target, which
        `loss_fn(output, target)` receives), each micro batch's loss given by `loss_fn`
        (already normalised: the schedule does not rescale gradients). `segments`: the packed
        samples' segment bounds (`Bloom.forward`), split into micro batches as the inputs are
        and given to every stage. Returns the micro-batch losses on the rank holding the last
        stage, [] elsewhere."""
        losses: list[torch.Tensor] = []
        placement = self.placement
        self.loss.current = loss_fn
        stage_kwargs: dict[str, Any] = {} if segments is None else {"segments": segments}
        try:
            # return_outputs=False: the last stage keeps no micro batch's logits.
            self.schedule.step(
                *((inputs,) if placement.has_first else ()),
                target=target if placement.has_last else None,
                losses=losses if placement.has_last else None,
                return_outputs=False,
                **stage_kwargs,
            )
        finally:
            self.loss.current = None
        return losses


class _Stage(PipelineStage):
    """torch's `PipelineStage` without two behaviours of torch 2.11 that torch 2.13 changed
    (there the overrides change nothing):

    - A schedule's first step warms up the point-to-point links with a send to, and a receive
      from, the rank of each neighbouring stage. Under ZBVZeroBubble's V placement stages pp-1
      and pp share a rank, which gloo refuses to send to; 2.13 replaced that warm-up. Dropping
      the ops whose peer is this rank drops matched pairs (this rank sends and receives both),
      and a rank hands activations between its own stages without them.
    - The first step infers the stages' shapes with a forward on zeros, in training mode, so it
      draws dropout masks from the default generators. The trainer builds a schedule for each
      micro-batch count (batch-size rampup), so those draws would come at different steps in a
      run resumed mid-rampup than in the uninterrupted one. 2.13 forks the generators around
      the inference; this does it on every version.
    """

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if op.group_peer != self.group_rank]

    def _prepare_forward_infra(self, *args, **kwargs):
        devices = [self.device] if self.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            return super()._prepare_forward_infra(*args, **kwargs)


def build_pipeline(
    placement: PipelineStages, n_microbatches: int, device: torch.device
) -> Pipeline:
    """The schedule that trains `placement` (from `split_for_pipeline`) on `n_microbatches`
    micro batches per step: call `pipeline.step(inputs, target, loss_fn)` on every pipeline
    rank (all pass the same batch; the first stage reads the inputs, the last the target).

    Where it goes among the plans (last), and why: docs/architecture.md (the order of the
    parallel plans). Build another for another micro-batch count (batch-size rampup); each
    holds receive buffers sized for its count.

    Each step's `loss_fn(output, target)` is called per micro batch and its value is
    backpropagated as it is (the schedule does not divide by the micro-batch count): return
    that micro batch's share of the step's loss. With the tied embedding on two stages, call
    `TiedWeightSync` after the step. (`check_pipeline_microbatches` says which counts a
    schedule can run.)
    """
    stages = [
        _Stage(part, sid, placement.num_stages, device, group=placement.group)
        for part, sid in zip(placement.parts, placement.stage_ids, strict=True)
    ]
    cls = get_schedule_class(placement.schedule)
    first = stages if is_multi_stage(placement.schedule) else stages[0]
    loss = _StepLoss()
    schedule = cls(first, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    return Pipeline(schedule, stages, n_microbatches, placement, loss)


@torch.no_grad()
def pipeline_forward_loss(
    placement: PipelineStages,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor, Segments | None]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """Forward only (evaluation): each micro batch, ``(inputs, target, segments)``, goes
    through the stages in order (every stage given its `segments`), every activation sent to
    the rank of the next stage or kept when that is this rank. Returns the sum of
    `loss_fn(output, target)` over the micro batches on the rank holding the last stage, 0
    elsewhere.

    Used instead of a schedule's `eval()`, which in torch 2.13 fails where a rank runs two
    stages (interleaved and V schedules) and reuses receive buffers shaped for the training
    sequence length. Every rank walks the (micro batch, stage) pairs in the same order, so each
    receive meets its send and the collectives inside a stage (TP, FSDP) line up; nothing is
    kept from one micro batch to the next.
    """
    mine = dict(zip(placement.stage_ids, placement.parts, strict=True))
    me = dist.get_rank(placement.group)
    last = placement.num_stages - 1
    total = torch.zeros((), device=device)
    for inputs, target, segments in micro_batches:
        hidden = inputs
        for stage_id in sorted(mine):
            previous = placement.owner(stage_id - 1) if stage_id > 0 else me
            if previous != me:
                hidden = _recv_activation(placement.group, previous, device)
            output = mine[stage_id](hidden, segments=segments)
            if stage_id == last:
                total += _local(loss_fn(output, target))
            elif placement.owner(stage_id + 1) != me:
                _send_activation(output, placement.group, placement.owner(stage_id + 1))
            else:
                hidden = output
    return total


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER_LEN = 6  # dtype index, ndim, up to four sizes


def _send_activation(t: torch.Tensor, group: dist.ProcessGroup, dst: int) -> None:
    """A header (dtype and shape) then the tensor, so the receiver can allocate it."""
    t = _local(t).contiguous()
    header = [_WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape]
    header += [0] * (_HEADER_LEN - len(header))
    dist.send(torch.tensor(header, device=t.device), group=group, group_dst=dst)
    dist.send(t, group=group, group_dst=dst)


def _recv_activation(group: dist.ProcessGroup, src: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    dtype, ndim, *shape = header.tolist()
    t = torch.empty(shape[:ndim], dtype=_WIRE_DTYPES[dtype], device=device)
    dist.recv(t, group=group, group_src=src)
    return t


def tied_weights(parts: list[Bloom]) -> list[torch.Tensor]:
    """This rank's copies of the tied embedding / head weight (0, 1 or 2 of them)."""
    found: list[torch.Tensor] = []
    for part in parts:
        if part.word_embeddings is not None:
            found.append(part.word_embeddings.weight)
        elif part.lm_head is not None:
            found.append(part.lm_head.weight)
    return found


class TiedWeightSync:
    """Sums the gradients of the copies of the tied weight (first stage's embedding, last
    stage's head) so each copy gets the gradient the single model's shared weight gets.

    `mesh` is the whole device mesh with pp as its first dim (every rank takes part in building
    the groups): one process group per coordinate of the other dims joins the pipeline rank of
    the first stage and that of the last; ranks holding both (V schedules) sum locally. Call it
    after each pipeline step, before clipping and the optimizer step.
    """

    def __init__(self, placement: PipelineStages, mesh: DeviceMesh):
        # A frozen tied weight (the base of a LoRA run) has no gradient to sum.
        self.copies = [w for w in tied_weights(placement.parts) if w.requires_grad]
        self.group = None
        first_pp_rank, last_pp_rank = placement.owner(0), placement.owner(placement.num_stages - 1)
        if first_pp_rank == last_pp_rank:
            return
        ranks = mesh.mesh  # [pp, *other dims]
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
        grads = [_local(p.grad) for p in self.copies if p.grad is not None]
        assert len(grads) == len(self.copies), "call it after the backward"
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            g.copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t

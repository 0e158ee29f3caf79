"""FSDP2 (`fully_shard`): ZeRO-style sharding of parameters, gradients and optimizer state, and
bloomnative's one bf16 scheme (its MixedPrecisionPolicy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)

from bloomnative.model import Bloom


def uses_fsdp(dp: int, bf16: bool) -> bool:
    """Whether FSDP2 wraps the model: with data parallelism, and with bf16 on every layout, so
    that bf16 means one thing everywhere (a size-1 data-parallel mesh when dp == 1: no
    communication, only the mixed-precision casts and fp32 gradient accumulation)."""
    return dp > 1 or bf16


def apply_fsdp(
    model: Bloom,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    zero_stage: int = 3,
    cpu_offload: bool = False,
) -> None:
    """Wraps `model` (a `Bloom` or a pipeline stage of it) in FSDP2, in place: each block is its
    own unit, the root unit holds the rest (embedding, its LayerNorm, final LayerNorm and the
    head, which shares the embedding's parameter: a tied weight must live in one unit).

    Where it goes among the plans, and why: docs/architecture.md (the order of the parallel
    plans).

    `dp_mesh` is 1-D (FSDP, ZeRO), or 2-D (replicate, shard: HSDP, the outer dim replicating).
    With context parallelism the shard dim is dp_shard x cp flattened (`ParallelDims.fsdp_mesh`):
    cp ranks hold the same parameters, so they shard them instead of replicating them.
    Parameters are gathered in `param_dtype` (bf16 for mixed precision) while the sharded fp32
    copy is the master weight; gradients are reduce-scattered in `reduce_dtype` and accumulated
    in fp32. They are summed over the data-parallel ranks, not averaged (`sum_gradients`): divide
    each rank's loss by the token count of the whole global batch, over every data-parallel
    (and context-parallel) rank, and the sum is the gradient of the global token mean.
    zero_stage 3 frees the gathered parameters after each unit's forward (re-gathering them for
    backward); zero_stage 2 keeps them until backward, trading memory for one all-gather per
    unit. `cpu_offload` keeps the shards, gradients and optimizer step in host memory
    (ZeRO-Offload).
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp: zero_stage must be 2 or 3, got {zero_stage}")
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(
            f"apply_fsdp: dp_mesh must be 1-D (shard) or 2-D (replicate, shard), got "
            f"{dp_mesh.ndim} dims {dp_mesh.mesh_dim_names}; flatten the data-parallel dims first"
        )
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp}
    if ignored := gathered_wrong_on_one_rank(model, dp_mesh):
        kwargs["ignored_params"] = ignored
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    reshard = zero_stage == 3
    for block in model.blocks():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root's parameters are used at both ends of forward (embedding, then head) and first
    # in backward, so they stay gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if dp_mesh.size() > 1:
        sum_gradients(model)


def gathered_wrong_on_one_rank(model: nn.Module, dp_mesh: DeviceMesh) -> set[nn.Parameter]:
    """The parameters FSDP2 must leave alone when it shards over one rank (a one-process bf16
    run): frozen tensor subclasses with their own all-gather (`fsdp_pre_all_gather`: torchao's
    NF4, a QLoRA run's frozen base), which torch's one-rank shortcut gathers wrong (it keeps the
    first of their all-gather inputs only). Frozen, no gradient needs reducing; left out, they
    stay whole on the rank, which is all FSDP would hold anyway. Trained ones (FP8 all-gather
    weights, `parallel.float8`) gather one input, which the shortcut keeps, and stay in."""
    if dp_mesh.size(dp_mesh.ndim - 1) > 1:
        return set()
    return {
        p for p in model.parameters() if hasattr(p, "fsdp_pre_all_gather") and not p.requires_grad
    }


def sum_gradients(model: nn.Module) -> None:
    """Makes FSDP sum gradients over data-parallel ranks instead of averaging them: each
    rank's loss is already divided by the global token count (train/loss.py), so the sum is
    the gradient of the global token mean. Plain sums (no PREMUL_SUM, which gloo lacks)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class OneRankAccumulation:
    """Gradient accumulation on a one-rank FSDP2 mesh (bf16 on one device, `uses_fsdp`), without
    FSDP's per-micro-batch traffic. There is nothing to reduce on one rank, yet FSDP2 would
    still, after every micro batch's backward, copy each bf16 gradient into an fp32
    reduce-scatter buffer, "reduce-scatter" it onto itself and add it to the sharded fp32
    gradient. Here every micro batch but the last skips that (`set_requires_gradient_sync`):
    FSDP2 upcasts the first micro batch's gradient to fp32 and adds the later ones to it
    (unsharded, as many bytes as the sharded gradient on one rank), and the last micro batch
    reduces the sum once. The sums are the same fp32 additions in the same order, so gradients
    are bit for bit those of the per-micro-batch path.

    With zero_stage 2, which keeps each block's gathered bf16 weights from its forward to its
    backward, they are also kept from one micro batch to the next (`set_reshard_after_backward`)
    and gathered (cast from the fp32 master weights) once a step instead of once a micro batch:
    the peak, at the end of a forward, is unchanged. zero_stage 3 frees them after each forward
    to save memory, so they are gathered again as before.

    More ranks keep the reduce-scatter per micro batch: deferring it would hold every rank's
    whole unsharded fp32 gradient through the step, dp times the sharded one."""

    def __init__(self, parts: Sequence[nn.Module], zero_stage: int):
        self.parts = [part for part in parts if isinstance(part, FSDPModule)]
        self.keep_gathered = zero_stage == 2

    def before_backward(self, last: bool) -> None:
        """Called before each micro batch's backward; `last`: the step's last micro batch."""
        for part in self.parts:
            part.set_requires_gradient_sync(last)
            if self.keep_gathered:
                part.set_reshard_after_backward(last)

"""FSDP2 (`fully_shard`): ZeRO-style sharding of parameters, gradients and optimizer state, and
bloomnative's one bf16 scheme (its MixedPrecisionPolicy)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def uses_fsdp(dp: int, bf16: bool) -> bool:
    """Whether FSDP2 wraps the model: with data parallelism, and with bf16 on every layout, so
    that bf16 means one thing everywhere (a size-1 data-parallel mesh when dp == 1: no
    communication, only the mixed-precision casts and fp32 gradient accumulation)."""
    return dp > 1 or bf16


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    zero_stage: int,
    cpu_offload: bool = False,
) -> None:
    """Shards each block as its own FSDP unit; the root unit holds the rest (embedding, its
    LayerNorm, final LayerNorm and the head, which shares the embedding's parameter: a tied
    weight must live in one unit).

    `dp_mesh` is 1-D (FSDP, ZeRO: dp_shard x cp flattened) or 2-D (dp_replicate and that: HSDP;
    `ParallelDims.fsdp_mesh`). Parameters are gathered
    in `param_dtype` (bf16 for mixed precision) while the sharded fp32 copy is the master weight;
    gradients are reduce-scattered and accumulated in fp32. zero_stage 3 frees the gathered
    parameters after each unit's forward (re-gathering them for backward); zero_stage 2 keeps them
    until backward, trading memory for one all-gather per unit.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"parallelism.zero_stage must be 2 or 3, got {zero_stage}")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": dp_mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    reshard = zero_stage == 3
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root's parameters are used at both ends of forward (embedding, then head) and first
    # in backward, so they stay gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)

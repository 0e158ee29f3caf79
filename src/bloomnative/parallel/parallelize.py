"""The trainer's composition of the public plans (bloomnative.parallel) from its config
sections, on each pipeline stage, in the order docs/architecture.md gives. Each step is a
public function with plain arguments; this file only reads the config."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from bloomnative.config import ActivationCheckpointConfig, ParallelismConfig
from bloomnative.model import Bloom
from bloomnative.parallel.activation_checkpoint import apply_activation_checkpointing
from bloomnative.parallel.activation_offload import apply_activation_offload
from bloomnative.parallel.compile import apply_compile
from bloomnative.parallel.context_parallel import apply_context_parallel
from bloomnative.parallel.dims import ParallelDims
from bloomnative.parallel.fsdp import apply_fsdp, uses_fsdp
from bloomnative.parallel.tensor_parallel import apply_tensor_parallel


def parallelize_part(
    part: Bloom,
    mesh: DeviceMesh,
    dims: ParallelDims,
    par: ParallelismConfig,
    ac: ActivationCheckpointConfig,
    compile_blocks: bool,
    param_dtype: torch.dtype,
) -> None:
    """The configured plans on one model part, in place (steps 2-6 of the order in
    docs/architecture.md). FSDP2 wraps the part with data or context parallelism and, for bf16, on
    every layout (`fsdp.uses_fsdp`), sharding over dp_shard x cp (`ParallelDims.fsdp_mesh`)."""
    if dims.cp > 1:
        apply_context_parallel(part, mesh["cp"])
    if dims.tp > 1:
        apply_tensor_parallel(
            part,
            mesh["tp"],
            sequence_parallel=par.sequence_parallel,
            loss_parallel=par.loss_parallel,
        )
    apply_activation_checkpointing(part, ac.mode, ac.every)
    if ac.offload:
        apply_activation_offload(part)
    if compile_blocks:
        apply_compile(part, fullgraph=dims.cp == 1)
    if uses_fsdp(dims.dp * dims.cp, bf16=param_dtype == torch.bfloat16):
        apply_fsdp(
            part,
            dims.fsdp_mesh(mesh),
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            zero_stage=par.zero_stage,
            cpu_offload=par.cpu_offload,
        )

"""Applies the configured parallelism to a meta-device `Bloom`, in torchtitan's order:
pipeline split -> tensor parallel -> activation checkpointing -> compile -> FSDP."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from bloomnative.config import ActivationCheckpointConfig, ParallelismConfig
from bloomnative.model import Bloom
from bloomnative.parallel.activation_checkpoint import apply_activation_checkpointing
from bloomnative.parallel.compile import apply_compile
from bloomnative.parallel.dims import ParallelDims
from bloomnative.parallel.fsdp import apply_fsdp, uses_fsdp
from bloomnative.parallel.pipeline import split_model, stage_ids_of_rank, stage_layer_counts


def parallelize_part(
    part: Bloom,
    mesh: DeviceMesh,
    dims: ParallelDims,
    par: ParallelismConfig,
    ac: ActivationCheckpointConfig,
    compile_blocks: bool,
    param_dtype: torch.dtype,
) -> None:
    """TP -> activation checkpointing -> compile -> FSDP on one model part, in place. FSDP2
    wraps the part with data parallelism and, for bf16, on every layout (`fsdp.uses_fsdp`)."""
    if dims.tp > 1:
        from bloomnative.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(part, mesh["tp"], par.sequence_parallel, par.loss_parallel)
    apply_activation_checkpointing(part, ac.mode, ac.every)
    if compile_blocks:
        apply_compile(part)
    if uses_fsdp(dims.dp, bf16=param_dtype == torch.bfloat16):
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        apply_fsdp(part, dp_mesh, param_dtype, par.zero_stage, par.cpu_offload)


def split_for_pipeline(
    model: Bloom, dims: ParallelDims, par: ParallelismConfig, pp_rank: int
) -> tuple[list[Bloom], list[int], int]:
    """This rank's stage modules, their stage ids, and the total number of stages."""
    if dims.pp == 1:
        return [model], [0], 1
    num_stages = dims.pp * par.pp_stages_per_rank
    counts = stage_layer_counts(
        model.args.n_layer, num_stages, par.pp_embedding_as_layer, par.pp_layers_per_stage or None
    )
    ids = stage_ids_of_rank(pp_rank, dims.pp, par.pp_stages_per_rank, par.pp_schedule)
    return [split_model(model, sid, counts) for sid in ids], ids, num_stages

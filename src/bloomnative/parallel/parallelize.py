"""Applies the configured parallelism to a meta-device `Bloom`, in torchtitan's order:
pipeline split -> context parallel -> tensor parallel -> activation checkpointing -> compile ->
FSDP."""

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
    """CP -> TP -> activation checkpointing -> compile -> FSDP on one model part, in place.
    FSDP2 wraps the part with data or context parallelism and, for bf16, on every layout
    (`fsdp.uses_fsdp`), sharding over dp_shard x cp (`ParallelDims.fsdp_mesh`)."""
    if dims.cp > 1:  # before TP, whose per-rank attention dropout stream wraps `attend`
        from bloomnative.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(part, mesh["cp"])
    if dims.tp > 1:
        from bloomnative.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(part, mesh["tp"], par.sequence_parallel, par.loss_parallel)
    apply_activation_checkpointing(part, ac.mode, ac.every)
    if compile_blocks:
        # The ring's point-to-point communication is a graph break inside each block.
        apply_compile(part, fullgraph=dims.cp == 1)
    if uses_fsdp(dims.dp * dims.cp, bf16=param_dtype == torch.bfloat16):
        apply_fsdp(part, dims.fsdp_mesh(mesh), param_dtype, par.zero_stage, par.cpu_offload)


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

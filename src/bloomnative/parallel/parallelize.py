"""Applies the configured parallelism to a meta-device `Bloom`, in torchtitan's order:
pipeline split -> tensor parallel -> context parallel -> activation checkpointing -> compile ->
FSDP."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from bloomnative.config import ActivationCheckpointConfig, ParallelismConfig
from bloomnative.model import Bloom, BloomArgs
from bloomnative.parallel.activation_checkpoint import apply_activation_checkpointing
from bloomnative.parallel.compile import apply_compile
from bloomnative.parallel.dims import LayoutError, ParallelDims
from bloomnative.parallel.fsdp import apply_fsdp
from bloomnative.parallel.pipeline import (
    SCHEDULES,
    is_multi_stage,
    split_model,
    stage_ids_of_rank,
    stage_layer_counts,
)


def validate_layout(
    dims: ParallelDims,
    args: BloomArgs,
    par: ParallelismConfig,
    batch_sizes: list[int],
    micro_batch: int,
) -> None:
    """Every impossible layout, rejected before anything is allocated, with what to change.
    `batch_sizes`: every global batch size the run will use (rampup start and increment too)."""
    if args.n_head % dims.tp:
        raise LayoutError(
            f"the model has {args.n_head} heads, not divisible by parallelism.tp = {dims.tp}; "
            f"choose a tp that divides the head count"
        )
    if args.vocab_size % dims.tp:
        raise LayoutError(
            f"model.vocab_size = {args.vocab_size} is not divisible by parallelism.tp = "
            f"{dims.tp}; pad the vocabulary to a multiple of tp"
        )
    if dims.tp > 1 and args.fused_kernels:
        raise LayoutError(
            "model.fused_kernels is not supported with parallelism.tp > 1 (the Triton LayerNorm "
            "and bias-GeLU ops have no DTensor sharding rules yet); set it to false"
        )
    for size in batch_sizes:
        if size % (micro_batch * dims.dp):
            raise LayoutError(
                f"batch size {size} is not divisible by micro_batch_size * dp = {micro_batch} * "
                f"{dims.dp}; change training.global_batch_size (or rampup_batch_size), "
                f"training.micro_batch_size or the data-parallel degree"
            )
    if dims.pp > 1:
        _validate_pipeline(dims, args, par, min(batch_sizes) // dims.dp, micro_batch)


def validate_context_parallel(dims: ParallelDims, attention: str, seq_lens: dict[str, int]) -> None:
    """Context parallelism needs an attention backend with a ring form and sequences that cut
    into 2 * cp equal chunks. `seq_lens`: every sequence length the run uses, by config key."""
    if dims.cp == 1:
        return
    if attention not in ("triton", "sdpa", "auto"):
        raise LayoutError(
            f"model.attention = {attention!r} has no context-parallel form (FlexAttention's "
            f"score_mod is not split over ranks); use triton or sdpa with parallelism.cp = "
            f"{dims.cp}"
        )
    for key, length in seq_lens.items():
        if length % (2 * dims.cp):
            raise LayoutError(
                f"{key} = {length} is not a multiple of 2 * parallelism.cp = {2 * dims.cp}: "
                f"context parallelism cuts every sequence into 2 * cp equal chunks (rank i "
                f"holds chunks i and 2 cp - 1 - i); choose a length divisible by {2 * dims.cp} "
                f"or another cp"
            )


def _validate_pipeline(
    dims: ParallelDims, args: BloomArgs, par: ParallelismConfig, local_batch: int, micro_batch: int
) -> None:
    if par.pp_schedule not in SCHEDULES:
        raise LayoutError(
            f"parallelism.pp_schedule = {par.pp_schedule!r}; valid: {', '.join(SCHEDULES)}"
        )
    multi = is_multi_stage(par.pp_schedule)
    if multi and par.pp_stages_per_rank < 2:
        raise LayoutError(
            f"{par.pp_schedule} runs several stages per rank: set "
            f"parallelism.pp_stages_per_rank >= 2"
        )
    if not multi and par.pp_stages_per_rank != 1:
        raise LayoutError(
            f"{par.pp_schedule} runs one stage per rank: set parallelism.pp_stages_per_rank = 1 "
            f"or use Interleaved1F1B"
        )
    num_stages = dims.pp * par.pp_stages_per_rank
    if num_stages > args.n_layer:
        raise LayoutError(
            f"{num_stages} pipeline stages (pp {dims.pp} x {par.pp_stages_per_rank} per rank) "
            f"but the model has only {args.n_layer} layers; lower parallelism.pp"
        )
    if par.pp_layers_per_stage and (
        len(par.pp_layers_per_stage) != num_stages or sum(par.pp_layers_per_stage) != args.n_layer
    ):
        raise LayoutError(
            f"parallelism.pp_layers_per_stage = {par.pp_layers_per_stage} must have {num_stages} "
            f"entries summing to n_layer = {args.n_layer}"
        )
    microbatches = par.pp_microbatches or local_batch // micro_batch
    if local_batch % microbatches:
        raise LayoutError(
            f"{local_batch} samples per data-parallel rank do not split into "
            f"parallelism.pp_microbatches = {microbatches}"
        )
    if microbatches < dims.pp:
        raise LayoutError(
            f"{microbatches} pipeline micro batches for pp = {dims.pp}: need at least one per "
            f"stage; raise the batch size per data-parallel rank or parallelism.pp_microbatches"
        )


def parallelize_part(
    part: Bloom,
    mesh: DeviceMesh,
    dims: ParallelDims,
    par: ParallelismConfig,
    ac: ActivationCheckpointConfig,
    compile_blocks: bool,
    param_dtype: torch.dtype,
) -> None:
    """TP -> CP -> activation checkpointing -> compile -> FSDP on one model part, in place.
    FSDP shards over dp_shard x cp (`ParallelDims.fsdp_mesh`)."""
    if dims.tp > 1:
        from bloomnative.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(part, mesh["tp"], par.sequence_parallel, par.loss_parallel)
    if dims.cp > 1:
        from bloomnative.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(part, mesh["cp"])
    apply_activation_checkpointing(part, ac.mode, ac.every)
    if compile_blocks:
        # The ring's point-to-point communication is a graph break inside each block.
        apply_compile(part, fullgraph=dims.cp == 1)
    if dims.dp > 1 or dims.cp > 1:
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

"""What a parallel layout can run, decided in one place.

`check_layout` is called by preflight (before torchrun starts), by every rank of the trainer
(before anything is allocated) and by the memory planner's config path
(`planner.workload_from_config`: tools/estimate_memory.py, activation_checkpoint "auto"),
so the planner never says "fits" about a run that the trainer refuses. With batch-size rampup
it checks every global batch size the run steps through, not only the final one.
"""

from __future__ import annotations

from collections.abc import Sequence

from bloomnative.config import ParallelismConfig, TrainingConfig, ValidationConfig
from bloomnative.data.rampup import rampup_sizes
from bloomnative.kernels.flash_alibi_reference import (
    DROPOUT_KEYS_PER_DRAW,
    DROPOUT_MAX_POSITIONS,
)
from bloomnative.model.args import BloomArgs
from bloomnative.model.attention import backends_with
from bloomnative.parallel.dims import LayoutError, ParallelDims
from bloomnative.parallel.schedules import SCHEDULES, is_interleaved, is_multi_stage


def run_batch_sizes(training: TrainingConfig) -> list[int]:
    """Every global batch size of the run, in order: the rampup's start, start + increment, ...,
    global_batch_size (only global_batch_size without rampup)."""
    if not training.rampup_batch_size:
        return [training.global_batch_size]
    start, increment, _ = training.rampup_batch_size
    return rampup_sizes(start, increment, training.global_batch_size)


def pipeline_microbatches(pp_microbatches: int, local_batch: int, micro_batch: int) -> int:
    """Micro batches of one pipeline step: `parallelism.pp_microbatches`, or (0) the number of
    micro batches in the data-parallel rank's share of the global batch."""
    return pp_microbatches or local_batch // micro_batch


def check_tensor_parallel(args: BloomArgs, tp: int, fused_loss: bool = False) -> None:
    """Whole heads and whole vocabulary rows per tensor-parallel rank, and no op without a
    sharding rule."""
    if args.n_head % tp:
        raise LayoutError(
            f"the model has {args.n_head} heads, not divisible by parallelism.tp = {tp}; "
            f"choose a tp that divides the head count"
        )
    if args.vocab_size % tp:
        raise LayoutError(
            f"model.vocab_size = {args.vocab_size} is not divisible by parallelism.tp = "
            f"{tp}; pad the vocabulary to a multiple of tp"
        )
    if tp > 1 and args.fused_kernels:
        raise LayoutError(
            "model.fused_kernels is not supported with parallelism.tp > 1 (the Triton LayerNorm "
            "and bias-GeLU ops have no DTensor sharding rules yet); set it to false"
        )
    if tp > 1 and fused_loss:
        raise LayoutError(
            "model.fused_loss is for tp = 1; with tensor parallelism use parallelism.loss_parallel "
            "(the logits stay sharded over the vocabulary)"
        )


def run_seq_lens(
    training: TrainingConfig, validation: ValidationConfig | None = None
) -> dict[str, int]:
    """Every sequence length the run trains or evaluates at, by config key."""
    lengths = {"training.seq_len": training.seq_len}
    if validation is not None and validation.freq and validation.seq_len:
        lengths["validation.seq_len"] = validation.seq_len
    return lengths


def check_context_parallel(args: BloomArgs, cp: int, seq_lens: dict[str, int]) -> None:
    """An attention backend with a ring form, and sequences that cut into 2 * cp equal chunks
    (chunks of a multiple of 16 tokens for the Triton kernels' dropout draws). `args.attention`
    is "sdpa" for an unresolved "auto", which resolves to a backend with a ring form."""
    if cp == 1:
        return
    ring = backends_with("context_parallel")
    if args.attention not in ring:
        raise LayoutError(
            f"model.attention = {args.attention!r} has no context-parallel form (FlexAttention's "
            f"score_mod is not split over ranks); use {' or '.join(ring)} with "
            f"parallelism.cp = {cp}"
        )
    for key, length in seq_lens.items():
        if length % (2 * cp):
            raise LayoutError(
                f"{key} = {length} is not a multiple of 2 * parallelism.cp = {2 * cp}: context "
                f"parallelism cuts every sequence into 2 * cp equal chunks (rank i holds chunks "
                f"i and 2 cp - 1 - i); choose a length divisible by {2 * cp} or another cp"
            )
        chunk_unit = 2 * cp * DROPOUT_KEYS_PER_DRAW
        if args.attention == "triton" and args.attention_dropout and length % chunk_unit:
            raise LayoutError(
                f"{key} = {length}: with model.attention_dropout the Triton kernels draw "
                f"random numbers for {DROPOUT_KEYS_PER_DRAW} keys at a time, so each of the "
                f"2 * cp chunks needs a multiple of {DROPOUT_KEYS_PER_DRAW} tokens; choose a "
                f"length divisible by {chunk_unit}"
            )


def check_attention_dropout_positions(args: BloomArgs, seq_lens: dict[str, int]) -> None:
    """The Triton kernels' dropout stream covers a bounded number of positions (the whole
    sequence's, also when context parallelism splits it)."""
    if args.attention != "triton" or not args.attention_dropout:
        return
    for key, length in seq_lens.items():
        if length > DROPOUT_MAX_POSITIONS:
            raise LayoutError(
                f"{key} = {length}: with model.attention_dropout the Triton attention kernels "
                f"draw dropout for positions below {DROPOUT_MAX_POSITIONS} only; use a shorter "
                f"length, model.attention_dropout = 0 or model.attention = sdpa"
            )


def check_pipeline_split(
    args: BloomArgs,
    pp: int,
    schedule: str,
    stages_per_rank: int,
    layers_per_stage: Sequence[int] = (),
) -> None:
    """The schedule exists, matches the stages per rank, and every stage gets its layers."""
    if pp == 1:
        return
    if schedule not in SCHEDULES:
        raise LayoutError(f"parallelism.pp_schedule = {schedule!r}; valid: {', '.join(SCHEDULES)}")
    multi = is_multi_stage(schedule)
    if multi and stages_per_rank < 2:
        raise LayoutError(
            f"{schedule} runs several stages per rank: set parallelism.pp_stages_per_rank >= 2"
        )
    if not multi and stages_per_rank != 1:
        raise LayoutError(
            f"{schedule} runs one stage per rank: set parallelism.pp_stages_per_rank = 1 "
            f"or use Interleaved1F1B"
        )
    if schedule == "ZBVZeroBubble" and stages_per_rank != 2:
        raise LayoutError("ZBVZeroBubble runs two stages per rank: set pp_stages_per_rank = 2")
    num_stages = pp * stages_per_rank
    if num_stages > args.n_layer:
        raise LayoutError(
            f"{num_stages} pipeline stages (pp {pp} x {stages_per_rank} per rank) "
            f"but the model has only {args.n_layer} layers; lower parallelism.pp"
        )
    if layers_per_stage and (
        len(layers_per_stage) != num_stages
        or sum(layers_per_stage) != args.n_layer
        or min(layers_per_stage) < 0
    ):
        raise LayoutError(
            f"parallelism.pp_layers_per_stage = {list(layers_per_stage)} must have {num_stages} "
            f"entries >= 0 summing to n_layer = {args.n_layer}"
        )


def check_pipeline_microbatches(n: int, pp: int, schedule: str, where: str = "") -> None:
    """A pipeline step of `n` micro batches is one the schedule can run. `where` says which
    batch size gave `n`, for the message."""
    if pp == 1:
        return
    if n < pp:
        raise LayoutError(
            f"{n} pipeline micro batches{where} for pp = {pp}: need at least one per stage; "
            f"raise the batch size per data-parallel rank or parallelism.pp_microbatches"
        )
    rounds = max(1, n // pp)
    if is_interleaved(schedule) and n % rounds:
        raise LayoutError(
            f"{n} pipeline micro batches{where}: {schedule} runs them in rounds of pp = {pp} "
            f"and needs a count divisible by the number of rounds ({rounds}); use a count that "
            f"is a multiple of pp (parallelism.pp_microbatches, or the batch sizes)"
        )


def check_layout(
    dims: ParallelDims,
    args: BloomArgs,
    par: ParallelismConfig,
    training: TrainingConfig,
    fused_loss: bool = False,
    validation: ValidationConfig | None = None,
) -> None:
    """Every impossible layout, rejected before anything is allocated, with what to change;
    batch-size rules are checked for every global batch size the run uses, sequence-length
    rules for every length it trains or evaluates at (`validation`)."""
    check_tensor_parallel(args, dims.tp, fused_loss)
    seq_lens = run_seq_lens(training, validation)
    check_context_parallel(args, dims.cp, seq_lens)
    check_attention_dropout_positions(args, seq_lens)
    check_pipeline_split(
        args, dims.pp, par.pp_schedule, par.pp_stages_per_rank, par.pp_layers_per_stage
    )
    micro = training.micro_batch_size
    for size in run_batch_sizes(training):
        ramping = size != training.global_batch_size
        source = "rampup batch size" if ramping else "batch size"
        if size % (micro * dims.dp):
            raise LayoutError(
                f"{source} {size} is not divisible by micro_batch_size * dp = {micro} * "
                f"{dims.dp}; change training.global_batch_size (or rampup_batch_size), "
                f"training.micro_batch_size or the data-parallel degree"
            )
        if dims.pp == 1:
            continue
        local = size // dims.dp
        n = pipeline_microbatches(par.pp_microbatches, local, micro)
        if local % n:
            raise LayoutError(
                f"{source} {size}: its {local} samples per data-parallel rank do not split into "
                f"parallelism.pp_microbatches = {n}"
            )
        check_pipeline_microbatches(n, dims.pp, par.pp_schedule, f" (from {source} {size})")

"""The layout and workload the trainer runs for a bloomnative config."""

from __future__ import annotations

from bloomnative.config import Config, ParallelismConfig, model_args_from_config
from bloomnative.parallel.dims import ParallelDims
from bloomnative.parallel.layout_check import check_layout, pipeline_microbatches
from bloomnative.parallel.memory_estimate.inputs import Layout, PlanError, Workload


def attention_memory_kind(backend: str, device_type: str, cp: int = 1) -> str:
    """The memory behaviour of a model.attention backend on a device type. With context
    parallelism "auto" is the Triton ring on a GPU (train.attention_choice)."""
    if backend in ("triton", "flex") or (backend == "auto" and cp > 1 and device_type == "cuda"):
        return "flash"
    if backend in ("sdpa", "auto"):  # "auto" may resolve to sdpa: plan for its footprint
        return "sdpa_efficient" if device_type == "cuda" else "cpu_math"
    raise PlanError(f"unknown attention backend {backend!r}; valid: sdpa, flex, triton, auto")


def layout_from_config(par: ParallelismConfig, world_size: int = 0) -> Layout:
    """The layout a [parallelism] section gives on `world_size` devices (needed when dp_shard
    is -1; 0 then means dp_shard = 1)."""
    fixed = par.dp_replicate * par.cp * par.tp * par.pp
    if not world_size:
        world_size = fixed * (par.dp_shard if par.dp_shard > 0 else 1)
    dims = ParallelDims.resolve(par.dp_replicate, par.dp_shard, par.tp, par.pp, world_size, par.cp)
    return Layout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        cp=dims.cp,
        tp=dims.tp,
        pp=dims.pp,
        pp_schedule=par.pp_schedule,
        pp_stages_per_rank=par.pp_stages_per_rank,
        pp_embedding_as_layer=par.pp_embedding_as_layer,
        pp_layers_per_stage=tuple(par.pp_layers_per_stage),
        sequence_parallel=par.sequence_parallel,
        loss_parallel=par.loss_parallel,
        cpu_offload=par.cpu_offload,
        zero_stage=par.zero_stage,
    )


def compiles_the_loss(config: Config, tp: int) -> bool:
    """Whether the trainer compiles its unfused loss: with `compile.enable`, unless the loss is
    the fused kernel or the logits are a tensor-parallel DTensor."""
    return config.compile.enable and not config.model.fused_loss and tp == 1


def local_batch_size(config: Config, layout: Layout) -> int:
    """Samples per data-parallel rank per step, at the final (largest) global batch size."""
    return config.training.global_batch_size // layout.dp


def workload_from_config(
    config: Config,
    layout: Layout,
    device_type: str = "cuda",
    attention: str | None = None,
    dropout: bool = False,
) -> Workload:
    """What the trainer runs for `config` at its final batch size: its micro batches (the
    pipeline's when pp_microbatches is set), dtype, recompute, attention kernel on `device_type`
    (or the given attention memory kind), dropout (the config's, or forced on by `dropout`), loss
    and AdamW implementation. Raises LayoutError for a run the trainer would refuse
    (`layout_check.check_layout`, every rampup batch size)."""
    t, par = config.training, config.parallelism
    dims = ParallelDims(
        layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, layout.world_size, layout.cp
    )
    args = model_args_from_config(config.model)
    check_layout(dims, args, par, t, config.model.fused_loss, config.validation)
    samples = local_batch_size(config, layout)
    pp_microbatches = par.pp_microbatches if layout.pp > 1 else 0
    microbatches = pipeline_microbatches(pp_microbatches, samples, t.micro_batch_size)
    optimizer = config.optimizer.implementation
    if optimizer == "auto":
        optimizer = "fused" if device_type == "cuda" else "foreach"
    return Workload(
        micro_batch=samples // microbatches,
        seq_len=t.seq_len,
        microbatches=microbatches,
        precision=t.dtype,
        recompute=config.activation_checkpoint.mode,
        recompute_every=config.activation_checkpoint.every,
        attention=attention
        or attention_memory_kind(config.model.attention, device_type, layout.cp),
        fused_loss=config.model.fused_loss,
        compiled_loss=compiles_the_loss(config, layout.tp),
        dropout=dropout or config.model.hidden_dropout > 0 or config.model.attention_dropout > 0,
        optimizer=optimizer,
    )

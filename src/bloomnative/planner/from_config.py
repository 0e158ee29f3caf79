"""The layout and workload the trainer runs for a bloomnative config, and what
`activation_checkpoint.mode = "auto"` stands for: the least recomputation the planner says fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from bloomnative.config import Config, ParallelismConfig, RecomputeMode, model_args_from_config
from bloomnative.model.args import ATTENTION_BACKENDS, BloomArgs
from bloomnative.model.attention import attention_for_planning
from bloomnative.parallel.dims import ParallelDims
from bloomnative.parallel.layout_check import check_layout, pipeline_microbatches
from bloomnative.planner.inputs import Adapters, GiB, Layout, Overhead, PlanError, Workload
from bloomnative.planner.rank_estimate import Plan, least_recompute_that_fits


def attention_memory_kind(backend: str, device_type: str, segments: bool = False) -> str:
    """The memory behaviour of a model.attention backend (not "auto":
    `model.attention.attention_for_planning` says what it stands for) on a device type. On
    CPU, SDPA takes its math path for the [heads, s, s] bias, and its flash kernel, which keeps
    the bias, for the [b, heads, s, s] one of samples cut into `segments`."""
    if backend in ("triton", "flex"):
        return "flash"
    if backend == "sdpa":
        return "sdpa_efficient" if device_type == "cuda" or segments else "cpu_math"
    valid = ", ".join((*ATTENTION_BACKENDS, "auto"))
    raise PlanError(f"unknown attention backend {backend!r}; valid: {valid}")


def layout_from_config(par: ParallelismConfig, world_size: int = 0) -> Layout:
    """The layout a [parallelism] section gives on `world_size` devices (needed when dp_shard
    is -1; 0 then means dp_shard = 1)."""
    if not world_size:
        fixed = par.dp_replicate * par.cp * par.tp * par.pp
        world_size = fixed * (par.dp_shard if par.dp_shard > 0 else 1)
    return Layout(ParallelDims.from_config(par, world_size), par)


def local_batch_size(config: Config, layout: Layout) -> int:
    """Samples per data-parallel rank per step, at the final (largest) global batch size."""
    return config.training.global_batch_size // layout.dims.dp


def workload_from_config(
    config: Config,
    layout: Layout,
    device_type: str = "cuda",
    attention: str | None = None,
    dropout: bool = False,
    *,
    compiled_loss: bool,
) -> Workload:
    """What the trainer runs for `config` at its final batch size: its micro batches (the
    pipeline's when pp_microbatches is set), dtype, recompute, attention kernel on `device_type`
    (or the given attention memory kind), dropout (the config's, or forced on by `dropout`), loss
    (`compiled_loss`: the run's `ResolvedRun.compile_loss`), AdamW implementation and FP8
    recipe (`[quantize] linear`). Raises LayoutError for a run the trainer would refuse
    (`layout_check.check_layout`, every rampup batch size)."""
    t, par, dims = config.training, config.parallelism, layout.dims
    args = model_args_from_config(config.model)
    check_layout(dims, args, par, t, config.model.fused_loss, config.validation)
    samples = local_batch_size(config, layout)
    pp_microbatches = par.pp_microbatches if dims.pp > 1 else 0
    microbatches = pipeline_microbatches(pp_microbatches, samples, t.micro_batch_size)
    recompute = config.activation_checkpoint.mode
    backend = attention_for_planning(config.model.attention, dims.cp, device_type)
    return Workload(
        micro_batch=samples // microbatches,
        seq_len=t.seq_len,
        microbatches=microbatches,
        precision=t.dtype,
        # "auto" is what choose_recompute picks, starting from this workload without any
        recompute="none" if recompute == "auto" else recompute,
        recompute_every=config.activation_checkpoint.every,
        attention=attention or attention_memory_kind(backend, device_type, config.data.segmented),
        segments=config.data.segmented,
        fused_loss=config.model.fused_loss,
        compiled_loss=compiled_loss,
        dropout=dropout or args.uses_dropout,
        optimizer=(
            config.optimizer.kernel(device_type)
            if config.optimizer.state_dtype == "fp32"
            else config.optimizer.state_dtype
        ),
        offload=config.activation_checkpoint.offload,
        adapters=adapters_from_config(config),
        float8=config.quantize.linear.removeprefix("float8_"),
        float8_all_gather=config.quantize.fsdp_float8_all_gather,
    )


def adapters_from_config(config: Config) -> Adapters | None:
    """The run's `[lora]` adapters, or None when every weight trains."""
    lora = config.lora
    if lora.rank == 0:
        return None
    return Adapters(lora.rank, tuple(lora.target_modules), lora.quantize_base)


@dataclass(frozen=True)
class RecomputeChoice:
    """What the planner chose, and the memory it predicts for the worst rank."""

    mode: RecomputeMode
    every: int
    predicted_device_gib: float
    predicted_allocated_gib: float
    capacity_gib: float

    def describe(self) -> str:
        setting = f"selective every {self.every}" if self.mode == "selective" else self.mode
        return (
            f"activation checkpointing chosen by the planner: {setting} (predicted "
            f"{self.predicted_device_gib:.1f} of {self.capacity_gib:.1f} GiB per device)"
        )


def least_recompute_or_raise(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    capacity_bytes: int,
    overhead: Overhead,
    device_type: str,
) -> tuple[Workload, Plan]:
    """`least_recompute_that_fits`, or a PlanError saying what to change when even full
    recomputation does not fit."""
    found = least_recompute_that_fits(args, layout, workload, capacity_bytes, overhead, device_type)
    if found is None:
        raise PlanError(
            f'activation_checkpoint.mode = "auto": even full recomputation does not fit in '
            f"{capacity_bytes / GiB:.1f} GiB per device; lower training.micro_batch_size, "
            f"shard more (parallelism.dp_shard, tp, pp) or turn on model.fused_loss"
        )
    return found


def choose_recompute(
    config: Config,
    args: BloomArgs,
    layout: Layout,
    device_type: str,
    capacity_bytes: int,
    compiled_loss: bool,
) -> RecomputeChoice:
    """The activation checkpointing with the least recomputation whose worst rank fits in
    `capacity_bytes` for the run `config` describes on `layout`, with the device type's default
    overhead (`Overhead.for_device`: on CPU the process's runtime and malloc's free memory)."""
    workload = dataclasses.replace(
        workload_from_config(config, layout, device_type, compiled_loss=compiled_loss),
        recompute="none",
        recompute_every=1,
    )
    overhead = Overhead.for_device(device_type)
    chosen, plan = least_recompute_or_raise(
        args, layout, workload, capacity_bytes, overhead, device_type
    )
    return RecomputeChoice(
        mode=chosen.recompute,
        every=chosen.recompute_every,
        predicted_device_gib=plan.worst.device_bytes / GiB,
        predicted_allocated_gib=plan.worst.allocated_peak / GiB,
        capacity_gib=capacity_bytes / GiB,
    )


def auto_recompute(
    config: Config,
    args: BloomArgs,
    layout: Layout,
    device_type: str,
    device_memory: Callable[[], int],
    compiled_loss: bool,
) -> RecomputeChoice | None:
    """What `activation_checkpoint.mode = "auto"` stands for: the planner's least recomputation
    within memory_budget_gib or, without one, `device_memory()` (the smallest device of the job;
    only called on CUDA). None when the mode is not "auto", or on CPU without a budget (no
    recomputation). Raises PlanError when even full recomputation does not fit."""
    ac = config.activation_checkpoint
    if ac.mode != "auto":
        return None
    if ac.memory_budget_gib:
        capacity = int(ac.memory_budget_gib * GiB)
    elif device_type == "cuda":
        capacity = device_memory()
    else:
        return None
    return choose_recompute(config, args, layout, device_type, capacity, compiled_loss)

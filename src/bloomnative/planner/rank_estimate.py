"""The per-rank estimate: one stage's stored activations and the backward's working set, every
component of one pipeline rank's memory and its peak, the plan of all ranks, and the searches
over it (the largest micro batch that fits, the least activation checkpointing that fits)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.dims import LayoutError
from bloomnative.parallel.layout_check import (
    check_context_parallel,
    check_pipeline_microbatches,
    check_pipeline_split,
    check_tensor_parallel,
)
from bloomnative.planner.activations import (
    block_activation_terms,
    checkpointed_block_terms,
    embedding_terms,
    float8_backward_casts,
    head_terms,
    loss_saved_terms,
    loss_transient,
    micro_batch_tokens,
)
from bloomnative.planner.inputs import (
    ADAPTER_TARGETS,
    FLOAT8_RECIPES,
    FP32,
    OPTIMIZER_IMPLS,
    RECOMPUTE_MODES,
    ActivationTerm,
    Adapters,
    Component,
    Layout,
    Overhead,
    PlanError,
    Precision,
    Workload,
    is_checkpointed,
    recompute_options,
)
from bloomnative.planner.model_states import (
    ParamTensor,
    gradients_persist,
    model_state_components,
    nf4_base_component,
    rank_parameters,
    rank_stage_ids,
    split_nf4_base,
    stage_blocks,
    unit_gathered_bytes,
    unit_numels,
)
from bloomnative.planner.pipeline_buffers import (
    in_flight_microbatches,
    pipeline_buffer_components,
)


def _sum(terms: Iterable[ActivationTerm]) -> int:
    return sum(t.bytes for t in terms)


def stage_activation_components(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    prec: Precision,
    stage_id: int,
    in_flight: int,
    terms: dict[str, list[ActivationTerm]],
) -> tuple[list[Component], int]:
    """Stored activations of one stage for its in-flight micro batches, and the stage's
    backward working set (one recomputed block, if any, plus gradient buffers)."""
    first, last = stage_id == 0, stage_id == layout.num_stages - 1
    blocks = stage_blocks(args, layout, stage_id)
    recomputed = sum(is_checkpointed(i, workload) for i in blocks)
    full = len(blocks) - recomputed
    block_bytes = _sum(terms["block"])
    ckpt_bytes = _sum(terms["checkpointed block"])
    components = block_activation_components(
        stage_id, in_flight, full, recomputed, block_bytes, ckpt_bytes, workload.offload
    )
    if first:
        components.append(
            Component(
                "activations: embedding",
                in_flight * _sum(terms["embedding"]),
                "fwd_bwd",
                "token ids + embedding LayerNorm input",
            )
        )
    if last:
        components.append(
            Component(
                "activations: final LayerNorm + head input",
                in_flight * _sum(terms["head"]),
                "fwd_bwd",
                "ln_f input + lm_head input",
            )
        )
        # In a pipeline the logits are the stage's output, held by the schedule (see
        # `pipeline_buffers.pipeline_buffer_components`); without one, the trainer holds them.
        loss_terms = [t for t in terms["loss"] if layout.dims.pp == 1 or t.name != "logits"]
        components.append(
            Component(
                "loss: " + " + ".join(t.name for t in loss_terms),
                in_flight * _sum(loss_terms),
                "fwd_bwd",
                f"{in_flight} x (" + " + ".join(t.source for t in loss_terms) + ")",
            )
        )
    working = block_backward_buffers(args, layout, workload, prec)
    if recomputed:
        working += block_bytes
    return components, working


def block_activation_components(
    stage_id: int,
    in_flight: int,
    full: int,
    recomputed: int,
    block_bytes: int,
    ckpt_bytes: int,
    offload: bool,
) -> list[Component]:
    """The blocks' stored activations for `in_flight` micro batches: `full` blocks keeping
    `block_bytes` each and `recomputed` ones keeping their input. With `offload`, the full
    blocks' are in host memory and one block's are on the device (brought back for its
    backward, or on their way out in the forward)."""
    stored = f"{full} blocks x {block_bytes / 2**20:.1f} MiB"
    checkpointed = f"{recomputed} checkpointed x {ckpt_bytes / 2**20:.1f} MiB"
    name = f"activations: stage {stage_id} blocks"
    if not offload:
        detail = stored + (f" + {checkpointed}" if recomputed else "")
        return [
            Component(
                name,
                in_flight * (full * block_bytes + recomputed * ckpt_bytes),
                "fwd_bwd",
                f"{in_flight} micro batch(es) x ({detail})",
            )
        ]
    on_device = min(full, 1) * block_bytes + in_flight * recomputed * ckpt_bytes
    return [
        Component(
            f"{name} (offloaded)",
            in_flight * full * block_bytes,
            "host",
            f"{in_flight} micro batch(es) x {stored}",
        ),
        Component(
            f"{name} (on the device with offload)",
            on_device,
            "fwd_bwd",
            f"one block's, {block_bytes / 2**20:.1f} MiB"
            + (f" + {in_flight} micro batch(es) x {checkpointed}" if recomputed else ""),
        ),
    ]


def block_backward_buffers(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> int:
    """Gradient buffers alive while one block back-propagates (an approximation): the two
    largest activation gradients of the block (the MLP's 4h-wide ones, or the softmax's with
    materialized attention), or the ring attention's buffers with context parallelism, the
    residual-stream gradient in and out, and with FP8 linears their backward's FP8 casts
    (`float8_backward_casts`)."""
    tokens = micro_batch_tokens(layout, workload)
    mlp = 2 * tokens * (4 * args.hidden_size // layout.dims.tp) * prec.compute
    heads = args.n_head // layout.dims.tp
    scores = 2 * workload.micro_batch * heads * workload.seq_len**2 * prec.compute
    materialized = layout.dims.cp == 1 and workload.attention in ("materialized", "cpu_math")
    ring = ring_attention_buffers(args, layout, workload, prec)
    widest = max(mlp, scores if materialized else 0, ring)
    stream = 2 * tokens * args.hidden_size // layout.sequence_shards * prec.compute
    return widest + stream + float8_backward_casts(args, layout, workload)


def ring_attention_buffers(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> int:
    """Bytes the ring attention's backward holds at once (parallel/context_parallel.py), with
    T = b*s/cp local tokens and h/t local width: the local K/V stacked and the next step's
    received copy (4Th/t, compute dtype), the travelling fp32 dK/dV accumulator and the one
    received (16Th/t), the fp32 dQ accumulator (4Th/t), one block's dq, dk, dv (1.5Th/t, compute
    dtype) and the kernel's fp32 dQ buffer for it (2Th/t). The "sdpa" backend's blocks also
    materialise fp32 scores, probabilities and their gradients, 4 x [b, heads/t, C, C] with
    C = s/(2cp), plus the bias block. 0 without context parallelism."""
    if layout.dims.cp == 1:
        return 0
    width = micro_batch_tokens(layout, workload) * args.hidden_size // layout.dims.tp
    total = int((5.5 * prec.compute + 22) * width)
    if workload.attention != "flash":
        chunk = workload.seq_len // (2 * layout.dims.cp)
        heads = args.n_head // layout.dims.tp
        total += FP32 * (4 * workload.micro_batch + 1) * heads * chunk * chunk
    return total


def backward_transient(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    prec: Precision,
    params: list[ParamTensor],
    stage_ids: list[int],
    block_working: int,
    device_type: str,
) -> Component:
    """The larger of the loss's buffers (last stage) and the block backward working set. The
    latter also holds the root unit's gradients (produced by the head, first in backward) and,
    under FSDP, one block's unsharded gradient plus its fp32 reduce-scatter input."""
    units = unit_numels(params)
    root_grad_bytes = prec.compute if prec.fsdp or layout.deepspeed else FP32
    working = block_working
    parts = ["block backward buffers"]
    if prec.fsdp or not gradients_persist(layout, workload):
        working += root_grad_bytes * units.get("root", 0)
        parts.append("root-unit grads")
    if prec.fsdp:
        largest_block = max((n for u, n in units.items() if u != "root"), default=0)
        working += (prec.compute + FP32) * largest_block
        parts.append("one block's unsharded grad + fp32 reduce-scatter input")
        if layout.reshards_after_forward:
            shards = layout.dims.fsdp_shards
            gathered = unit_gathered_bytes(params, prec.compute, workload, shards)
            working += 2 * max((n for u, n in gathered.items() if u != "root"), default=0)
            parts.append("current + prefetched block re-gathered")
    candidates = [Component("backward working set", working, "fwd_bwd", " + ".join(parts))]
    if layout.num_stages - 1 in stage_ids:
        candidates.append(loss_transient(args, layout, workload, prec, device_type))
    worst = max(candidates, key=lambda c: c.bytes)
    return Component(
        f"backward transient: {worst.name}",
        worst.bytes,
        "fwd_bwd",
        worst.formula + " (largest of: " + ", ".join(c.name for c in candidates) + ")",
    )


@dataclass
class RankEstimate:
    """The memory of one pipeline rank (any of its tp/dp peers holds the same)."""

    pp_rank: int
    components: list[Component]
    activation_terms: dict[str, list[ActivationTerm]] = field(default_factory=dict)
    """Per-micro-batch terms behind the activation components ("block", "checkpointed block",
    "embedding", "head", "loss"), for --explain."""
    overhead: Overhead = field(default_factory=Overhead.none)

    def phase_bytes(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if c.phase == phase)

    @property
    def peak_phase(self) -> str:
        """The moment of the peak: "fwd_bwd" or "step_end"."""
        fwd, opt = self.phase_bytes("fwd_bwd"), self.phase_bytes("step_end")
        return "fwd_bwd" if fwd >= opt else "step_end"

    @property
    def allocated_peak(self) -> int:
        """Peak of live tensor bytes (what torch.cuda.max_memory_allocated reports)."""
        return self.phase_bytes("resident") + self.phase_bytes(self.peak_phase)

    @property
    def overhead_bytes(self) -> int:
        frag = int(self.overhead.fragmentation * self.allocated_peak)
        return self.overhead.context_bytes + frag

    @property
    def device_bytes(self) -> int:
        """What the device must have: allocated peak + context + fragmentation."""
        return self.allocated_peak + self.overhead_bytes

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)


def activation_terms_for(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> dict[str, list[ActivationTerm]]:
    return {
        "block": block_activation_terms(args, layout, workload, prec),
        "checkpointed block": checkpointed_block_terms(args, layout, workload, prec),
        "embedding": embedding_terms(args, layout, workload, prec),
        "head": head_terms(args, layout, workload, prec),
        "loss": loss_saved_terms(args, layout, workload, prec),
    }


def validate_plan(args: BloomArgs, layout: Layout, workload: Workload) -> None:
    """Rejects what the estimate cannot describe, with what to change: the layout checks are
    the trainer's (`layout_check`, raising LayoutError), the rest the planner's own."""
    dims, par = layout.dims, layout.parallelism
    check_tensor_parallel(args, dims.tp, workload.fused_loss)
    check_context_parallel(args, dims.cp, {"seq_len": workload.seq_len})
    check_pipeline_split(
        args, dims.pp, par.pp_schedule, par.pp_stages_per_rank, par.pp_layers_per_stage
    )
    if par.zero_stage not in (1, 2, 3):
        raise PlanError(f"zero_stage = {par.zero_stage}; valid: 1, 2, 3")
    if workload.precision not in ("bf16", "fp32"):
        raise PlanError(f"precision = {workload.precision!r}; valid: bf16, fp32")
    if workload.recompute not in RECOMPUTE_MODES:
        raise PlanError(f"recompute = {workload.recompute!r}; valid: {', '.join(RECOMPUTE_MODES)}")
    if workload.recompute == "selective" and workload.recompute_every < 1:
        raise PlanError(f"recompute_every must be >= 1, got {workload.recompute_every}")
    if workload.optimizer not in OPTIMIZER_IMPLS:
        raise PlanError(f"optimizer = {workload.optimizer!r}; valid: {', '.join(OPTIMIZER_IMPLS)}")
    if workload.micro_batch < 1 or workload.seq_len < 1 or workload.microbatches < 1:
        raise PlanError("micro_batch, seq_len and microbatches must be positive")
    check_pipeline_microbatches(workload.microbatches, dims.pp, par.pp_schedule)
    if dims.cp > 1 and layout.deepspeed:
        raise PlanError("zero_stage 1 (Megatron-DeepSpeed) is planned without context parallelism")
    if workload.float8 not in FLOAT8_RECIPES:
        raise PlanError(f"float8 = {workload.float8!r}; valid: {', '.join(FLOAT8_RECIPES)}")
    if workload.float8_all_gather and workload.float8 != "tensorwise":
        raise PlanError(f"float8_all_gather with float8 = {workload.float8!r}: tensorwise only")
    if workload.adapters is not None:
        _check_adapters(workload.adapters, layout)


def _check_adapters(adapters: Adapters, layout: Layout) -> None:
    if layout.deepspeed:
        raise PlanError("adapters are planned with FSDP2 (zero_stage 2 or 3), not zero_stage 1")
    if adapters.rank < 1:
        raise PlanError(f"adapter rank = {adapters.rank}; it must be at least 1")
    unknown = sorted(set(adapters.targets) - set(ADAPTER_TARGETS))
    if unknown or not adapters.targets:
        raise PlanError(
            f"adapter targets {list(adapters.targets)}: choose from {', '.join(ADAPTER_TARGETS)}"
        )


def estimate_rank(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    pp_rank: int = 0,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> RankEstimate:
    """Every component of pipeline rank `pp_rank`'s memory."""
    validate_plan(args, layout, workload)
    prec = Precision.of(layout, workload)
    params, nf4 = split_nf4_base(
        rank_parameters(args, layout, pp_rank, workload.adapters), workload.adapters
    )
    components = model_state_components(params, layout, workload, prec)
    if nf4:
        components.append(nf4_base_component(nf4, layout))
    terms = activation_terms_for(args, layout, workload, prec)
    stage_ids = rank_stage_ids(layout, pp_rank)
    in_flight = in_flight_microbatches(layout, workload.microbatches, pp_rank)
    workings = []
    for stage_id, count in zip(stage_ids, in_flight, strict=True):
        stage_components, working = stage_activation_components(
            args, layout, workload, prec, stage_id, count, terms
        )
        components += stage_components
        components += pipeline_buffer_components(args, layout, workload, prec, stage_id, count)
        workings.append(working)
    components.append(
        backward_transient(
            args, layout, workload, prec, params, stage_ids, max(workings), device_type
        )
    )
    return RankEstimate(pp_rank, components, terms, overhead or Overhead.none())


@dataclass
class Plan:
    """The estimate of every pipeline rank; `worst` is the one that needs the most memory."""

    ranks: list[RankEstimate]

    @property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.device_bytes)


def estimate(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> Plan:
    """The estimate of every pipeline rank."""
    return Plan(
        [
            estimate_rank(args, layout, workload, r, overhead, device_type)
            for r in range(layout.dims.pp)
        ]
    )


def largest_fitting_micro_batch(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    device_bytes: int,
    local_batch: int,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> tuple[int, Plan | None]:
    """The largest micro batch dividing `local_batch` (samples per data-parallel rank per step)
    whose worst rank fits in `device_bytes`, and its plan; (0, None) if none fits."""
    best: tuple[int, Plan | None] = (0, None)
    for micro in range(1, local_batch + 1):
        if local_batch % micro:
            continue
        try:
            check_pipeline_microbatches(
                local_batch // micro, layout.dims.pp, layout.parallelism.pp_schedule
            )
        except LayoutError:
            continue
        candidate = dataclasses.replace(
            workload, micro_batch=micro, microbatches=local_batch // micro
        )
        plan = estimate(args, layout, candidate, overhead, device_type)
        if plan.worst.device_bytes <= device_bytes:
            best = (micro, plan)
    return best


def least_recompute_that_fits(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    device_bytes: int,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> tuple[Workload, Plan] | None:
    """The activation-checkpointing setting with the least recomputation that fits: recompute
    costs a forward per checkpointed block, so fewer checkpointed blocks is faster."""
    seen_counts = set()
    for mode, every in recompute_options(args.n_layer):
        candidate = dataclasses.replace(workload, recompute=mode, recompute_every=max(every, 1))
        checkpointed = sum(is_checkpointed(i, candidate) for i in range(args.n_layer))
        if checkpointed in seen_counts:
            continue  # same blocks checkpointed as a cheaper option already tried
        seen_counts.add(checkpointed)
        plan = estimate(args, layout, candidate, overhead, device_type)
        if plan.worst.device_bytes <= device_bytes:
            return candidate, plan
    return None

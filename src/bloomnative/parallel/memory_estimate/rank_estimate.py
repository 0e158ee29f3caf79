"""The per-rank estimate: every component of one pipeline rank's memory, its peak, and the
plan of all ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.layout_check import (
    check_context_parallel,
    check_pipeline_microbatches,
    check_pipeline_split,
    check_tensor_parallel,
)
from bloomnative.parallel.memory_estimate.activations import (
    block_activation_terms,
    checkpointed_block_terms,
    embedding_terms,
    head_terms,
)
from bloomnative.parallel.memory_estimate.backward import backward_transient
from bloomnative.parallel.memory_estimate.components import ActivationTerm, Component
from bloomnative.parallel.memory_estimate.inputs import (
    OPTIMIZER_IMPLS,
    RECOMPUTE_MODES,
    Layout,
    Overhead,
    PlanError,
    Precision,
    Workload,
)
from bloomnative.parallel.memory_estimate.loss import loss_saved_terms
from bloomnative.parallel.memory_estimate.model_states import model_state_components
from bloomnative.parallel.memory_estimate.parameters import rank_parameters, rank_stage_ids
from bloomnative.parallel.memory_estimate.pipeline_buffers import (
    in_flight_microbatches,
    pipeline_buffer_components,
)
from bloomnative.parallel.memory_estimate.stage_activations import stage_activation_components


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
    check_tensor_parallel(args, layout.tp, workload.fused_loss)
    check_context_parallel(args, layout.cp, {"seq_len": workload.seq_len})
    check_pipeline_split(
        args, layout.pp, layout.pp_schedule, layout.pp_stages_per_rank, layout.pp_layers_per_stage
    )
    if layout.zero_stage not in (1, 2, 3):
        raise PlanError(f"zero_stage = {layout.zero_stage}; valid: 1, 2, 3")
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
    check_pipeline_microbatches(workload.microbatches, layout.pp, layout.pp_schedule)
    if layout.cp > 1 and layout.zero_stage == 1:
        raise PlanError("zero_stage 1 (Megatron-DeepSpeed) is planned without context parallelism")


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
    params = rank_parameters(args, layout, pp_rank)
    components = model_state_components(params, layout, workload, prec)
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
        [estimate_rank(args, layout, workload, r, overhead, device_type) for r in range(layout.pp)]
    )

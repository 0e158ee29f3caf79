"""Pipelines: micro batches in flight per rank (torch.distributed.pipelining's warm-up depths)
and the schedule's receive buffers and kept outputs."""

from __future__ import annotations

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.schedules import SCHEDULES, is_interleaved
from bloomnative.planner.activations import (
    local_vocab,
    micro_batch_tokens,
    residual_stream_elements,
)
from bloomnative.planner.inputs import (
    Component,
    Layout,
    PlanError,
    Precision,
    Workload,
)


def in_flight_microbatches(layout: Layout, microbatches: int, pp_rank: int) -> list[int]:
    """Micro batches whose activations a pipeline rank holds at once, per local stage.

    GPipe: all of them. 1F1B: pp - rank (the warm-up depth), at most the micro batch count.
    Interleaved1F1B / InterleavedZeroBubble: torch's warm-up (`_get_warmup_ops`:
    (v-1) * round + f * (pp-1-rank), f = 2 resp. 1) plus the first steady-state forward, spread
    over the local stages in warm-up order. ZBVZeroBubble: 2pp - rank - 1 forwards of the
    first local stage and rank + 1 of the second (its warm-up).
    """
    pp, v, n = layout.dims.pp, layout.parallelism.pp_stages_per_rank, microbatches
    if pp == 1:
        return [1]
    schedule = layout.parallelism.pp_schedule
    if schedule == "GPipe":
        return [n] * v
    if schedule == "1F1B":
        return [min(n, pp - pp_rank)]
    if schedule == "ZBVZeroBubble":
        return [min(n, 2 * pp - pp_rank - 1), min(n, pp_rank + 1)]
    if is_interleaved(schedule):
        per_round = n // max(1, n // pp)
        factor = 2 if schedule == "Interleaved1F1B" else 1
        warmup = min((v - 1) * per_round + factor * (pp - 1 - pp_rank), n * v)
        forwards = min(warmup + 1, n * v)
        counts = [0] * v
        for step in range(forwards):
            counts[(step // per_round) % v] += 1
        return [min(c, n) for c in counts]
    raise PlanError(f"parallelism.pp_schedule = {schedule!r}; valid: {', '.join(SCHEDULES)}")


def pipeline_buffer_components(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    prec: Precision,
    stage_id: int,
    in_flight: int,
) -> list[Component]:
    """Pipeline communication buffers of one stage (b*s/t_sp*h each, the residual stream).

    torch.distributed.pipelining allocates once, per stage, a forward receive buffer for every
    micro batch (not on the first stage; the in-flight ones are the first block's input and are
    counted there) and a gradient receive buffer for every micro batch (not on the last).
    DeepSpeed's pipeline engine (zero_stage 1) receives into one buffer of each kind and clones
    the in-flight inputs. Both keep each in-flight micro batch's stage output for its backward.
    """
    if layout.dims.pp == 1:
        return []
    n = workload.microbatches
    boundary = residual_stream_elements(args, layout, workload) * prec.compute
    first, last = stage_id == 0, stage_id == layout.num_stages - 1
    deepspeed = layout.deepspeed
    name = f"pipeline stage {stage_id}"
    components = []
    if not first:
        count = 1 if deepspeed else n - in_flight
        components.append(
            Component(
                f"{name} activation receive buffers",
                count * boundary,
                "resident",
                "1 buffer (DeepSpeed)"
                if deepspeed
                else f"{n} micro batches - {in_flight} in flight (counted as block inputs)",
            )
        )
    if last and not workload.fused_loss:
        logits = micro_batch_tokens(layout, workload) * local_vocab(args, layout) * prec.compute
        if layout.pp_keeps_outputs and not deepspeed:
            components += [
                Component(
                    f"{name} logits of every micro batch (return_outputs)",
                    n * logits,
                    "resident",
                    f"{n} x b*s*V/t kept by the schedule until the next step",
                ),
                Component(
                    f"{name} merged logits at the end of the step",
                    n * logits,
                    "step_end",
                    f"torch.cat of {n} x b*s*V/t",
                ),
            ]
        else:
            components.append(
                Component(
                    f"{name} logits of in-flight micro batches",
                    in_flight * logits,
                    "fwd_bwd",
                    f"{in_flight} x b*s*V/t (the stage output, kept for backward)",
                )
            )
    if not last:
        count = 1 if deepspeed else n
        components.append(
            Component(
                f"{name} gradient receive buffers",
                count * boundary,
                "resident",
                "1 buffer (DeepSpeed)" if deepspeed else f"{n} micro batches",
            )
        )
        components.append(
            Component(
                f"{name} cached outputs",
                in_flight * boundary,
                "fwd_bwd",
                f"{in_flight} in-flight micro batches",
            )
        )
    return components

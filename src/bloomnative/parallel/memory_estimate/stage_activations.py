"""The stored activations of one pipeline stage for its micro batches in flight."""

from __future__ import annotations

from collections.abc import Iterable

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.memory_estimate.backward import block_backward_buffers
from bloomnative.parallel.memory_estimate.components import ActivationTerm, Component
from bloomnative.parallel.memory_estimate.inputs import Layout, Precision, Workload
from bloomnative.parallel.memory_estimate.parameters import stage_blocks
from bloomnative.parallel.memory_estimate.recompute import is_checkpointed


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
    per_microbatch = full * block_bytes + recomputed * ckpt_bytes
    detail = f"{in_flight} micro batch(es) x ({full} blocks x {block_bytes / 2**20:.1f} MiB"
    if recomputed:
        detail += f" + {recomputed} checkpointed x {ckpt_bytes / 2**20:.1f} MiB"
    detail += ")"
    components = [
        Component(
            f"activations: stage {stage_id} blocks", in_flight * per_microbatch, "fwd_bwd", detail
        )
    ]
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
        loss_terms = [t for t in terms["loss"] if layout.pp == 1 or t.name != "logits"]
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

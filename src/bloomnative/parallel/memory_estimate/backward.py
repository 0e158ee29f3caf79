"""The backward's working set: gradient buffers of one block, root and FSDP gradients, and the
loss's buffers, whichever is largest."""

from __future__ import annotations

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.memory_estimate.activations import micro_batch_tokens
from bloomnative.parallel.memory_estimate.components import Component
from bloomnative.parallel.memory_estimate.inputs import FP32, Layout, Precision, Workload
from bloomnative.parallel.memory_estimate.loss import loss_transient
from bloomnative.parallel.memory_estimate.model_states import gradients_persist
from bloomnative.parallel.memory_estimate.parameters import ParamTensor, unit_numels


def block_backward_buffers(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> int:
    """Gradient buffers alive while one block back-propagates (an approximation): the two
    largest activation gradients of the block (the MLP's 4h-wide ones, or the softmax's with
    materialized attention), or the ring attention's buffers with context parallelism, and the
    residual-stream gradient in and out."""
    tokens = micro_batch_tokens(layout, workload)
    mlp = 2 * tokens * (4 * args.hidden_size // layout.tp) * prec.compute
    heads = args.n_head // layout.tp
    scores = 2 * workload.micro_batch * heads * workload.seq_len**2 * prec.compute
    materialized = layout.cp == 1 and workload.attention in ("materialized", "cpu_math")
    ring = ring_attention_buffers(args, layout, workload, prec)
    widest = max(mlp, scores if materialized else 0, ring)
    stream = 2 * tokens * args.hidden_size // layout.sequence_shards * prec.compute
    return widest + stream


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
    if layout.cp == 1:
        return 0
    width = micro_batch_tokens(layout, workload) * args.hidden_size // layout.tp
    total = int((5.5 * prec.compute + 22) * width)
    if workload.attention != "flash":
        chunk = workload.seq_len // (2 * layout.cp)
        heads = args.n_head // layout.tp
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
    root_grad_bytes = prec.compute if prec.fsdp or layout.zero_stage == 1 else FP32
    working = block_working
    parts = ["block backward buffers"]
    if prec.fsdp or not gradients_persist(layout, workload):
        working += root_grad_bytes * units.get("root", 0)
        parts.append("root-unit grads")
    if prec.fsdp:
        largest_block = max((n for u, n in units.items() if u != "root"), default=0)
        working += (prec.compute + FP32) * largest_block
        parts.append("one block's unsharded grad + fp32 reduce-scatter input")
        if layout.zero_stage == 3:
            working += 2 * prec.compute * largest_block
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

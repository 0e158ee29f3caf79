"""Language-model loss: the weighted mean over every counted token of the global batch.

Each micro batch's loss is its weighted sum of token cross-entropies divided by the total
weight of the whole global batch: over all micro batches and all ranks holding different tokens.
A counted token (a label other than IGNORE_INDEX) weighs 1, or its ``loss_weights`` entry when
the micro batch has them (packed pairs with ``data.norm_target_loss``: each target sequence
weighs 1 in all, Megatron-DeepSpeed's ``--norm-target-loss``, whose denominator is likewise the
sum of the weights). Summing these over micro batches (gradient accumulation), pipeline stages
and data-parallel ranks (FSDP sums gradients, parallel/fsdp.py) gives the global weighted mean
and its gradient, whatever the layout and however unevenly masked tokens fall.

What a loss function receives besides the model's output is a micro batch's *target*
(`loss_target`): its labels, or labels and weights packed into one float32 tensor, so that a
pipeline schedule, which splits the target it is given into micro batches, keeps the two
together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from bloomnative.data.micro_batch import IGNORE_INDEX, MicroBatch
from bloomnative.kernels import linear_cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(last stage's output, target of `loss_target`) -> loss of one micro batch."""


def loss_target(micro_batch: MicroBatch) -> torch.Tensor:
    """What the loss of `micro_batch` needs besides the output: its int64 labels ``[b, s]``,
    or with ``loss_weights`` a float32 ``[b, s, 2]`` of labels and weights (float32 holds
    every token id below 2**24 exactly)."""
    if micro_batch.loss_weights is None:
        return micro_batch.labels
    return torch.stack((micro_batch.labels.float(), micro_batch.loss_weights.float()), dim=-1)


def split_target(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`loss_target`'s tensor as (int64 labels, float32 weights or None)."""
    if target.dim() == 2:
        return target, None
    return target[..., 0].long(), target[..., 1]


def cross_entropy_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Weighted sum of token cross-entropies, softmax in fp32. logits [b, s, V] (a
    vocabulary-sharded DTensor under loss parallelism), target from `loss_target`."""
    labels, weights = split_target(target)
    flat_logits, flat_labels = logits.flatten(0, 1).float(), labels.flatten()
    if weights is None:
        return F.cross_entropy(flat_logits, flat_labels, reduction="sum", ignore_index=IGNORE_INDEX)
    per_token = F.cross_entropy(
        flat_logits, flat_labels, reduction="none", ignore_index=IGNORE_INDEX
    )
    weights = weights.flatten()
    if isinstance(per_token, DTensor):  # loss parallelism: replicated per-token losses
        weights = DTensor.from_local(weights, per_token.device_mesh, per_token.placements)
    return (per_token * weights).sum()


def fused_head_cross_entropy_sum(
    hidden: torch.Tensor, head_weight: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The lm head and the weighted summed cross-entropy in one chunked op
    (bloomnative.kernels), so the [tokens, vocab] logits never exist whole. hidden [b, s, h],
    head_weight [V, h], target from `loss_target`."""
    labels, weights = split_target(target)
    return linear_cross_entropy(
        hidden.flatten(0, 1),
        head_weight,
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        token_weights=None if weights is None else weights.flatten(),
    )


def loss_weight(micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
    """What these micro batches weigh in the loss, a 0-d tensor on their device (nothing is
    read back): how many labels count (int64), or the sum of their ``loss_weights`` (float32)
    when they have them."""
    device = micro_batches[0].labels.device
    if micro_batches[0].loss_weights is not None:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for micro in micro_batches:
            assert micro.loss_weights is not None  # all micro batches of a run alike
            total += micro.loss_weights.sum()
        return total
    count = torch.zeros((), dtype=torch.int64, device=device)
    for micro in micro_batches:
        count += (micro.labels != IGNORE_INDEX).sum()
    return count


def sum_over_ranks(value: torch.Tensor, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    """`value` summed in place over the ranks of each group in turn (on the device: the host
    does not wait for it)."""
    for group in groups:
        dist.all_reduce(value, group=group)
    return value


def global_loss_weight(
    micro_batches: Sequence[MicroBatch], batch_groups: Sequence[dist.ProcessGroup]
) -> torch.Tensor:
    """The loss denominator of a step: the weight (`loss_weight`) of the global batch, i.e. of
    these micro batches summed over `batch_groups`, the process groups whose ranks hold
    different tokens of the batch (data and context parallel; pipeline and tensor-parallel
    ranks hold the same labels). Where nothing counts it is 1, so a batch without a counted
    token has loss and gradient 0."""
    total = sum_over_ranks(loss_weight(micro_batches), batch_groups)
    return torch.where(total > 0, total, torch.ones_like(total))


def weighted_mean(loss_sum: LossFn, total_weight: torch.Tensor) -> LossFn:
    """The loss closure of one step: `loss_sum` of a micro batch divided by the step's global
    loss weight (as torchtitan's rescale_accumulated_loss divides by the accumulation steps)."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_sum(output, target) / total_weight

    return loss

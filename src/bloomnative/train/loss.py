"""Language-model loss: the mean over every counted token of the global batch.

Each micro batch's loss is its token-summed cross-entropy divided by the number of counted
tokens (labels other than IGNORE_INDEX) in the whole global batch: over all micro batches and
all ranks holding different tokens. Summing these over micro batches (gradient accumulation),
pipeline stages and data-parallel ranks (FSDP sums gradients, parallel/fsdp.py) gives the
global token mean and its gradient, whatever the layout and however unevenly masked tokens fall.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bloomnative.data.loader import IGNORE_INDEX
from bloomnative.kernels import linear_cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(last stage's output, labels) -> loss of one micro batch."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, softmax in fp32. logits [b, s, V], labels [b, s]."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def fused_head_cross_entropy_sum(
    hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The lm head and the summed cross-entropy in one chunked op (bloomnative.kernels), so the
    [tokens, vocab] logits never exist whole. hidden [b, s, h], head_weight [V, h]."""
    return linear_cross_entropy(
        hidden.flatten(0, 1),
        head_weight,
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def counted_tokens(micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """How many labels of these micro batches count in the loss (an int64 0-d tensor on their
    device; nothing is read back)."""
    count = torch.zeros((), dtype=torch.int64, device=micro_batches[0][1].device)
    for _, labels in micro_batches:
        count += (labels != IGNORE_INDEX).sum()
    return count


def sum_over_ranks(value: torch.Tensor, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    """`value` summed in place over the ranks of each group in turn (on the device: the host
    does not wait for it)."""
    for group in groups:
        dist.all_reduce(value, group=group)
    return value


def global_token_count(
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    batch_groups: Sequence[dist.ProcessGroup],
) -> torch.Tensor:
    """The loss denominator of a step: counted tokens of the global batch, i.e. of these micro
    batches summed over `batch_groups`, the process groups whose ranks hold different tokens
    of the batch (data parallel; pipeline and tensor-parallel ranks hold the same labels). At
    least 1, so a batch without a counted token has loss and gradient 0."""
    return sum_over_ranks(counted_tokens(micro_batches), batch_groups).clamp_(min=1)


def token_mean(loss_sum: LossFn, token_count: torch.Tensor) -> LossFn:
    """The loss closure of one step: `loss_sum` of a micro batch divided by the step's global
    token count (as torchtitan's rescale_accumulated_loss divides by the accumulation steps)."""

    def loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum(output, labels) / token_count

    return loss

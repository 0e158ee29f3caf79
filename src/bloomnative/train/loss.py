"""Language-model loss, summed in fp32 so micro batches and ranks can be normalised exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, softmax in fp32. logits [b, s, V], labels [b, s]."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100
    )


def fused_head_cross_entropy_sum(
    hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The lm head and the summed cross-entropy in one chunked op (bloomnative.kernels), so the
    [tokens, vocab] logits never exist whole. hidden [b, s, h], head_weight [V, h]."""
    from bloomnative.kernels import linear_cross_entropy

    return linear_cross_entropy(
        hidden.flatten(0, 1), head_weight, labels.flatten(), ignore_index=-100, reduction="sum"
    )

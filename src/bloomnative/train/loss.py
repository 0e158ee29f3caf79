"""Language-model loss, summed in fp32 so micro batches and ranks can be normalised exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, softmax in fp32. logits [b, s, V], labels [b, s]."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100
    )

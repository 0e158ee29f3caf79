"""Gradient clipping by the global norm over every rank's parameters, counted once each."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    not_counted: list[nn.Parameter] = (),
) -> torch.Tensor:
    """Clips in place and returns the total L2 norm (before clipping).

    `not_counted`: parameters clipped but left out of the norm (a pipeline's second copy of the
    tied embedding, whose gradient equals the first copy's).

    A DTensor gradient's norm is reduced over its own mesh (FSDP shards, TP shards) and
    replicated DTensor placements are counted once, not once per replica: the double counting
    BLOOM's BF16 optimizer had to fix. Pipeline stages hold disjoint parameters, so their squared
    norms are summed over `pp_group`.
    """
    skip = {id(p) for p in not_counted}
    grads = [p.grad for p in parameters if p.grad is not None and id(p) not in skip]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
    return norm

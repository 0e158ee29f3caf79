"""Gradient clipping by the global norm over every rank's parameters, counted once each."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    not_counted: Sequence[nn.Parameter] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """Clips in place and returns the total L2 norm (before clipping).

    `not_counted`: parameters clipped but left out of the norm (a pipeline's second copy of the
    tied embedding, whose gradient equals the first copy's).

    A DTensor gradient's norm is reduced over its own mesh (FSDP shards, TP shards) and
    replicated DTensor placements are counted once, not once per replica: the double counting
    BLOOM's BF16 optimizer had to fix. Pipeline stages hold disjoint parameters, so their squared
    norms are summed over `pp_group`.

    `device`: where the norm is reduced when this rank holds no gradient (a LoRA pipeline rank
    whose stages have no adapters); else the gradients' device.
    """
    skip = {id(p) for p in not_counted}
    grads = [p.grad for p in parameters if p.grad is not None and id(p) not in skip]
    # Norms are computed per group of gradients sharing a layout (plain tensors, or DTensors on
    # one mesh with one placement), since DTensor ops cannot mix layouts.
    groups: dict[tuple | None, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
    squared = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else device)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        # Scaling commutes with sharding, so each rank scales its local shards.
        local = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in parameters
            if p.grad is not None
        ]
        if local:
            torch._foreach_mul_(local, coef.to(local[0].device))
    return norm

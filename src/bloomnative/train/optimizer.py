"""AdamW over one or several model parts (pipeline stages held by this rank)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from bloomnative.config import OptimizerConfig


def param_groups(parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """Decay on matrices; none on biases and LayerNorm weights (1-D tensors), as in Megatron
    and BLOOM. A parameter shared by two parts (the tied embedding) is counted once.

    Groups are further split by layout (plain tensors, or DTensors of one mesh), because the
    foreach/fused AdamW kernels run over a whole group and cannot mix them (tensor parallelism
    without sequence parallelism leaves the LayerNorms as plain tensors).
    """
    seen: dict[int, nn.Parameter] = {}
    for part in parts:
        for p in part.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for p in seen.values():
        layout = id(p.device_mesh) if isinstance(p, DTensor) else None
        groups[(p.ndim >= 2, layout)].append(p)
    return [
        {"params": params, "weight_decay": weight_decay if decay else 0.0}
        for (decay, _), params in groups.items()
    ]


def build_optimizer(parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """torch.optim.AdamW with the kernel `cfg.implementation` names, which must be resolved
    (`OptimizerConfig.kernel`; train/resolved.py resolves it for the trainer)."""
    impl = cfg.implementation
    if impl == "auto":
        raise ValueError('optimizer.implementation = "auto" must be resolved before building')
    return torch.optim.AdamW(
        param_groups(parts, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )

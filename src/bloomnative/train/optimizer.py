"""AdamW over one or several model parts (pipeline stages held by this rank)."""

from __future__ import annotations

from collections import defaultdict
from typing import cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from bloomnative.config import OptimizerConfig, OptimizerImpl


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


def adamw_implementation(requested: str, device_type: str) -> OptimizerImpl:
    """The AdamW kernel optimizer.implementation stands for: "auto" is the fused kernel on CUDA
    (no temporaries, and it skips a non-finite step on the device: train/nonfinite.py) and the
    foreach one elsewhere."""
    if requested != "auto":
        return cast(OptimizerImpl, requested)
    return "fused" if device_type == "cuda" else "foreach"


def build_optimizer(parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """torch.optim.AdamW with the kernel `cfg.implementation` names, which must be resolved
    (`adamw_implementation`; train/run.py resolves it for the trainer)."""
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

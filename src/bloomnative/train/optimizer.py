"""AdamW over one or several model parts (pipeline stages held by this rank)."""

from __future__ import annotations

import torch
import torch.nn as nn

from bloomnative.config import OptimizerConfig


def param_groups(parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """Decay on matrices; none on biases and LayerNorm weights (1-D tensors), as in Megatron
    and BLOOM. A parameter shared by two parts (the tied embedding) is counted once."""
    seen: dict[int, nn.Parameter] = {}
    for part in parts:
        for p in part.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    decay = [p for p in seen.values() if p.ndim >= 2]
    no_decay = [p for p in seen.values() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(parts: list[nn.Module], cfg: OptimizerConfig, device: torch.device):
    """torch.optim.AdamW; the fused kernel on CUDA, the foreach one elsewhere (by default)."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    return torch.optim.AdamW(
        param_groups(parts, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )

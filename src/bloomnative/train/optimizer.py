"""AdamW over one or several model parts (pipeline stages held by this rank): torch.optim.AdamW
with fp32 moments, bloomnative's AdamWBF16 with bf16 ones rounded stochastically, or torchao's
AdamW8bit with 8-bit block-quantized ones (optimizer.state_dtype)."""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from bloomnative.config import ConfigError, OptimizerConfig
from bloomnative.train.bf16_adamw import AdamWBF16


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


def check_state_library(cfg: OptimizerConfig) -> None:
    """Raises ConfigError (one line) when `cfg.state_dtype` needs a library that cannot be
    imported (torchao for "8bit"; "fp32" and "bf16" need none)."""
    if cfg.state_dtype != "8bit":
        return
    try:
        import torchao.optim  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"optimizer.state_dtype = {cfg.state_dtype!r} needs the torchao package, which "
            f"{sys.executable} cannot import ({e}): pip install 'bloomnative[lowbit]', or set "
            f'optimizer.state_dtype = "fp32"'
        ) from None


def reads_tensor_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` must be given its learning rate as a tensor: torchao's optimizers
    refuse a number (torch.optim.AdamW takes either)."""
    return type(optimizer).__module__.startswith("torchao.")


def trains(part: nn.Module) -> bool:
    """Whether any parameter of `part` trains (one that a LoRA run does not freeze)."""
    return any(p.requires_grad for p in part.parameters())


def build_optimizer(parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The AdamW `cfg.state_dtype` names: torch.optim.AdamW ("fp32") with the kernel
    `cfg.implementation` names, which must be resolved (`OptimizerConfig.kernel`;
    train/resolved.py resolves it for the trainer), AdamWBF16 ("bf16": train/bf16_adamw.py), or
    torchao.optim.AdamW8bit ("8bit", its default block size of 256)."""
    groups = param_groups(parts, cfg.weight_decay)
    hyper: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if cfg.state_dtype == "bf16":
        return AdamWBF16(groups, **hyper)
    if cfg.state_dtype == "8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, **hyper)
    impl = cfg.implementation
    if impl == "auto":
        raise ValueError('optimizer.implementation = "auto" must be resolved before building')
    return torch.optim.AdamW(groups, **hyper, fused=impl == "fused", foreach=impl == "foreach")

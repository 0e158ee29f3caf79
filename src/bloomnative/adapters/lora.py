"""Low-rank adapters (LoRA, Hu et al. 2021) on a `Bloom`, applied from outside the model, as
Hugging Face PEFT defines them, so that an adapter trained here loads in PEFT and back.

An adapted linear layer computes `x W^T + b + (alpha / r) * B(A(dropout(x)))` with A `[r, in]`
and B `[out, r]`; A starts Kaiming-uniform (PEFT's `a = sqrt(5)`: uniform in +-1/sqrt(in)) and B
at zero, so the adapted model starts equal to the base. The layer stays an `nn.Linear` (its class
is swapped for `LoRALinear` in place), so the base's parameter names, and everything keyed on
them (the parallel plans, checkpoints, Hugging Face export), do not change; the adapter adds
`<layer>.lora_a.weight` and `<layer>.lora_b.weight`.

A layer that is already a subclass of `nn.Linear` with a matmul of its own (torchao's FP8
`Float8Linear`, `[quantize] linear`, applied first) keeps it: its class becomes a subclass of
both (`adapted_class`), whose forward is the layer's own plus the update, so the frozen base
computes in FP8 and the adapter's A and B in the run's dtype.
"""

from __future__ import annotations

import math
import typing
import zlib
from collections.abc import Iterator, Sequence
from typing import cast

import torch
import torch.nn as nn

from bloomnative.config import LoRATarget
from bloomnative.interop.adapter_state import lora_delta
from bloomnative.model import Bloom, BloomArgs
from bloomnative.parallel.init import InitialValue

TARGET_MODULES: tuple[str, ...] = typing.get_args(LoRATarget)
"""The linear layers of a BLOOM block an adapter may target, by their Hugging Face names."""
DEFAULT_TARGETS = ("query_key_value",)
"""PEFT's default for BLOOM (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`)."""
ADAPTER_PARAMETERS = ("lora_a.weight", "lora_b.weight")


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank update beside it (module docstring). Made by
    `apply_lora` from an existing layer, never constructed directly."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_b(self.lora_a(self.lora_dropout(x)))
        # The base layer's own forward: nn.Linear's, or the next class in an `adapted_class`.
        return super().forward(x) + update * self.scaling


_ADAPTED_CLASSES: dict[type[nn.Linear], type[LoRALinear]] = {nn.Linear: LoRALinear}


def adapted_class(base: type[nn.Linear]) -> type[LoRALinear]:
    """The class an adapted layer of class `base` gets: `LoRALinear` for a plain `nn.Linear`,
    else a subclass of both (one per `base`), whose forward adds the update to `base`'s."""
    if base not in _ADAPTED_CLASSES:
        _ADAPTED_CLASSES[base] = type(f"LoRA{base.__name__}", (LoRALinear, base), {})
    return _ADAPTED_CLASSES[base]


def base_class(layer: LoRALinear) -> type[nn.Linear]:
    """The class `layer` had before `apply_lora` adapted it."""
    return cast(
        type[nn.Linear], next(c for c in type(layer).__mro__ if not issubclass(c, LoRALinear))
    )


def _target_layers(model: Bloom, targets: Sequence[str]) -> Iterator[tuple[str, nn.Linear]]:
    """(name, layer) of every targeted linear layer of the model's blocks."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in targets and isinstance(module, nn.Linear):
            if name.startswith("layers."):
                yield name, module


def check_targets(targets: Sequence[str]) -> None:
    """Raises ValueError naming a target that is not one of `TARGET_MODULES`."""
    if not targets:
        raise ValueError(f"no target modules: choose from {', '.join(TARGET_MODULES)}")
    for target in targets:
        if target not in TARGET_MODULES:
            raise ValueError(
                f"unknown target module {target!r}: BLOOM's linear layers are "
                f"{', '.join(TARGET_MODULES)}"
            )


def apply_lora(
    model: Bloom,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
) -> list[str]:
    """Adds a rank-`rank` adapter to each targeted linear layer of `model`'s blocks (a whole
    model or a pipeline stage, on any device, the meta device included) and freezes every other
    parameter. Returns the adapted layers' names. The adapter's weights are left uninitialised
    where the model is on the meta device; `init_lora` or `lora_initial_value` fills them.

    Apply it after FP8 (`parallel.apply_float8`, whose linears it keeps: `adapted_class`),
    before the parallel plans (it only adds `nn.Linear`s, which they shard like any other) and
    before the optimizer is built (only trainable parameters go in it).
    """
    check_targets(targets)
    if rank < 1:
        raise ValueError(f"a LoRA rank must be at least 1, got {rank}")
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for name, layer in list(_target_layers(model, targets)):
        device, dtype = layer.weight.device, layer.weight.dtype
        layer.__class__ = adapted_class(type(layer))
        lora = cast(LoRALinear, layer)
        lora.lora_a = nn.Linear(layer.in_features, rank, bias=False, device=device, dtype=dtype)
        lora.lora_b = nn.Linear(rank, layer.out_features, bias=False, device=device, dtype=dtype)
        lora.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        lora.scaling = alpha / rank
        adapted.append(name)
    for block in model.blocks():
        if isinstance(block.mlp.dense_h_to_4h, LoRALinear):
            # The fused bias + GeLU multiplies by dense_h_to_4h's weight itself, which would skip
            # the adapter: the layer's own forward runs instead (the same function, unfused).
            block.mlp.fused_bias_gelu = False
    return adapted


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Stores every frozen parameter of `model` (the base, once `apply_lora` has frozen it) in
    `dtype`, on any device, the meta device included. In a bf16 run every weight is used as a
    bf16 copy (FSDP2's MixedPrecisionPolicy casts the fp32 shard); a frozen weight has no update
    to accumulate, so its fp32 master copy holds nothing that the bf16 one lacks, and the copy
    FSDP2 gathers is the same rounding. Apply it before FSDP2 (which records each parameter's
    dtype; it needs one dtype among the trainable parameters only) and before the base's
    weights are loaded (they are rounded as they are copied in).

    Each frozen parameter is replaced by a new one (tied ones by one new parameter): assigning
    `.data` would change a tensor subclass's outer dtype only, not the tensor it wraps
    (torchao's FP8 all-gather weight, `parallel.float8`)."""
    stored: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad:
                continue
            if id(param) not in stored:
                stored[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            setattr(module, name, stored[id(param)])


def adapter_shapes(
    args: BloomArgs, rank: int, targets: Sequence[str] = DEFAULT_TARGETS
) -> dict[str, torch.Size]:
    """The adapters' parameters of a whole model with `args`, by name: their shapes (from an
    adapted model on the meta device, so they are the model's own)."""
    with torch.device("meta"):
        model = Bloom(args)
    apply_lora(model, rank, alpha=1.0, targets=targets)
    return {n: p.shape for n, p in model.named_parameters() if is_adapter_parameter(n)}


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter `name` (of a model `apply_lora` adapted) belongs to an adapter."""
    return name.endswith(ADAPTER_PARAMETERS)


def lora_initial_value(base: InitialValue) -> InitialValue:
    """`Bloom.initial_value` extended to the adapters' parameters, by name (so every parallel
    layout starts from the same adapters, as from the same base; `parallel.init_weights` takes
    it): A Kaiming-uniform from a generator of its own seeded by (seed, name), B zero."""

    def initial_value(name: str, like: torch.Tensor, seed: int) -> torch.Tensor:
        if name.endswith("lora_b.weight"):
            return torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        if not name.endswith("lora_a.weight"):
            return base(name, like, seed)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        value = torch.empty(like.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        return value.to(device=like.device, dtype=like.dtype)

    return initial_value


@torch.no_grad()
def init_lora(model: Bloom, seed: int = 0) -> None:
    """Gives the adapters of a model that is not sharded their initial values
    (`lora_initial_value`); the base is left as it is."""
    initial_value = lora_initial_value(model.initial_value)
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            param.copy_(initial_value(name, param, seed))


def describe_adapters(parts: Sequence[nn.Module]) -> str:
    """One line: the adapted layers and the trainable share of the parameters of `parts` (the
    model parts a rank holds; a sharded parameter counts whole)."""
    params = {id(p): p for part in parts for p in part.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    layers = [m for part in parts for m in part.modules() if isinstance(m, LoRALinear)]
    rank = layers[0].lora_a.weight.shape[0] if layers else 0
    return (
        f"LoRA adapters of rank {rank} on {len(layers)} layers: {trainable:,} trainable "
        f"parameters of {total:,} ({100 * trainable / max(total, 1):.2f}%), the base frozen"
    )


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by their names in `model`."""
    return {
        name: param.detach()
        for name, param in model.named_parameters()
        if is_adapter_parameter(name)
    }


@torch.no_grad()
def merge_lora(model: Bloom) -> None:
    """Folds every adapter into its layer's weight (`W + (alpha / r) B A`, what PEFT's
    `merge_and_unload` computes) and turns the layers back into plain `nn.Linear`s: the model is
    a plain `Bloom` again, with every parameter trainable."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            delta = lora_delta(module.lora_a.weight, module.lora_b.weight, module.scaling)
            module.weight.add_(delta.to(module.weight.dtype))
            del module.lora_a, module.lora_b, module.lora_dropout, module.scaling
            cast(nn.Linear, module).__class__ = base_class(module)
    for block in model.blocks():
        block.mlp.fused_bias_gelu = model.args.fused_kernels
    for param in model.parameters():
        param.requires_grad_(True)

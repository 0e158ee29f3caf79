"""Low-rank adapters (bloomnative.adapters) in a model's state dict: a checkpoint of a run with
`[lora]` holds `<layer>.lora_a.weight` [r, in] and `<layer>.lora_b.weight` [out, r] beside each
adapted layer's weight. Reading such a checkpoint as a plain `Bloom` (to sample from it, to
export it) folds each adapter into its layer: `W + (alpha / r) B A`, as PEFT's
`merge_and_unload` does."""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch

LORA_A, LORA_B = ".lora_a.weight", ".lora_b.weight"


class CheckpointFormatError(ValueError):
    """A model folder or checkpoint that cannot be converted: says which file, which key, what
    was found and what is valid. (Defined here, the first module of `interop` to raise it.)"""


def is_adapter_entry(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The adapter's update of its layer's weight, `scaling * B A`, in fp32."""
    return (b.float() @ a.float()) * scaling


def fold_adapters(
    state: dict[str, torch.Tensor], alpha: float, source: str | Path
) -> dict[str, torch.Tensor]:
    """`state` with each adapter folded into its layer's weight (in the weight's dtype) and the
    adapter entries removed. Raises CheckpointFormatError for an adapter without its pair or
    its layer."""
    folded = {name: t for name, t in state.items() if not is_adapter_entry(name)}
    for name in sorted(n for n in state if is_adapter_entry(n)):
        layer = name.removesuffix(LORA_A).removesuffix(LORA_B)
        if f"{layer}{LORA_A}" not in state or f"{layer}{LORA_B}" not in state:
            raise CheckpointFormatError(f"{source}: adapter {name} has no {LORA_A}/{LORA_B} pair")
        if f"{layer}.weight" not in folded:
            raise CheckpointFormatError(f"{source}: adapter {name} has no layer {layer}.weight")
        if name.endswith(LORA_A):
            a, b, weight = state[name], state[f"{layer}{LORA_B}"], folded[f"{layer}.weight"]
            folded[f"{layer}.weight"] = weight + lora_delta(a, b, alpha / a.shape[0]).to(
                weight.dtype
            )
    return folded


def lora_alpha(run_config: Path, source: str | Path) -> float:
    """`lora.alpha` of the run config that trained the adapters of `source`."""
    try:
        with run_config.open("rb") as f:
            lora = tomllib.load(f).get("lora", {})
    except FileNotFoundError:
        raise CheckpointFormatError(
            f"{source} holds LoRA adapters, and their scale comes from lora.alpha of the run's "
            f"config, {run_config}, which does not exist"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise CheckpointFormatError(f"{run_config}: not valid TOML ({e})") from None
    alpha = lora.get("alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise CheckpointFormatError(
            f"{run_config}: lora.alpha = {alpha!r}, but {source} holds LoRA adapters: a positive "
            "number is needed to fold them into the weights"
        )
    return float(alpha)

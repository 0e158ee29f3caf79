"""Hugging Face PEFT adapter folders <-> bloomnative's LoRA adapters (`lora`).

A PEFT LoRA folder holds adapter_config.json (the settings: `r`, `lora_alpha`, `lora_dropout`,
`target_modules`, ...) and adapter_model.safetensors, whose tensors are named as in PEFT's model
around `BloomForCausalLM` without the adapter's name:

    base_model.model.transformer.h.3.self_attention.query_key_value.lora_A.weight   (PEFT)
    layers.3.self_attention.query_key_value.lora_a.weight                        (bloomnative)

Only what plain LoRA on whole BLOOM linear layers means is read: a folder that asks for more
(DoRA, per-layer ranks, extra trained modules, a bias, ...) is refused in one line naming the
folder and the key, and the weights are read from safetensors only (a pickled
adapter_model.bin is never loaded). rsLoRA (`use_rslora`, scale alpha/sqrt(r)) is read as the
plain LoRA of the same scale: alpha * sqrt(r) over r.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from bloomnative.adapters.lora import (
    TARGET_MODULES,
    LoRALinear,
    adapter_state_dict,
    check_targets,
    is_adapter_parameter,
)
from bloomnative.config import LoRAConfig
from bloomnative.interop import CheckpointFormatError
from bloomnative.interop.hf import hf_name, native_name
from bloomnative.interop.native_checkpoint import staged_output_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
"""What older PEFT versions (and `safe_serialization=False`) write: a pickle, never loaded here."""
PEFT_PREFIX = "base_model.model."
"""The prefix of every tensor name in a PEFT folder: PEFT's model holds transformers' model."""
_SUFFIXES = {".lora_a.weight": ".lora_A.weight", ".lora_b.weight": ".lora_B.weight"}
_READ = {"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora"}
_NEUTRAL = {
    # What an adapter's folder records about where it came from, or how it was started, which
    # does not change what it computes.
    "base_model_name_or_path",
    "revision",
    "task_type",
    "inference_mode",
    "peft_version",
    "auto_mapping",
    "init_lora_weights",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "layers_pattern",
    "megatron_core",
    "qalora_group_size",
    "ensure_weight_tying",
    "runtime_config",
}
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
"""init_lora_weights values that rewrite the base's weights as the adapter starts: such an
adapter applies to that rewritten base, not to the model it names."""


# ---------------------------------------------------------------- names


def peft_key(native: str) -> str:
    """`layers.3.mlp.dense_4h_to_h.lora_b.weight` ->
    `base_model.model.transformer.h.3.mlp.dense_4h_to_h.lora_B.weight`."""
    for ours, theirs in _SUFFIXES.items():
        if native.endswith(ours):
            return PEFT_PREFIX + hf_name(native.removesuffix(ours)) + theirs
    raise ValueError(f"{native} is not an adapter's parameter (*.lora_a.weight, *.lora_b.weight)")


def native_key(key: str, source: str | Path) -> str:
    """The inverse of `peft_key`; raises CheckpointFormatError naming `key` when it is not a
    LoRA tensor of a BLOOM block's linear layer."""
    for ours, theirs in _SUFFIXES.items():
        if key.startswith(PEFT_PREFIX) and key.endswith(theirs):
            layer = native_name(key.removeprefix(PEFT_PREFIX).removesuffix(theirs))
            if layer.startswith("layers.") and layer.rpartition(".")[2] in TARGET_MODULES:
                return layer + ours
    raise CheckpointFormatError(
        f"{source}: tensor {key} is not a LoRA weight of a BLOOM linear layer "
        f"({PEFT_PREFIX}transformer.h.N.<{'|'.join(TARGET_MODULES)}>.lora_A/lora_B.weight)"
    )


# ---------------------------------------------------------------- writing


def save_peft_adapter(
    model_or_state: nn.Module | Mapping[str, torch.Tensor],
    out_dir: str | Path,
    lora: LoRAConfig,
    base_model_name_or_path: str = "",
    overwrite: bool = False,
) -> Path:
    """Writes the adapters of an adapted model (or a state dict holding them under their names
    in one) as a PEFT folder: adapter_config.json (`lora`'s rank, alpha, dropout and targets;
    `base_model_name_or_path` when given) and adapter_model.safetensors, in the tensors' dtype.
    The folder appears complete or not at all; an existing non-empty one is replaced only with
    `overwrite`. Raises CheckpointFormatError when the adapters are not `lora`'s."""
    if isinstance(model_or_state, nn.Module):
        state = adapter_state_dict(model_or_state)
    else:
        state = {n: t for n, t in model_or_state.items() if is_adapter_parameter(n)}
    check_adapter_state(state, lora, "the adapters to save", "the LoRA settings")
    tensors = {peft_key(n): t.detach().to("cpu").contiguous() for n, t in sorted(state.items())}
    config = peft_config(lora, base_model_name_or_path)
    with staged_output_dir(out_dir, overwrite) as staging:
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return Path(out_dir)


def peft_config(lora: LoRAConfig, base_model_name_or_path: str = "") -> dict[str, Any]:
    """adapter_config.json of plain LoRA adapters with `lora`'s settings, for a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


# ---------------------------------------------------------------- reading


def read_peft_adapter(folder: str | Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """(settings, adapter tensors under bloomnative's names) of a PEFT LoRA folder. The settings'
    alpha is the plain-LoRA alpha of the folder's scale (rsLoRA's lora_alpha * sqrt(r)). Raises
    CheckpointFormatError (one line naming the folder and the key) for a folder that is not
    plain LoRA on BLOOM's linear layers, or whose tensors are not the adapters its config says."""
    folder = Path(folder)
    lora = _settings(_read_config(folder), folder / ADAPTER_CONFIG)
    state = _read_weights(folder)
    check_adapter_state(state, lora, folder / ADAPTER_WEIGHTS, ADAPTER_CONFIG)
    return lora, state


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointFormatError(f"{folder} is not a PEFT adapter folder: no {ADAPTER_CONFIG}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{path}: not a JSON object")
    return config


def _settings(config: dict[str, Any], path: Path) -> LoRAConfig:
    """The LoRAConfig a PEFT config describes, once it has been found to be plain LoRA."""
    if config.get("peft_type") != "LORA":
        raise CheckpointFormatError(
            f"{path}: peft_type = {config.get('peft_type')!r}; only LORA adapters load here"
        )
    _check_plain_lora(config, path)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not _is_number(rank) or rank != int(rank) or rank < 1:
        raise CheckpointFormatError(f"{path}: r = {rank!r} is not a rank (a whole number >= 1)")
    if not _is_number(alpha) or alpha <= 0:
        raise CheckpointFormatError(f"{path}: lora_alpha = {alpha!r} is not a positive number")
    dropout = config.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise CheckpointFormatError(f"{path}: lora_dropout = {dropout!r} is not in [0, 1)")
    if config.get("use_rslora"):  # scale alpha / sqrt(r): the plain alpha of that scale
        alpha = alpha * math.sqrt(rank)
    targets = _targets(config.get("target_modules"), path)
    return LoRAConfig(
        rank=int(rank), alpha=float(alpha), dropout=float(dropout), target_modules=targets
    )


def _check_plain_lora(config: dict[str, Any], path: Path) -> None:
    """Refuses a config that sets anything beyond plain LoRA: a bias, a base-changing
    initialisation, or any other option (DoRA, rank_pattern, modules_to_save, ...) switched on."""
    if config.get("bias", "none") != "none":
        raise CheckpointFormatError(
            f"{path}: bias = {config['bias']!r}: the adapter trained biases of the base; only "
            "'none' loads here"
        )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise CheckpointFormatError(
            f"{path}: init_lora_weights = {init!r} rewrote the base model's weights, so the "
            "adapter does not apply to the base; save it converted to plain LoRA (PEFT's "
            "path_initial_model_for_weight_conversion)"
        )
    for key, value in config.items():
        if key not in _READ | _NEUTRAL and value not in (None, False, {}, []):
            raise CheckpointFormatError(
                f"{path}: {key} = {json.dumps(value)} is not supported: bloomnative's adapters "
                "are plain LoRA on whole linear layers"
            )


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _targets(value: Any, path: Path) -> list:
    """target_modules as BLOOM's linear layers: a list of their names, or "all-linear"."""
    if value == "all-linear":
        return list(TARGET_MODULES)
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise CheckpointFormatError(
            f"{path}: target_modules = {json.dumps(value)}: expected a list of layer names "
            f'({", ".join(TARGET_MODULES)}) or "all-linear"'
        )
    try:
        check_targets(value)
    except ValueError as e:
        raise CheckpointFormatError(f"{path}: target_modules: {e}") from None
    return list(value)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        if (folder / PICKLED_WEIGHTS).is_file():
            raise CheckpointFormatError(
                f"{folder / PICKLED_WEIGHTS}: a pickle, which is not loaded (it can run code); "
                "re-save the adapter as safetensors (PEFT's save_pretrained does by default)"
            )
        raise CheckpointFormatError(f"{folder} has no {ADAPTER_WEIGHTS}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {native_key(key, path): f.get_tensor(key) for key in f.keys()}
    except SafetensorError as e:
        raise CheckpointFormatError(f"{path}: not a readable safetensors file: {e}") from None


# ---------------------------------------------------------------- checking and loading


def check_adapter_state(
    state: Mapping[str, torch.Tensor], lora: LoRAConfig, source: str | Path, against: str
) -> None:
    """Raises CheckpointFormatError unless `state` holds an A `[rank, in]` and a B `[out, rank]`
    for every layer it adapts, of `lora`'s rank, on exactly `lora`'s target modules (`against`:
    where `lora` comes from, for the message)."""
    if not state:
        raise CheckpointFormatError(f"{source}: no LoRA adapters")
    for layer in sorted(_layers_of(state)):
        pair = [state.get(f"{layer}{suffix}") for suffix in _SUFFIXES]
        if any(t is None or t.dim() != 2 for t in pair):
            raise CheckpointFormatError(
                f"{source}: {layer} has no A [r, in] and B [out, r] pair of adapter weights"
            )
    _check_same("rank", _ranks(state), {lora.rank}, source, against)
    _check_same("target modules", _targets_of(state), set(lora.target_modules), source, against)


@torch.no_grad()
def load_adapter_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    source: str | Path,
    scaling: float | None = None,
) -> None:
    """Copies adapter tensors (bloomnative's names) into the adapters of `model` (adapted by
    `apply_lora`, not sharded), each in its parameter's dtype. Raises CheckpointFormatError
    naming what differs, before anything is copied, when `state` holds other adapters than the
    model's (another rank, other target modules, other layers, another shape) or, with
    `scaling`, when the model's adapters scale by another alpha/r."""
    params = adapter_state_dict(model)
    if not params:
        raise CheckpointFormatError(
            f"the model has no adapters to load {source} into (apply_lora first)"
        )
    against = "the model's adapters"
    _check_same("rank", _ranks(state), _ranks(params), source, against)
    _check_same("target modules", _targets_of(state), _targets_of(params), source, against)
    _check_same("adapter weights", set(state), set(params), source, against)
    for name, param in params.items():
        if state[name].shape != param.shape:
            raise CheckpointFormatError(
                f"{source}: {name} is {tuple(state[name].shape)}, {tuple(param.shape)} in {against}"
            )
    if scaling is not None:
        scales = {m.scaling for m in model.modules() if isinstance(m, LoRALinear)}
        if any(not math.isclose(s, scaling, rel_tol=1e-6) for s in scales):
            raise CheckpointFormatError(
                f"{source}: its adapters scale by alpha/r = {scaling:g}, {against} by "
                f"{_listed(scales)} (apply_lora with the folder's lora_alpha)"
            )
    for name, param in params.items():
        param.copy_(state[name])


def _check_same(what: str, found: set, expected: set, source: str | Path, against: str) -> None:
    """Raises CheckpointFormatError naming the values of `source` and of `against` (their
    counts and the first that differ, when there are many) unless they are the same."""
    if found == expected:
        return
    if len(found | expected) <= 4:
        detail = f"{_listed(found)} here, {_listed(expected)} in {against}"
    else:
        missing, extra = sorted(expected - found), sorted(found - expected)
        detail = f"{len(found)} here, {len(expected)} in {against}"
        detail += f"; {missing[0]} is missing" if missing else ""
        detail += f"; {extra[0]} is not in {against}" if extra else ""
    raise CheckpointFormatError(f"{source}: {what}: {detail}")


def _listed(values: set) -> str:
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in sorted(values))


def _ranks(state: Mapping[str, torch.Tensor]) -> set[int]:
    """The ranks of the adapter weights: A's rows, B's columns."""
    return {t.shape[0] if n.endswith(".lora_a.weight") else t.shape[-1] for n, t in state.items()}


def _targets_of(state: Mapping[str, torch.Tensor]) -> set[str]:
    return {n.split(".")[-3] for n in state}


def _layers_of(state: Mapping[str, torch.Tensor]) -> set[str]:
    return {n.rsplit(".", 2)[0] for n in state}


def load_peft_adapter(model: nn.Module, folder: str | Path) -> LoRAConfig:
    """Loads the PEFT LoRA folder `folder` into the adapters of `model` (adapted by `apply_lora`
    with the folder's rank, targets and alpha; not sharded) and returns its settings. Raises
    CheckpointFormatError (`read_peft_adapter`, `load_adapter_state`), leaving the model as it
    was, when the folder cannot be read or holds other adapters than the model's."""
    lora, state = read_peft_adapter(folder)
    load_adapter_state(model, state, folder, scaling=lora.alpha / lora.rank)
    return lora

"""The model's state-dict naming, shared by checkpoints and converters.

BLOOM ties the output head to the word embedding. A checkpoint stores that tensor once, under
the embedding's name, whatever the layout: a last pipeline stage holds the head without the
embedding, so its copy is renamed on the way out and on the way in. Names are otherwise the
modules' own fully qualified names, so state written by one parallel layout loads under any
other.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

# torchao's FP8 all-gather weight (`fsdp_float8_all_gather`, parallel/float8.py), found by its
# module so that this file does not import torchao.
_FLOAT8_WEIGHT = ("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor")

EMBEDDING = "word_embeddings.weight"
TIED_HEAD = "lm_head.weight"


def owns_head_copy(part: nn.Module) -> bool:
    """A last pipeline stage: it has the head but not the embedding it is tied to."""
    return (
        getattr(part, "word_embeddings", None) is None
        and getattr(part, "lm_head", None) is not None
    )


def canonical_key(key: str, to_canonical: bool = True) -> str:
    """A key of a head-owning stage's (optimizer) state under the canonical name, or back."""
    src, dst = (TIED_HEAD, EMBEDDING) if to_canonical else (EMBEDDING, TIED_HEAD)
    return key.replace(f".{src}.", f".{dst}.")


def stored_tensor(value: Any) -> Any:
    """`value` as a state dict hands it to a checkpoint: a tensor (or a DTensor's local
    tensor) of torchao's FP8 all-gather class is the plain tensor it wraps, sharing its
    storage, so a checkpoint holds plain tensors (nothing to unpickle) and loading into it
    writes the weight. Anything else is `value` itself."""
    module = sys.modules.get(_FLOAT8_WEIGHT[0])
    if module is None or not isinstance(value, torch.Tensor):
        return value
    wrapper = getattr(module, _FLOAT8_WEIGHT[1])
    if isinstance(value, DTensor) and isinstance(value._local_tensor, wrapper):
        return DTensor.from_local(
            value._local_tensor._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value._tensor if isinstance(value, wrapper) else value


def model_state(parts: Sequence[nn.Module], frozen: bool = True) -> dict[str, torch.Tensor]:
    """Model state of the parts (whole model or pipeline stages) under canonical names, plain
    tensors (`stored_tensor`): the tied head is stored once, as the embedding. `frozen`: with
    the parameters that do not train (requires_grad False), else without them."""
    options = StateDictOptions(ignore_frozen_params=not frozen)
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        sd: dict[str, Any] = {
            k: stored_tensor(v) for k, v in get_model_state_dict(part, options=options).items()
        }
        if owns_head_copy(part) and TIED_HEAD in sd:
            sd[EMBEDDING] = sd.pop(TIED_HEAD)
        else:
            sd.pop(TIED_HEAD, None)
        state.update(sd)
    return state


def load_model_state(
    parts: Sequence[nn.Module], state: dict[str, torch.Tensor], full: bool = False
) -> None:
    """Copies canonical-name `state` into the parts. `full`: the tensors are whole (e.g. from a
    Hugging Face folder) and each rank takes its shard of them."""
    options = StateDictOptions(strict=False, full_state_dict=full)
    for part in parts:
        # In the module's order on every rank: with `full`, each tensor is scattered from rank
        # 0 in turn (a set's order differs between processes: string hashes are salted).
        sd: dict[str, Any] = {k: state[k] for k in get_model_state_dict(part) if k in state}
        if owns_head_copy(part) and EMBEDDING in state:
            sd[TIED_HEAD] = state[EMBEDDING]
        set_model_state_dict(part, sd, options=options)

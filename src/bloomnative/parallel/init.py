"""Weight initialisation of a model whose parameters may be DTensors (TP and/or FSDP shards)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from bloomnative.model import Bloom
from bloomnative.parallel.activation_checkpoint import canonical_name

InitialValue = Callable[[str, torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def init_weights(model: Bloom, seed: int, initial_value: InitialValue | None = None) -> None:
    """Gives every parameter the value `initial_value` (default `model.initial_value`; with
    adapters `adapters.lora_initial_value` of it) defines for its name, whatever the layout: a
    sharded parameter receives its slice of the full initial tensor, so every parallel layout
    starts from the weights of the single-process run. Re-ties the head first."""
    value_of = initial_value or model.initial_value
    model.tie_weights()
    for name, param in model.named_parameters():
        name = canonical_name(name)
        if isinstance(param, DTensor):
            full = value_of(name, param.to_local().new_empty(param.shape), seed)
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(value_of(name, param, seed))
    model.init_buffers()

"""Weight initialisation of a model whose parameters may be DTensors (TP and/or FSDP shards)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from bloomnative.model import Bloom
from bloomnative.parallel.activation_checkpoint import canonical_name


@torch.no_grad()
def init_weights(model: Bloom, seed: int) -> None:
    """Gives every parameter the value `model.initial_value` defines for its name, whatever the
    layout: a sharded parameter receives its slice of the full initial tensor, so every parallel
    layout starts from the weights of the single-process run. Re-ties the head first."""
    model.tie_weights()
    for name, param in model.named_parameters():
        name = canonical_name(name)
        if isinstance(param, DTensor):
            full = model.initial_value(name, param.to_local().new_empty(param.shape), seed)
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(model.initial_value(name, param, seed))
    model.init_buffers()

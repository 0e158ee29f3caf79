"""Tensor, sequence and loss parallelism for `Bloom` with DTensor (Megatron's layout).

Per block: QKV and dense_h_to_4h are column-parallel (each rank computes whole heads / a slice of
the MLP width), the attention output dense and dense_4h_to_h are row-parallel. With sequence
parallelism the LayerNorms and the residual stream between blocks are sharded along the
sequence, turning each all-reduce into a reduce-scatter + all-gather pair. A low-rank adapter
beside a sharded layer (bloomnative.adapters) is sharded to match it (`COLUMN_PLACEMENTS`,
`ROW_PLACEMENTS`). The embedding is
vocab-parallel, and with loss parallelism the head's output stays sharded over the vocabulary
into the cross-entropy, so the 250,880-wide logits never exist whole on one rank. Dropout
follows parallel/dropout_rng.py's rule: under SP every dropout is on a sharded tensor and the
rank's own stream; without SP attention forks a per-rank stream.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from bloomnative.model import Bloom
from bloomnative.model.bloom import BloomAttention
from bloomnative.parallel.dropout_rng import fork_attention_dropout

# Where each parameter of a sharded linear layer lives, by its name in the layer. A low-rank
# adapter beside the layer, y = x W^T + b + s B(A(x)) (bloomnative.adapters: `lora_a` reads the
# layer's input, `lora_b` writes its output), follows the layer. Column-parallel: A is whole on
# every rank and B holds the rows of W's shard (QKV's whole heads, [q, k, v] per head), so each
# rank adds B's rows to its own output columns. Row-parallel: A holds the input columns of W's
# shard, so B(A(x)) is a partial sum like x W^T, and B is whole; the layer's reduction (an
# all-reduce, or a reduce-scatter under sequence parallelism) adds both up. DTensor reduces
# the gradients of the whole (replicated) factors over the tp ranks.
COLUMN_PLACEMENTS: dict[str, Placement] = {
    "weight": Shard(0),
    "bias": Shard(0),
    "lora_a.weight": Replicate(),
    "lora_b.weight": Shard(0),
}
ROW_PLACEMENTS: dict[str, Placement] = {
    "weight": Shard(1),
    "bias": Replicate(),
    "lora_a.weight": Shard(1),
    "lora_b.weight": Replicate(),
}


def _place_parameters(
    placements: dict[str, Placement],
    prefix: str,
    module: nn.Module,
    mesh: DeviceMesh,
    src_data_rank: int | None,
) -> None:
    """Makes each parameter of `module` (`prefix`: its name in the sharded layer; "" for the
    layer itself) a DTensor placed as `placements` says for its name in the layer."""
    for name, param in module.named_parameters(recurse=False):
        key = f"{prefix}.{name}" if prefix else name
        if key not in placements:
            raise ValueError(
                f"apply_tensor_parallel: no placement for the parameter {key!r} of a sharded "
                f"linear layer; the plan places {', '.join(placements)}"
            )
        placed = distribute_tensor(param, mesh, [placements[key]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


class ColumnParallelLinear(ColwiseParallel):
    """`ColwiseParallel` for a linear layer with or without an adapter (`COLUMN_PLACEMENTS`)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _place_parameters(COLUMN_PLACEMENTS, name, module, device_mesh, self.src_data_rank)


class RowParallelLinear(RowwiseParallel):
    """`RowwiseParallel` for a linear layer with or without an adapter (`ROW_PLACEMENTS`)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _place_parameters(ROW_PLACEMENTS, name, module, device_mesh, self.src_data_rank)


def apply_tensor_parallel(
    model: Bloom, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shards `model` (a whole `Bloom` or a pipeline stage of it, on the meta device) over the
    1-D `tp_mesh` in place, Megatron's layout (module docstring): each rank computes whole
    heads and a slice of the MLP width.

    Where it goes among the plans, and why: docs/architecture.md (the order of the parallel
    plans).

    `sequence_parallel`: shard the LayerNorms and the residual stream along the sequence too.
    `loss_parallel`: the head's logits stay sharded over the vocabulary (a DTensor); compute the
    loss inside `torch.distributed.tensor.parallel.loss_parallel()`. Without it the logits are
    a plain tensor, whole on every rank. Dropout, if the model has any, draws from each rank's
    default generator: seed it alike on the ranks of `tp_mesh` (differently per data-parallel
    rank), and per tp rank as well with `sequence_parallel` (parallel/dropout_rng.py).
    """
    tp = tp_mesh.size()
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel: tp_mesh must be 1-D, got {tp_mesh.ndim} dims")
    for name in ("n_head", "vocab_size"):
        if getattr(model.args, name) % tp:
            raise ValueError(
                f"apply_tensor_parallel: the model's {name} = {getattr(model.args, name)} is "
                f"not divisible by the tp mesh size {tp}; choose a tp that divides it"
            )
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    stream = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    norm = SequenceParallel() if sequence_parallel else None

    top: dict[str, ParallelStyle] = {}
    if model.word_embeddings is not None:
        top["word_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        if sequence_parallel:  # its output starts the residual stream: a plain local shard
            top["word_embeddings_layernorm"] = SequenceParallel(use_local_output=True)
    if model.ln_f is not None and norm:
        top["ln_f"] = norm
    if model.lm_head is not None:
        top["lm_head"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, top)
    if model.word_embeddings is not None and model.lm_head is not None:
        model.lm_head.weight = model.word_embeddings.weight  # both Shard(0): re-tie

    for block in model.blocks():
        plan = {
            "self_attention": PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            ),
            "self_attention.query_key_value": ColumnParallelLinear(),
            "self_attention.dense": RowParallelLinear(output_layouts=stream),
            "mlp": PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            ),
            "mlp.dense_h_to_4h": ColumnParallelLinear(),
            "mlp.dense_4h_to_h": RowParallelLinear(output_layouts=stream),
        }
        if norm:
            plan["input_layernorm"] = norm
            plan["post_attention_layernorm"] = norm
        parallelize_module(block, tp_mesh, plan)
        _shard_heads(block.self_attention, tp_mesh.get_local_rank(), tp)
    if not sequence_parallel:
        fork_attention_dropout(model, tp_mesh.get_local_rank())
    # torch's SequenceParallel makes new parameters of the LayerNorms' that train (it drops
    # requires_grad): a frozen one (a LoRA run's base) stays frozen.
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)


def _shard_heads(attention: BloomAttention, tp_rank: int, tp: int) -> None:
    """This rank computes heads [rank * n/tp, (rank+1) * n/tp): slice the ALiBi slopes to them."""
    local = attention.n_head // tp
    attention.head_range = (tp_rank * local, (tp_rank + 1) * local)
    attention.reset_alibi_slopes()

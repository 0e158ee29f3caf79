"""Tensor, sequence and loss parallelism for `Bloom` with DTensor (Megatron's layout).

Per block: QKV and dense_h_to_4h are column-parallel (each rank computes whole heads / a slice of
the MLP width), the attention output dense and dense_4h_to_h are row-parallel. With sequence
parallelism the LayerNorms and the residual stream between blocks are sharded along the
sequence, turning each all-reduce into a reduce-scatter + all-gather pair. The embedding is
vocab-parallel, and with loss parallelism the head's output stays sharded over the vocabulary
into the cross-entropy, so the 250,880-wide logits never exist whole on one rank. Dropout
follows parallel/dropout_rng.py's rule: under SP every dropout is on a sharded tensor and the
rank's own stream; without SP attention forks a per-rank stream.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
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
            "self_attention.query_key_value": ColwiseParallel(),
            "self_attention.dense": RowwiseParallel(output_layouts=stream),
            "mlp": PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            ),
            "mlp.dense_h_to_4h": ColwiseParallel(),
            "mlp.dense_4h_to_h": RowwiseParallel(output_layouts=stream),
        }
        if norm:
            plan["input_layernorm"] = norm
            plan["post_attention_layernorm"] = norm
        parallelize_module(block, tp_mesh, plan)
        _shard_heads(block.self_attention, tp_mesh.get_local_rank(), tp)
    if not sequence_parallel:
        fork_attention_dropout(model, tp_mesh.get_local_rank())


def _shard_heads(attention: BloomAttention, tp_rank: int, tp: int) -> None:
    """This rank computes heads [rank * n/tp, (rank+1) * n/tp): slice the ALiBi slopes to them."""
    local = attention.n_head // tp
    attention.head_range = (tp_rank * local, (tp_rank + 1) * local)
    attention.reset_alibi_slopes()

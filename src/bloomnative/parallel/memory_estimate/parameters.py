"""The parameters one rank holds: per block, per pipeline stage, per FSDP unit."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.memory_estimate.inputs import Layout
from bloomnative.parallel.pipeline import stage_ids_of_rank, stage_layer_counts


@dataclass(frozen=True)
class ParamTensor:
    """One parameter as a rank holds it after tensor parallelism (before FSDP sharding)."""

    name: str
    shape: tuple[int, ...]
    unit: str
    """The FSDP unit it belongs to: "block.<i>" or "root" (embedding, LayerNorms, head)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_numel(self, shards: int) -> int:
        """Elements on one FSDP rank: dim 0 split into `shards` equal chunks, padded."""
        return math.ceil(self.shape[0] / shards) * (self.numel // self.shape[0])


def block_parameters(args: BloomArgs, index: int, tp: int) -> list[ParamTensor]:
    """A block's parameters under Megatron's TP plan: QKV and dense_h_to_4h split by output rows,
    dense and dense_4h_to_h by input columns (their biases replicated), LayerNorms replicated."""
    h = args.hidden_size
    unit = f"block.{index}"
    p = lambda name, *shape: ParamTensor(f"layers.{index}.{name}", tuple(shape), unit)
    return [
        p("input_layernorm.weight", h),
        p("input_layernorm.bias", h),
        p("self_attention.query_key_value.weight", 3 * h // tp, h),
        p("self_attention.query_key_value.bias", 3 * h // tp),
        p("self_attention.dense.weight", h, h // tp),
        p("self_attention.dense.bias", h),
        p("post_attention_layernorm.weight", h),
        p("post_attention_layernorm.bias", h),
        p("mlp.dense_h_to_4h.weight", 4 * h // tp, h),
        p("mlp.dense_h_to_4h.bias", 4 * h // tp),
        p("mlp.dense_4h_to_h.weight", h, 4 * h // tp),
        p("mlp.dense_4h_to_h.bias", h),
    ]


def stage_blocks(args: BloomArgs, layout: Layout, stage_id: int) -> range:
    """Indices of the blocks stage `stage_id` runs (`pipeline.stage_layer_counts`' split)."""
    if layout.num_stages == 1:
        return range(args.n_layer)
    counts = stage_layer_counts(
        args.n_layer,
        layout.num_stages,
        layout.pp_embedding_as_layer,
        list(layout.pp_layers_per_stage) or None,
    )
    first = sum(counts[:stage_id])
    return range(first, first + counts[stage_id])


def stage_parameters(args: BloomArgs, layout: Layout, stage_id: int) -> list[ParamTensor]:
    """What stage `stage_id` holds: its blocks, the embedding (first stage), the final LayerNorm
    and the head (last stage; its own copy of the tied weight unless it is also the first)."""
    h, tp = args.hidden_size, layout.tp
    vocab_shard = args.vocab_size // tp
    first, last = stage_id == 0, stage_id == layout.num_stages - 1
    params: list[ParamTensor] = []
    root = lambda name, *shape: ParamTensor(name, tuple(shape), "root")
    if first:
        params += [
            root("word_embeddings.weight", vocab_shard, h),
            root("word_embeddings_layernorm.weight", h),
            root("word_embeddings_layernorm.bias", h),
        ]
    for index in stage_blocks(args, layout, stage_id):
        params += block_parameters(args, index, tp)
    if last:
        params += [root("ln_f.weight", h), root("ln_f.bias", h)]
        if not first:
            params.append(root("lm_head.weight", vocab_shard, h))
    return params


def rank_stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    if layout.pp == 1:
        return [0]
    return stage_ids_of_rank(pp_rank, layout.pp, layout.pp_stages_per_rank, layout.pp_schedule)


def rank_parameters(args: BloomArgs, layout: Layout, pp_rank: int) -> list[ParamTensor]:
    """Every parameter pipeline rank `pp_rank` holds (one tensor-parallel rank's shards)."""
    return [
        p for sid in rank_stage_ids(layout, pp_rank) for p in stage_parameters(args, layout, sid)
    ]


def unit_numels(params: Iterable[ParamTensor]) -> dict[str, int]:
    """Elements per FSDP unit (unsharded, i.e. what an all-gather materialises)."""
    sizes: dict[str, int] = {}
    for p in params:
        sizes[p.unit] = sizes.get(p.unit, 0) + p.numel
    return sizes

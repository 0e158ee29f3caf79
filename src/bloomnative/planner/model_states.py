"""The parameters one rank holds (per block, per pipeline stage, per FSDP unit) and their
weights, gradients and optimizer states (Rajbhandari et al. 2020, ZeRO) under each sharding."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

from bloomnative.adapters.quantize import nf4_bytes
from bloomnative.model.args import BloomArgs
from bloomnative.parallel.float8 import FLOAT8_DIM_MULTIPLE
from bloomnative.parallel.schedules import stage_ids_of_rank, stage_layer_counts
from bloomnative.planner.inputs import (
    BF16,
    FP32,
    Adapters,
    Component,
    Layout,
    Precision,
    Workload,
)


@dataclass(frozen=True)
class ParamTensor:
    """One parameter as a rank holds it after tensor parallelism (before FSDP sharding)."""

    name: str
    shape: tuple[int, ...]
    unit: str
    """The FSDP unit it belongs to: "block.<i>" or "root" (embedding, LayerNorms, head)."""
    trainable: bool = True
    """False for the frozen base of an adapter run: no gradient, no AdamW moments."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_numel(self, shards: int) -> int:
        """Elements on one FSDP rank: dim 0 split into `shards` equal chunks, padded."""
        return math.ceil(self.shape[0] / shards) * (self.numel // self.shape[0])


# Each adaptable layer's module path in a block.
_LINEAR_LAYERS = {
    "query_key_value": "self_attention.query_key_value",
    "dense": "self_attention.dense",
    "dense_h_to_4h": "mlp.dense_h_to_4h",
    "dense_4h_to_h": "mlp.dense_4h_to_h",
}


def block_parameters(
    args: BloomArgs, index: int, tp: int, adapters: Adapters | None = None
) -> list[ParamTensor]:
    """A block's parameters under Megatron's TP plan: QKV and dense_h_to_4h split by output rows,
    dense and dense_4h_to_h by input columns (their biases replicated), LayerNorms replicated;
    with `adapters`, the base frozen and each targeted layer's A [rank, in] and B [out, rank],
    with the in and out of the layer's shard (TP splits A like a row-parallel layer's input and
    B like a column-parallel layer's output)."""
    base = _base_block_parameters(args, index, tp)
    if adapters is None:
        return base
    base = [dataclasses.replace(p, trainable=False) for p in base]
    shapes = {p.name: p.shape for p in base}
    unit = f"block.{index}"
    for target in adapters.targets:
        name = f"layers.{index}.{_LINEAR_LAYERS[target]}"
        out_features, in_features = shapes[f"{name}.weight"]
        base.append(ParamTensor(f"{name}.lora_a.weight", (adapters.rank, in_features), unit))
        base.append(ParamTensor(f"{name}.lora_b.weight", (out_features, adapters.rank), unit))
    return base


def _base_block_parameters(args: BloomArgs, index: int, tp: int) -> list[ParamTensor]:
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
    """Indices of the blocks stage `stage_id` runs (`schedules.stage_layer_counts`' split)."""
    if layout.num_stages == 1:
        return range(args.n_layer)
    counts = stage_layer_counts(
        args.n_layer,
        layout.num_stages,
        layout.parallelism.pp_embedding_as_layer,
        layout.parallelism.pp_layers_per_stage or None,
    )
    first = sum(counts[:stage_id])
    return range(first, first + counts[stage_id])


def stage_parameters(
    args: BloomArgs, layout: Layout, stage_id: int, adapters: Adapters | None = None
) -> list[ParamTensor]:
    """What stage `stage_id` holds: its blocks, the embedding (first stage), the final LayerNorm
    and the head (last stage; its own copy of the tied weight unless it is also the first);
    with `adapters` the blocks' adapters, and everything else frozen."""
    h, tp = args.hidden_size, layout.dims.tp
    vocab_shard = args.vocab_size // tp
    first, last = stage_id == 0, stage_id == layout.num_stages - 1
    params: list[ParamTensor] = []
    frozen = adapters is not None
    root = lambda name, *shape: ParamTensor(name, tuple(shape), "root", trainable=not frozen)
    if first:
        params += [
            root("word_embeddings.weight", vocab_shard, h),
            root("word_embeddings_layernorm.weight", h),
            root("word_embeddings_layernorm.bias", h),
        ]
    for index in stage_blocks(args, layout, stage_id):
        params += block_parameters(args, index, tp, adapters)
    if last:
        params += [root("ln_f.weight", h), root("ln_f.bias", h)]
        if not first:
            params.append(root("lm_head.weight", vocab_shard, h))
    return params


def rank_stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    if layout.dims.pp == 1:
        return [0]
    par = layout.parallelism
    return stage_ids_of_rank(pp_rank, layout.dims.pp, par.pp_stages_per_rank, par.pp_schedule)


def rank_parameters(
    args: BloomArgs, layout: Layout, pp_rank: int, adapters: Adapters | None = None
) -> list[ParamTensor]:
    """Every parameter pipeline rank `pp_rank` holds (one tensor-parallel rank's shards)."""
    return [
        p
        for sid in rank_stage_ids(layout, pp_rank)
        for p in stage_parameters(args, layout, sid, adapters)
    ]


def unit_numels(params: Iterable[ParamTensor]) -> dict[str, int]:
    """Elements per FSDP unit (unsharded, i.e. what an all-gather materialises)."""
    sizes: dict[str, int] = {}
    for p in params:
        sizes[p.unit] = sizes.get(p.unit, 0) + p.numel
    return sizes


def unit_gathered_bytes(
    params: Iterable[ParamTensor], compute: int, workload: Workload, shards: int
) -> dict[str, int]:
    """Bytes of each FSDP unit's all-gather output over `shards` (dp_shard x cp) ranks:
    `compute` per element, one for a block linear's weight that FSDP2 gathers in FP8
    (`workload.float8_all_gather`), counted where the rank's shape of it is a multiple of 16 both
    ways, the FP8 kernels' condition, which its whole shape then meets too (its one fp32 scale is
    not counted). On one shard a frozen FP8 weight stays out of FSDP2's units
    (`parallel.fsdp.gathered_wrong_on_one_rank`) and is cast in its forward: `compute`."""
    linear = tuple(f".{path}.weight" for path in _LINEAR_LAYERS.values())
    sizes: dict[str, int] = {}
    for p in params:
        fp8 = (
            workload.float8_all_gather
            and (p.trainable or shards > 1)
            and p.name.endswith(linear)
            and all(dim % FLOAT8_DIM_MULTIPLE == 0 for dim in p.shape)
        )
        sizes[p.unit] = sizes.get(p.unit, 0) + p.numel * (1 if fp8 else compute)
    return sizes


def split_nf4_base(
    params: list[ParamTensor], adapters: Adapters | None
) -> tuple[list[ParamTensor], list[ParamTensor]]:
    """(the other parameters, the NF4 ones): with `adapters.quantize_base = "nf4"` the frozen
    weights of the blocks' linear layers are NF4 (`adapters.quantize.quantize_base_nf4`)."""
    if adapters is None or adapters.quantize_base != "nf4":
        return params, []
    linear = tuple(f".{path}.weight" for path in _LINEAR_LAYERS.values())
    nf4 = [p for p in params if not p.trainable and p.name.endswith(linear)]
    return [p for p in params if p not in nf4], nf4


def nf4_base_component(nf4: list[ParamTensor], layout: Layout) -> Component:
    """The NF4 base's storage, sharded by FSDP2 like any parameter (dim 0): the bytes torchao's
    NF4 tensor holds for each shard (`adapters.quantize.nf4_bytes`). Not counted: a block's
    gathered NF4 copy (0.52 bytes per weight) and the one layer's weight dequantised at a time."""
    shards = layout.dims.fsdp_shards
    return Component(
        "NF4 frozen base (sharded)",
        sum(nf4_bytes(p.shard_numel(shards)) for p in nf4),
        "resident",
        "0.516 x frozen block linear weights/(dp_shard cp) (4 bits + int8 scales per 64 + bf16 "
        "factors per 64 x 256)",
    )


def model_state_components(
    params: list[ParamTensor], layout: Layout, workload: Workload, prec: Precision
) -> list[Component]:
    """Weights, gradients and AdamW moments (ZeRO paper, section 3.1) under the layout's sharding.

    FSDP2 (zero_stage 2/3): fp32 master weights, fp32 gradients (reduce dtype) and the two AdamW
    moments are sharded over dp_shard x cp (dim 0 of each tensor, padded); the compute-dtype copy
    of each block is all-gathered when needed; with bf16 this holds without data or context
    parallelism too (a size-1 mesh). fp32 without data or context parallelism: plain fp32
    parameters and gradients. zero_stage 1
    (Megatron-DeepSpeed BF16Optimizer): bf16 weights and bf16 .grad replicated, a full fp32
    gradient-accumulation buffer, fp32 master weights and moments partitioned over all dp ranks.
    P counts every parameter the rank holds, T the trainable ones (all, or only the adapters:
    a frozen base's FSDP2 shards are stored in the compute dtype, bf16 in a bf16 run).
    """
    grad_phase = "resident" if gradients_persist(layout, workload) else "step_end"
    if layout.deepspeed:
        return _zero1_states(sum(p.numel for p in params), layout, workload, grad_phase)
    if prec.fsdp:
        return _fsdp_states(params, layout, workload, prec, grad_phase)
    return _unsharded_states(params, workload, grad_phase)


def gradients_persist(layout: Layout, workload: Workload) -> bool:
    """Gradients exist at the activation peak when an earlier micro batch's backward produced
    them: gradient accumulation, or a pipeline that interleaves forwards and backwards. With one
    micro batch, or GPipe (all forwards first), they appear only as the backward frees
    activations (zero_grad sets them to None)."""
    if layout.dims.pp > 1:
        return layout.parallelism.pp_schedule != "GPipe"
    return workload.microbatches > 1


BLOCK_8BIT = 256
"""Elements per fp32 scale in torchao's AdamW8bit moments (its default block size)."""
QMAP_8BIT = 256 * FP32
"""Bytes of the code-to-value table each 8-bit moment tensor holds (256 fp32 values)."""


def moment_bytes(workload: Workload, numels: list[int]) -> int:
    """Bytes of AdamW's two moments for local tensors of `numels` elements: 8 per element with
    fp32 moments, 2 + 2 with "bf16" (train/bf16_adamw.py); with "8bit" (torchao's AdamW8bit), a
    tensor of at least 4096 elements that the block divides holds per moment 1 byte per element,
    an fp32 scale per block of 256 and the 1 KiB table (about 2.03 bytes per element for both);
    smaller ones keep fp32 moments."""
    if workload.optimizer == "bf16":
        return 2 * BF16 * sum(numels)
    if workload.optimizer != "8bit":
        return 2 * FP32 * sum(numels)
    quantized = [n for n in numels if n >= 4096 and n % BLOCK_8BIT == 0]
    rest = sum(numels) - sum(quantized)
    return 2 * sum(n + FP32 * (n // BLOCK_8BIT) + QMAP_8BIT for n in quantized) + 2 * FP32 * rest


def _optimizer_step_temporary(
    workload: Workload, local_numel: int, largest_numel: int
) -> Component:
    """AdamW's foreach path allocates sqrt(exp_avg_sq) for every local parameter at once
    (torch.optim.adamw._multi_tensor_adamw); the for-loop path one parameter at a time;
    AdamW8bit dequantizes both moments of one parameter at a time (fp32); AdamWBF16 holds one
    parameter's two moments in fp32 and the 32-bit random bits that round one of them."""
    per_impl = {
        "fused": 0,
        "foreach": local_numel,
        "for-loop": largest_numel,
        "bf16": 3 * largest_numel,
        "8bit": 2 * largest_numel,
    }
    return Component(
        f"optimizer step temporaries ({workload.optimizer} AdamW)",
        FP32 * per_impl[workload.optimizer],
        "step_end",
        "4 x local params (foreach sqrt buffer), 0 for fused; bf16: 3 x 4 x largest param; "
        "8bit: 2 x 4 x largest param",
    )


def _fsdp_states(
    params: list[ParamTensor], layout: Layout, workload: Workload, prec: Precision, grad_phase: str
) -> list[Component]:
    shards = layout.dims.fsdp_shards
    # A frozen base is stored in the compute dtype (adapters.lora.store_frozen_in): no master.
    stored = sum(p.shard_numel(shards) * (FP32 if p.trainable else prec.compute) for p in params)
    trained = [p.shard_numel(shards) for p in params if p.trainable]
    units = unit_gathered_bytes(params, prec.compute, workload, shards)
    root = units.get("root", 0)
    blocks = sorted((n for u, n in units.items() if u != "root"), reverse=True)
    fp8 = " (1 x FP8-gathered block linear weights)" if workload.float8_all_gather else ""
    if not layout.reshards_after_forward:
        gathered = root + sum(blocks)
        gathered_formula = (
            f"{prec.compute} x all units{fp8} (zero 2 keeps blocks gathered to backward)"
        )
    else:
        gathered = root
        gathered_formula = (
            f"{prec.compute} x root unit (embedding/head, kept gathered); zero 3 reshards blocks "
            f"after forward and re-gathers two{fp8} in backward (see the backward working set)"
        )
    states = "host" if layout.parallelism.cpu_offload else "resident"
    step = _optimizer_step_temporary(workload, sum(trained), max(trained))
    return [
        Component(
            "fp32 masters + frozen weights (sharded)",
            stored,
            states,
            "(4 x T + compute x frozen)/(dp_shard cp)",
        ),
        Component(
            "AdamW moments (sharded)",
            moment_bytes(workload, trained),
            states,
            "2 x 4 x T/(dp_shard cp); bf16: 2 x 2 x T/(dp_shard cp); "
            "8bit: 2 x (1 + 4/256) x T/(dp_shard cp)",
        ),
        Component(
            "fp32 gradients (sharded, reduce dtype)",
            FP32 * sum(trained),
            "host" if layout.parallelism.cpu_offload else grad_phase,
            "4 x T/(dp_shard cp)",
        ),
        Component(
            "gathered weights (FSDP all-gather outputs)",
            gathered,
            "fwd_bwd",
            gathered_formula,
        ),
        dataclasses.replace(step, phase="host") if layout.parallelism.cpu_offload else step,
    ]


def _unsharded_states(
    params: list[ParamTensor], workload: Workload, grad_phase: str
) -> list[Component]:
    """fp32 without data parallelism: plain fp32 parameters, and .grad and AdamW moments for the
    trainable ones."""
    n_local = sum(p.numel for p in params)
    trained = [p.numel for p in params if p.trainable]
    return [
        Component("fp32 weights", FP32 * n_local, "resident", "4 x P"),
        Component(
            "AdamW moments",
            moment_bytes(workload, trained),
            "resident",
            "2 x 4 x T; bf16: 2 x 2 x T; 8bit: 2 x (1 + 4/256) x T",
        ),
        Component("fp32 gradients", FP32 * sum(trained), grad_phase, "4 x T"),
        _optimizer_step_temporary(workload, sum(trained), max(trained)),
    ]


def _zero1_states(
    n_local: int, layout: Layout, workload: Workload, grad_phase: str
) -> list[Component]:
    partition = math.ceil(n_local / layout.dims.dp)
    if workload.precision == "fp32":
        return [
            Component("fp32 weights (replicated)", FP32 * n_local, "resident", "4 x P"),
            Component("fp32 gradients (replicated)", FP32 * n_local, grad_phase, "4 x P"),
            Component("AdamW moments (partitioned)", 8 * partition, "resident", "8 x P/dp"),
        ]
    return [
        Component("bf16 weights (replicated)", BF16 * n_local, "resident", "2 x P"),
        Component("bf16 gradients (.grad, replicated)", BF16 * n_local, grad_phase, "2 x P"),
        Component(
            "fp32 gradient accumulation buffer (replicated)",
            FP32 * n_local,
            "resident",
            "4 x P (BF16Optimizer accumulates micro batches in fp32)",
        ),
        Component(
            "fp32 master weights + AdamW moments (partitioned)",
            3 * FP32 * partition,
            "resident",
            "12 x P/dp",
        ),
    ]

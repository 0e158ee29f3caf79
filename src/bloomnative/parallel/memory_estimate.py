"""Per-rank memory planner: what one device holds while bloomnative trains a BLOOM model.

The estimate is a list of named components, each computed from a formula given in its
docstring, for every pipeline rank; the plan reports the rank that needs the most. Three moments
of a training step are considered:

- resident: lives for the whole step (fp32 master weights and AdamW moments, the fp32
  gradients once a micro batch has been back-propagated, pipeline receive buffers);
- forward/backward peak: resident + working (bf16, gathered) parameters + the stored activations
  of the micro batches in flight + the largest transient of the backward (the loss's fp32
  buffers, or one recomputed block and its gradient buffers);
- optimizer step: resident + gradients + the AdamW step's temporaries.

The allocated peak is resident + the larger of the other two; the device needs that plus the
framework overhead (CUDA context, NCCL buffers, caching-allocator fragmentation), which is an
assumption with a default, not a measurement.

Sources
- Model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (2 + 2 + 12 bytes per parameter for mixed-precision Adam, stage 1 shards
  the 12), with FSDP2's semantics for zero_stage 2 and 3 (`bloomnative.parallel.fsdp`).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, adjusted term by term for
  BLOOM and for the attention kernel (`block_activation_terms` lists every kept term).
- Pipelines: the warm-up depths of torch.distributed.pipelining's schedules, and its receive
  buffers (one per micro batch, allocated once and kept).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from bloomnative.config import Config, ParallelismConfig
from bloomnative.model.args import BloomArgs
from bloomnative.parallel.dims import ParallelDims
from bloomnative.parallel.pipeline import stage_ids_of_rank, stage_layer_counts

GiB = 2**30
FP32, BF16, INT64 = 4, 2, 8

RECOMPUTE_MODES = ("none", "full", "selective")
ATTENTION_MEMORY = ("flash", "sdpa_efficient", "materialized", "cpu_math")
OPTIMIZER_IMPLS = ("fused", "foreach", "for-loop")
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")

# The fused loss's automatic chunk (kernels/linear_cross_entropy.py): 256 MiB of logits per chunk,
# a power of two between 16 and 8192 rows.
_FUSED_LOSS_CHUNK_BYTES = 256 * 2**20


class PlanError(ValueError):
    """An input the planner cannot estimate, described with what to change."""


# --------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Layout:
    """How the model is split over devices (the [parallelism] section, plus zero_stage 1)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_embedding_as_layer: bool = True
    pp_layers_per_stage: tuple[int, ...] = ()
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_keeps_outputs: bool = True
    """torch.distributed.pipelining's `step(return_outputs=True)` default, which the trainer
    uses: the last stage keeps every micro batch's logits and concatenates them at the end of
    the step."""
    zero_stage: int = 3
    """1: Megatron-DeepSpeed's BF16Optimizer (bf16 weights, bf16 and fp32 gradients replicated;
    fp32 master weights and AdamW moments sharded over all data-parallel ranks) -- estimator
    only, the trainer does not implement it. 2 and 3: FSDP2 (weights, gradients and optimizer
    states sharded over dp_shard; 3 frees gathered weights after each block's forward)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.pp_stages_per_rank

    @property
    def sequence_shards(self) -> int:
        """Shards of the residual stream along the sequence (tp with sequence parallelism)."""
        return self.tp if self.tp > 1 and self.sequence_parallel else 1

    @property
    def uses_fsdp(self) -> bool:
        """The trainer applies FSDP2 whenever there is data parallelism."""
        return self.dp > 1 and self.zero_stage in (2, 3)


@dataclass(frozen=True)
class Workload:
    """What one data-parallel rank computes per optimizer step, and how."""

    micro_batch: int
    seq_len: int
    microbatches: int = 1
    """Micro batches per optimizer step on one data-parallel rank (gradient accumulation; the
    pipeline's micro batches when pp > 1)."""
    precision: str = "bf16"
    """"bf16": bf16 compute, fp32 master weights and gradients; "fp32"."""
    recompute: str = "none"
    """Activation checkpointing: "none", "full" (every block) or "selective" (every N-th)."""
    recompute_every: int = 2
    attention: str = "flash"
    """What the attention kernel keeps for backward: "flash" (bloomnative's Triton and flex
    kernels: q, k, v, output, logsumexp), "sdpa_efficient" (CUDA SDPA with the additive ALiBi
    bias: also keeps the [heads, s, s] bias), "materialized" (Megatron's fused softmax: keeps the
    [b, heads, s, s] probabilities) or "cpu_math" (CPU SDPA's math path: as materialized, in
    fp32 even for bf16 inputs)."""
    fused_loss: bool = False
    """Chunked lm head + cross-entropy (kernels.linear_cross_entropy): no [tokens, vocab] tensor."""
    dropout: bool = False
    """Megatron's dropout (0.1 on attention probabilities and hidden states; BLOOM-176B's
    training script kept these defaults). bloomnative's model has no dropout: False."""
    optimizer: str = "fused"
    """AdamW implementation: "fused" (no temporaries), "foreach" (one fp32 temporary the size of
    the local parameters) or "for-loop" (one the size of the largest parameter)."""


@dataclass(frozen=True)
class Overhead:
    """Device memory outside the allocator's live tensors. An assumption, not a measurement."""

    context_bytes: int = int(1.5 * GiB)
    """CUDA context + cuBLAS workspaces + NCCL communicator buffers (about 0.5-1 GiB of context
    on Hopper with lazy module loading, plus a few hundred MiB per NCCL communicator)."""
    fragmentation: float = 0.10
    """Caching-allocator slack as a fraction of the allocated peak (reserved / allocated - 1;
    typically 5-20% in training loops with varying shapes)."""

    @classmethod
    def none(cls) -> Overhead:
        """No overhead: CPU, or a comparison with allocated (not reserved) bytes."""
        return cls(context_bytes=0, fragmentation=0.0)


def attention_memory_kind(backend: str, device_type: str) -> str:
    """The memory behaviour of a model.attention backend on a device type."""
    if backend in ("triton", "flex"):
        return "flash"
    if backend == "sdpa":
        return "sdpa_efficient" if device_type == "cuda" else "cpu_math"
    raise PlanError(f"unknown attention backend {backend!r}; valid: sdpa, flex, triton")


# --------------------------------------------------------------------------------- from a config


def layout_from_config(par: ParallelismConfig, world_size: int = 0) -> Layout:
    """The layout a [parallelism] section gives on `world_size` devices (needed when dp_shard
    is -1; 0 then means dp_shard = 1)."""
    fixed = par.dp_replicate * par.tp * par.pp
    if not world_size:
        world_size = fixed * (par.dp_shard if par.dp_shard > 0 else 1)
    dims = ParallelDims.resolve(par.dp_replicate, par.dp_shard, par.tp, par.pp, world_size)
    return Layout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        pp_schedule=par.pp_schedule,
        pp_stages_per_rank=par.pp_stages_per_rank,
        pp_embedding_as_layer=par.pp_embedding_as_layer,
        pp_layers_per_stage=tuple(par.pp_layers_per_stage),
        sequence_parallel=par.sequence_parallel,
        loss_parallel=par.loss_parallel,
        zero_stage=par.zero_stage,
    )


def local_batch_size(config: Config, layout: Layout) -> int:
    """Samples per data-parallel rank per step, at the final (largest) global batch size."""
    gbs = config.training.global_batch_size
    if gbs % layout.dp:
        raise PlanError(
            f"training.global_batch_size = {gbs} is not divisible by the data-parallel degree "
            f"{layout.dp}"
        )
    return gbs // layout.dp


def workload_from_config(
    config: Config,
    layout: Layout,
    device_type: str = "cuda",
    attention: str | None = None,
    dropout: bool = False,
) -> Workload:
    """What the trainer runs for `config`: its micro batches (the pipeline's when
    pp_microbatches is set), dtype, recompute, attention kernel on `device_type` (or the given
    attention memory kind), loss and AdamW implementation."""
    t, par = config.training, config.parallelism
    samples = local_batch_size(config, layout)
    if layout.pp > 1 and par.pp_microbatches:
        microbatches = par.pp_microbatches
    else:
        microbatches = samples // t.micro_batch_size
    if microbatches < 1 or samples % microbatches:
        raise PlanError(
            f"{samples} samples per data-parallel rank do not split into {microbatches} micro "
            f"batches (training.micro_batch_size = {t.micro_batch_size})"
        )
    optimizer = config.optimizer.implementation
    if optimizer == "auto":
        optimizer = "fused" if device_type == "cuda" else "foreach"
    return Workload(
        micro_batch=samples // microbatches,
        seq_len=t.seq_len,
        microbatches=microbatches,
        precision=t.dtype,
        recompute=config.activation_checkpoint.mode,
        recompute_every=config.activation_checkpoint.every,
        attention=attention or attention_memory_kind(config.model.attention, device_type),
        fused_loss=config.model.fused_loss,
        dropout=dropout,
        optimizer=optimizer,
    )


# --------------------------------------------------------------------------------- parameters


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


# --------------------------------------------------------------------------------- components


@dataclass(frozen=True)
class Component:
    """A named amount of memory, the moment it is counted in, and how it was computed."""

    name: str
    bytes: int
    phase: str
    """"resident", "fwd_bwd" (forward/backward peak) or "optimizer" (optimizer step)."""
    formula: str

    @property
    def gib(self) -> float:
        return self.bytes / GiB


@dataclass(frozen=True)
class ActivationTerm:
    """One tensor kept for backward, per micro batch: elements x bytes per element."""

    name: str
    elements: int
    bytes_per_element: int
    source: str
    """Korthikanti et al. 2022's term it corresponds to, or why it is added."""

    @property
    def bytes(self) -> int:
        return self.elements * self.bytes_per_element


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the tensors the step creates."""

    compute: int
    """Matmul inputs and outputs: 2 with bf16, 4 with fp32."""
    residual: int
    """Residual stream and LayerNorm inputs: fp32 under autocast (the LayerNorms run in fp32),
    else the compute dtype."""
    autocast: bool
    """bf16 by torch.autocast: the trainer's path without data parallelism (FSDP's
    MixedPrecisionPolicy casts otherwise; Megatron, zero_stage 1, runs the model in bf16)."""

    @classmethod
    def of(cls, layout: Layout, workload: Workload) -> Precision:
        if workload.precision == "fp32":
            return cls(compute=FP32, residual=FP32, autocast=False)
        autocast = layout.dp == 1 and layout.zero_stage != 1
        return cls(compute=BF16, residual=FP32 if autocast else BF16, autocast=autocast)


# --------------------------------------------------------------------------------- model states


def model_state_components(
    params: list[ParamTensor], layout: Layout, workload: Workload, prec: Precision
) -> list[Component]:
    """Weights, gradients and AdamW moments (ZeRO paper, section 3.1) under the layout's sharding.

    FSDP2 (zero_stage 2/3): fp32 master weights, fp32 gradients (reduce dtype) and the two AdamW
    moments are sharded over dp_shard (dim 0 of each tensor, padded); the compute-dtype copy of
    each block is all-gathered when needed. No data parallelism: plain fp32 parameters and
    gradients, plus autocast's bf16 copies of the matrices with bf16. zero_stage 1
    (Megatron-DeepSpeed BF16Optimizer): bf16 weights and bf16 .grad replicated, a full fp32
    gradient-accumulation buffer, fp32 master weights and moments partitioned over all dp ranks.
    """
    grad_phase = "resident" if gradients_persist(layout, workload) else "optimizer"
    if layout.zero_stage == 1:
        return _zero1_states(sum(p.numel for p in params), layout, workload, grad_phase)
    if layout.uses_fsdp:
        return _fsdp_states(params, layout, workload, prec, grad_phase)
    return _unsharded_states(params, workload, prec, grad_phase)


def gradients_persist(layout: Layout, workload: Workload) -> bool:
    """Gradients exist at the activation peak when an earlier micro batch's backward produced
    them: gradient accumulation, or a pipeline that interleaves forwards and backwards. With one
    micro batch, or GPipe (all forwards first), they appear only as the backward frees
    activations (zero_grad sets them to None)."""
    if layout.pp > 1:
        return layout.pp_schedule != "GPipe"
    return workload.microbatches > 1


def _optimizer_step_temporary(
    workload: Workload, local_numel: int, largest_numel: int
) -> Component:
    """AdamW's foreach path allocates sqrt(exp_avg_sq) for every local parameter at once
    (torch.optim.adamw._multi_tensor_adamw); the for-loop path one parameter at a time."""
    per_impl = {"fused": 0, "foreach": local_numel, "for-loop": largest_numel}
    return Component(
        f"optimizer step temporaries ({workload.optimizer} AdamW)",
        FP32 * per_impl[workload.optimizer],
        "optimizer",
        "4 x local params (foreach sqrt buffer), 0 for fused",
    )


def _fsdp_states(
    params: list[ParamTensor], layout: Layout, workload: Workload, prec: Precision, grad_phase: str
) -> list[Component]:
    shards = layout.dp_shard
    sharded = sum(p.shard_numel(shards) for p in params)
    units = unit_numels(params)
    root = units.get("root", 0)
    blocks = sorted((n for u, n in units.items() if u != "root"), reverse=True)
    if layout.zero_stage == 2:
        gathered = root + sum(blocks)
        gathered_formula = f"{prec.compute} x all units (zero 2 keeps blocks gathered to backward)"
    else:
        gathered = root
        gathered_formula = (
            f"{prec.compute} x root unit (embedding/head, kept gathered); zero 3 reshards blocks "
            "after forward and re-gathers two in backward (see the backward working set)"
        )
    return [
        Component("fp32 master weights (sharded)", FP32 * sharded, "resident", "4 x P/dp_shard"),
        Component("AdamW moments (sharded)", 2 * FP32 * sharded, "resident", "2 x 4 x P/dp_shard"),
        Component(
            "fp32 gradients (sharded, reduce dtype)", FP32 * sharded, grad_phase, "4 x P/dp_shard"
        ),
        Component(
            "gathered weights (FSDP all-gather outputs)",
            prec.compute * gathered,
            "fwd_bwd",
            gathered_formula,
        ),
        _optimizer_step_temporary(workload, sharded, max(p.shard_numel(shards) for p in params)),
    ]


def _unsharded_states(
    params: list[ParamTensor], workload: Workload, prec: Precision, grad_phase: str
) -> list[Component]:
    """No data parallelism: fp32 parameters and .grad; bf16 comes from autocast, whose weight
    casts are saved for backward by every linear (the head's cast is the tied embedding's)."""
    n_local = sum(p.numel for p in params)
    components = [
        Component("fp32 weights", FP32 * n_local, "resident", "4 x P"),
        Component("AdamW moments", 2 * FP32 * n_local, "resident", "2 x 4 x P"),
        Component("fp32 gradients", FP32 * n_local, grad_phase, "4 x P"),
    ]
    if prec.autocast:
        components.append(_autocast_weight_copies(params, workload))
    largest = max(p.numel for p in params)
    components.append(_optimizer_step_temporary(workload, n_local, largest))
    return components


def _autocast_weight_copies(params: list[ParamTensor], workload: Workload) -> Component:
    """autocast casts each linear's weight to bf16 and the linear saves the cast for backward;
    a checkpointed block saves nothing (its casts are redone in the recompute, one block at a
    time). The head's cast is the tied embedding's; the embedding itself runs in fp32."""
    has_head = any(p.name in ("lm_head.weight", "ln_f.weight") for p in params)
    per_unit: dict[str, int] = {}
    for p in params:
        if len(p.shape) == 2 and (has_head or p.name != "word_embeddings.weight"):
            per_unit[p.unit] = per_unit.get(p.unit, 0) + p.numel
    blocks = {u: n for u, n in per_unit.items() if u != "root"}
    recomputed = [n for u, n in blocks.items() if _is_checkpointed(int(u.split(".")[1]), workload)]
    kept = sum(per_unit.values()) - sum(recomputed) + max(recomputed, default=0)
    return Component(
        "autocast bf16 weight copies (saved for backward)",
        BF16 * kept,
        "fwd_bwd",
        "2 x linear weights of the head and the non-checkpointed blocks (+ one recomputed)",
    )


def _zero1_states(
    n_local: int, layout: Layout, workload: Workload, grad_phase: str
) -> list[Component]:
    partition = math.ceil(n_local / layout.dp)
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


# --------------------------------------------------------------------------------- activations


def _tokens(workload: Workload) -> int:
    return workload.micro_batch * workload.seq_len


def attention_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """What the attention keeps per block, by kernel. Korthikanti's 11sbh + 5as^2b becomes:

    - flash: q, k, v (6sbh/t, "QK^T 4sbh + V 2sbh"), the output the kernel keeps (2sbh/t) and
      its contiguous [b, s, h] copy that the output projection saves (2sbh/t: the kernels return
      [b, heads, s, d]), logsumexp (fp32, b*a*s/t). The 5as^2b scores/softmax/dropout terms drop
      out: the scores are never stored.
    - sdpa_efficient: as flash, but the output is laid out [b, s, heads, d], so the projection's
      input is a view of it (no copy); the materialised ALiBi + causal bias [a/t, s, s] is kept.
    - materialized: q, k, v (6sbh/t: Megatron's views of the QKV output, or the copies CPU's
      math kernel makes), the softmax probabilities (2as^2b/t; no dropout, so no mask and no
      dropout output) and the projection input. cpu_math: the same, but the kernel computes
      bf16 inputs in fp32, so q, k, v and the probabilities are fp32.
    """
    b, s, c = workload.micro_batch, workload.seq_len, prec.compute
    tokens = _tokens(workload)
    h_local = args.hidden_size // layout.tp
    heads = args.n_head // layout.tp
    qkv = ActivationTerm("q, k, v", 3 * tokens * h_local, c, "K22: QK^T 4sbh + V 2sbh")
    lse = ActivationTerm("softmax logsumexp (fp32)", b * heads * s, FP32, "replaces 2as^2b")
    proj = ActivationTerm("output projection input", tokens * h_local, c, "K22: 2sbh")
    kind = workload.attention
    if kind == "flash":
        kept_output = ActivationTerm(
            "attention output kept by the kernel",
            tokens * h_local,
            c,
            "added: [b, heads, s, d] output, copied to [b, s, h] for the projection",
        )
        return [qkv, kept_output, lse, proj]
    if kind == "sdpa_efficient":
        bias = ActivationTerm(
            "ALiBi + causal bias [heads, s, s]",
            heads * s * s,
            c,
            "added: SDPA keeps its attn_mask; one per block, independent of the batch",
        )
        return [
            qkv,
            lse,
            dataclasses.replace(proj, source="K22: 2sbh (a view of the output)"),
            bias,
        ]
    if kind in ("materialized", "cpu_math"):
        inner = FP32 if kind == "cpu_math" else c
        probs = ActivationTerm(
            "softmax probabilities", b * heads * s * s, inner, "K22: 2as^2b softmax output"
        )
        terms = [dataclasses.replace(qkv, bytes_per_element=inner), probs, proj]
        if workload.dropout:
            elements = b * heads * s * s
            terms += [
                ActivationTerm("attention-dropout mask", elements, 1, "K22: as^2b"),
                ActivationTerm("attention-dropout output", elements, inner, "K22: 2as^2b"),
            ]
        return terms
    raise PlanError(f"attention memory {kind!r}; valid: {', '.join(ATTENTION_MEMORY)}")


def block_activation_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """Tensors one BLOOM block keeps for backward, per micro batch (t = tp).

    Korthikanti et al. 2022 count 34sbh + 5as^2b bytes (16-bit): attention 11sbh + 5as^2b, MLP
    19sbh, LayerNorms 4sbh; with TP + SP everything is divided by t. Kept here:

    - LayerNorm inputs (2 x 2sbh, /t with SP), in the residual dtype (fp32 under autocast),
      plus their fp32 mean and rstd (2sb each, not in the paper: tiny);
    - QKV and dense_h_to_4h inputs (2 x 2sbh): NOT divided by t under DTensor SP, because the
      column-parallel linear saves its all-gathered input (Megatron re-gathers it in backward);
    - the attention terms of `attention_terms`;
    - GeLU input and dense_4h_to_h input (2 x 8sbh/t).

    Dropped: the two hidden-dropout masks (2 x sbh) and the attention-dropout mask and output
    (3as^2b): bloomnative's BLOOM has no dropout (`workload.dropout` adds them back, for
    Megatron; flash kernels regenerate their dropout mask, so only the hidden masks return).
    The softmax output (2as^2b) is dropped for flash kernels (see `attention_terms`).
    """
    h, c, r = args.hidden_size, prec.compute, prec.residual
    tokens = _tokens(workload)
    stream = tokens * h // layout.sequence_shards
    h4_local = 4 * h // layout.tp
    stats = 2 * tokens // layout.sequence_shards
    masks = []
    if workload.dropout:
        masks = [
            ActivationTerm("attention output dropout mask", stream, 1, "K22: sbh"),
            ActivationTerm("MLP output dropout mask", stream, 1, "K22: sbh"),
        ]
    return masks + [
        ActivationTerm("input_layernorm input", stream, r, "K22: 2sbh LayerNorm input"),
        ActivationTerm("input_layernorm mean, rstd", stats, FP32, "added: fp32 statistics"),
        ActivationTerm("query_key_value input", tokens * h, c, "K22: 2sbh (gathered under SP)"),
        *attention_terms(args, layout, workload, prec),
        ActivationTerm("post_attention_layernorm input", stream, r, "K22: 2sbh"),
        ActivationTerm("post_attention_layernorm mean, rstd", stats, FP32, "added"),
        ActivationTerm("dense_h_to_4h input", tokens * h, c, "K22: 2sbh (gathered under SP)"),
        ActivationTerm("GeLU input", tokens * h4_local, c, "K22: 8sbh"),
        ActivationTerm("dense_4h_to_h input", tokens * h4_local, c, "K22: 8sbh"),
    ]


def checkpointed_block_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """A recomputed block keeps only its input (K22 section 4: 2sbh/t with SP)."""
    stream = _tokens(workload) * args.hidden_size // layout.sequence_shards
    return [ActivationTerm("block input (checkpoint)", stream, prec.residual, "K22: 2sbh")]


def embedding_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """First stage: the token ids (the embedding's backward), and the embedding LayerNorm's
    input (the embedding output, sequence-sharded with SP) and statistics."""
    tokens = _tokens(workload)
    stream = tokens * args.hidden_size // layout.sequence_shards
    mask = [ActivationTerm("embedding dropout mask", stream, 1, "sbh")] if workload.dropout else []
    return mask + [
        ActivationTerm("token ids", tokens, INT64, "embedding backward"),
        ActivationTerm("embedding LayerNorm input", stream, prec.residual, "2sbh"),
        ActivationTerm(
            "embedding LayerNorm mean, rstd", 2 * tokens // layout.sequence_shards, FP32, "tiny"
        ),
    ]


def head_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """Last stage: the final LayerNorm's input and the head's (gathered) input."""
    tokens = _tokens(workload)
    stream = tokens * args.hidden_size // layout.sequence_shards
    return [
        ActivationTerm("ln_f input", stream, prec.residual, "2sbh"),
        ActivationTerm("ln_f mean, rstd", 2 * tokens // layout.sequence_shards, FP32, "tiny"),
        ActivationTerm("lm_head input", tokens * args.hidden_size, prec.compute, "2sbh"),
    ]


def local_vocab(args: BloomArgs, layout: Layout) -> int:
    """Logit columns per rank: sharded over tp with loss parallelism, else all-gathered."""
    return args.vocab_size // layout.tp if layout.loss_parallel else args.vocab_size


def fused_loss_chunk_rows(vocab: int, compute_bytes: int) -> int:
    """Rows of one chunk of the fused loss (kernels.linear_cross_entropy's automatic size)."""
    budget = max(_FUSED_LOSS_CHUNK_BYTES // (vocab * compute_bytes), 1)
    return max(16, min(8192, 1 << (budget.bit_length() - 1)))


def loss_saved_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """What the loss keeps per micro batch until its backward.

    Unfused (`train.loss.cross_entropy_sum`): the logits in the compute dtype (b*s*V/t, still
    referenced by the trainer during backward) and log_softmax's fp32 output (4*b*s*V/t; its
    backward needs it). Fused: the gradients it computes during forward, d_hidden (b*s*h) and
    d_weight (V/t*h).
    """
    tokens, vocab, c = _tokens(workload), local_vocab(args, layout), prec.compute
    if workload.fused_loss:
        return [
            ActivationTerm("fused loss d_hidden", tokens * args.hidden_size, c, "fused loss"),
            ActivationTerm("fused loss d_weight", vocab * args.hidden_size, c, "fused loss"),
        ]
    return [
        ActivationTerm("logits", tokens * vocab, c, "b*s*V/t"),
        ActivationTerm("log-probabilities (fp32)", tokens * vocab, FP32, "fp32 upcast in loss"),
    ]


def loss_transient(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision, device_type: str
) -> Component:
    """The loss's extra buffers at its worst moment, on top of `loss_saved_terms`.

    Unfused: log_softmax's backward holds the fp32 gradient of the log-probabilities and
    produces the fp32 gradient of the logits (2 x 4*b*s*V/t). Under DTensor loss parallelism
    the fused nll/log_softmax backward holds three (zeros, exp(log-probs), their sum). In the
    forward the fp32 upcast of bf16 logits (4*b*s*V/t) is smaller. Fused: the fp32 d_weight
    accumulator (4*V/t*h) and one chunk of logits (plus two fp32 copies of it on the torch
    path, off GPU).
    """
    tokens, vocab = _tokens(workload), local_vocab(args, layout)
    if not workload.fused_loss:
        buffers = 3 if layout.tp > 1 and layout.loss_parallel else 2
        return Component(
            "loss backward buffers (fp32 grads of log-probs and logits)",
            buffers * FP32 * tokens * vocab,
            "fwd_bwd",
            f"{buffers} x 4 x b*s*V/t",
        )
    rows = min(tokens, fused_loss_chunk_rows(vocab, prec.compute))
    chunk = rows * vocab * (prec.compute + (2 * FP32 if device_type != "cuda" else 0))
    return Component(
        "fused loss fp32 d_weight accumulator + one chunk of logits",
        FP32 * vocab * args.hidden_size + chunk,
        "fwd_bwd",
        f"4*V/t*h + {rows} rows x V/t",
    )


def block_backward_buffers(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> int:
    """Gradient buffers alive while one block back-propagates (an approximation): the two
    largest activation gradients of the block (the MLP's 4h-wide ones, or the softmax's with
    materialized attention) and the residual-stream gradient in and out."""
    tokens = _tokens(workload)
    mlp = 2 * tokens * (4 * args.hidden_size // layout.tp) * prec.compute
    heads = args.n_head // layout.tp
    scores = 2 * workload.micro_batch * heads * workload.seq_len**2 * prec.compute
    materialized = workload.attention in ("materialized", "cpu_math")
    widest = max(mlp, scores if materialized else 0)
    stream = 2 * tokens * args.hidden_size // layout.sequence_shards * prec.residual
    return widest + stream


# --------------------------------------------------------------------------------- pipeline


def in_flight_microbatches(layout: Layout, microbatches: int, pp_rank: int) -> list[int]:
    """Micro batches whose activations a pipeline rank holds at once, per local stage.

    GPipe: all of them. 1F1B: pp - rank (the warm-up depth), at most the micro batch count.
    Interleaved1F1B / InterleavedZeroBubble: torch's warm-up (`_get_warmup_ops`:
    (v-1) * round + f * (pp-1-rank), f = 2 resp. 1) plus the first steady-state forward, spread
    over the local stages in warm-up order. ZBVZeroBubble: 2pp - rank - 1 forwards of the
    first local stage and rank + 1 of the second (its warm-up).
    """
    pp, v, n = layout.pp, layout.pp_stages_per_rank, microbatches
    if pp == 1:
        return [1]
    schedule = layout.pp_schedule
    if schedule == "GPipe":
        return [n] * v
    if schedule == "1F1B":
        return [min(n, pp - pp_rank)]
    if schedule == "ZBVZeroBubble":
        return [min(n, 2 * pp - pp_rank - 1), min(n, pp_rank + 1)]
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        per_round = n // max(1, n // pp)
        factor = 2 if schedule == "Interleaved1F1B" else 1
        warmup = min((v - 1) * per_round + factor * (pp - 1 - pp_rank), n * v)
        forwards = min(warmup + 1, n * v)
        counts = [0] * v
        for step in range(forwards):
            counts[(step // per_round) % v] += 1
        return [min(c, n) for c in counts]
    raise PlanError(
        f"parallelism.pp_schedule = {schedule!r}; valid: {', '.join(PIPELINE_SCHEDULES)}"
    )


# --------------------------------------------------------------------------------- estimate


@dataclass
class RankEstimate:
    """The memory of one pipeline rank (any of its tp/dp peers holds the same)."""

    pp_rank: int
    components: list[Component]
    activation_terms: dict[str, list[ActivationTerm]] = field(default_factory=dict)
    """Per-micro-batch terms behind the activation components ("block", "checkpointed block",
    "embedding", "head", "loss"), for --explain."""
    overhead: Overhead = field(default_factory=Overhead.none)

    def phase_bytes(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if c.phase == phase)

    @property
    def peak_phase(self) -> str:
        fwd, opt = self.phase_bytes("fwd_bwd"), self.phase_bytes("optimizer")
        return "fwd_bwd" if fwd >= opt else "optimizer"

    @property
    def allocated_peak(self) -> int:
        """Peak of live tensor bytes (what torch.cuda.max_memory_allocated reports)."""
        return self.phase_bytes("resident") + self.phase_bytes(self.peak_phase)

    @property
    def overhead_bytes(self) -> int:
        frag = int(self.overhead.fragmentation * self.allocated_peak)
        return self.overhead.context_bytes + frag

    @property
    def device_bytes(self) -> int:
        """What the device must have: allocated peak + context + fragmentation."""
        return self.allocated_peak + self.overhead_bytes

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)


def _sum(terms: Iterable[ActivationTerm]) -> int:
    return sum(t.bytes for t in terms)


def _is_checkpointed(index: int, workload: Workload) -> bool:
    """Mirrors `apply_activation_checkpointing`: every block, or indices divisible by every."""
    if workload.recompute == "full":
        return True
    return workload.recompute == "selective" and index % workload.recompute_every == 0


def _stage_activation_components(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    prec: Precision,
    stage_id: int,
    in_flight: int,
    terms: dict[str, list[ActivationTerm]],
) -> tuple[list[Component], int]:
    """Stored activations of one stage for its in-flight micro batches, and the stage's
    backward working set (one recomputed block, if any, plus gradient buffers)."""
    first, last = stage_id == 0, stage_id == layout.num_stages - 1
    blocks = stage_blocks(args, layout, stage_id)
    recomputed = sum(_is_checkpointed(i, workload) for i in blocks)
    full = len(blocks) - recomputed
    block_bytes = _sum(terms["block"])
    ckpt_bytes = _sum(terms["checkpointed block"])
    per_microbatch = full * block_bytes + recomputed * ckpt_bytes
    detail = f"{in_flight} micro batch(es) x ({full} blocks x {block_bytes / 2**20:.1f} MiB"
    if recomputed:
        detail += f" + {recomputed} checkpointed x {ckpt_bytes / 2**20:.1f} MiB"
    detail += ")"
    components = [
        Component(
            f"activations: stage {stage_id} blocks", in_flight * per_microbatch, "fwd_bwd", detail
        )
    ]
    if first:
        components.append(
            Component(
                "activations: embedding",
                in_flight * _sum(terms["embedding"]),
                "fwd_bwd",
                "token ids + embedding LayerNorm input",
            )
        )
    if last:
        components.append(
            Component(
                "activations: final LayerNorm + head input",
                in_flight * _sum(terms["head"]),
                "fwd_bwd",
                "ln_f input + lm_head input",
            )
        )
        # In a pipeline the logits are the stage's output, held by the schedule (see
        # `_pipeline_buffer_components`); without one, the trainer holds them.
        loss_terms = [t for t in terms["loss"] if layout.pp == 1 or t.name != "logits"]
        components.append(
            Component(
                "loss: " + " + ".join(t.name for t in loss_terms),
                in_flight * _sum(loss_terms),
                "fwd_bwd",
                f"{in_flight} x (" + " + ".join(t.source for t in loss_terms) + ")",
            )
        )
    working = block_backward_buffers(args, layout, workload, prec)
    if recomputed:
        working += block_bytes
    return components, working


def _pipeline_buffer_components(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    prec: Precision,
    stage_id: int,
    in_flight: int,
) -> list[Component]:
    """Pipeline communication buffers of one stage (b*s/t_sp*h each, the residual stream).

    torch.distributed.pipelining allocates once, per stage, a forward receive buffer for every
    micro batch (not on the first stage; the in-flight ones are the first block's input and are
    counted there) and a gradient receive buffer for every micro batch (not on the last).
    DeepSpeed's pipeline engine (zero_stage 1) receives into one buffer of each kind and clones
    the in-flight inputs. Both keep each in-flight micro batch's stage output for its backward.
    """
    if layout.pp == 1:
        return []
    n = workload.microbatches
    boundary = _tokens(workload) * args.hidden_size // layout.sequence_shards * prec.residual
    first, last = stage_id == 0, stage_id == layout.num_stages - 1
    deepspeed = layout.zero_stage == 1
    name = f"pipeline stage {stage_id}"
    components = []
    if not first:
        count = 1 if deepspeed else n - in_flight
        components.append(
            Component(
                f"{name} activation receive buffers",
                count * boundary,
                "resident",
                "1 buffer (DeepSpeed)"
                if deepspeed
                else f"{n} micro batches - {in_flight} in flight (counted as block inputs)",
            )
        )
    if last and not workload.fused_loss:
        logits = _tokens(workload) * local_vocab(args, layout) * prec.compute
        if layout.pp_keeps_outputs and not deepspeed:
            components += [
                Component(
                    f"{name} logits of every micro batch (return_outputs)",
                    n * logits,
                    "resident",
                    f"{n} x b*s*V/t kept by the schedule until the next step",
                ),
                Component(
                    f"{name} merged logits at the end of the step",
                    n * logits,
                    "optimizer",
                    f"torch.cat of {n} x b*s*V/t",
                ),
            ]
        else:
            components.append(
                Component(
                    f"{name} logits of in-flight micro batches",
                    in_flight * logits,
                    "fwd_bwd",
                    f"{in_flight} x b*s*V/t (the stage output, kept for backward)",
                )
            )
    if not last:
        count = 1 if deepspeed else n
        components.append(
            Component(
                f"{name} gradient receive buffers",
                count * boundary,
                "resident",
                "1 buffer (DeepSpeed)" if deepspeed else f"{n} micro batches",
            )
        )
        components.append(
            Component(
                f"{name} cached outputs",
                in_flight * boundary,
                "fwd_bwd",
                f"{in_flight} in-flight micro batches",
            )
        )
    return components


def activation_terms_for(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> dict[str, list[ActivationTerm]]:
    return {
        "block": block_activation_terms(args, layout, workload, prec),
        "checkpointed block": checkpointed_block_terms(args, layout, workload, prec),
        "embedding": embedding_terms(args, layout, workload, prec),
        "head": head_terms(args, layout, workload, prec),
        "loss": loss_saved_terms(args, layout, workload, prec),
    }


def validate_plan(args: BloomArgs, layout: Layout, workload: Workload) -> None:
    """Rejects what the estimate cannot describe, with what to change."""
    if args.n_head % layout.tp or args.vocab_size % layout.tp:
        raise PlanError(
            f"tp = {layout.tp} must divide n_head = {args.n_head} and vocab_size = "
            f"{args.vocab_size}"
        )
    if layout.zero_stage not in (1, 2, 3):
        raise PlanError(f"zero_stage = {layout.zero_stage}; valid: 1, 2, 3")
    if workload.precision not in ("bf16", "fp32"):
        raise PlanError(f"precision = {workload.precision!r}; valid: bf16, fp32")
    if workload.recompute not in RECOMPUTE_MODES:
        raise PlanError(f"recompute = {workload.recompute!r}; valid: {', '.join(RECOMPUTE_MODES)}")
    if workload.recompute == "selective" and workload.recompute_every < 1:
        raise PlanError(f"recompute_every must be >= 1, got {workload.recompute_every}")
    if workload.optimizer not in OPTIMIZER_IMPLS:
        raise PlanError(f"optimizer = {workload.optimizer!r}; valid: {', '.join(OPTIMIZER_IMPLS)}")
    if workload.micro_batch < 1 or workload.seq_len < 1 or workload.microbatches < 1:
        raise PlanError("micro_batch, seq_len and microbatches must be positive")
    if layout.pp > 1 and workload.microbatches < layout.pp:
        raise PlanError(
            f"{workload.microbatches} micro batches for pp = {layout.pp}: a pipeline needs at "
            f"least one per stage"
        )
    if layout.num_stages > args.n_layer:
        raise PlanError(f"{layout.num_stages} pipeline stages for {args.n_layer} layers")
    if layout.pp > 1 and layout.pp_schedule not in PIPELINE_SCHEDULES:
        raise PlanError(
            f"pp_schedule = {layout.pp_schedule!r}; valid: {', '.join(PIPELINE_SCHEDULES)}"
        )


def estimate_rank(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    pp_rank: int = 0,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> RankEstimate:
    """Every component of pipeline rank `pp_rank`'s memory."""
    validate_plan(args, layout, workload)
    prec = Precision.of(layout, workload)
    params = rank_parameters(args, layout, pp_rank)
    components = model_state_components(params, layout, workload, prec)
    terms = activation_terms_for(args, layout, workload, prec)
    stage_ids = rank_stage_ids(layout, pp_rank)
    in_flight = in_flight_microbatches(layout, workload.microbatches, pp_rank)
    workings = []
    for stage_id, count in zip(stage_ids, in_flight, strict=True):
        stage_components, working = _stage_activation_components(
            args, layout, workload, prec, stage_id, count, terms
        )
        components += stage_components
        components += _pipeline_buffer_components(args, layout, workload, prec, stage_id, count)
        workings.append(working)
    components.append(
        _backward_transient(
            args, layout, workload, prec, params, stage_ids, max(workings), device_type
        )
    )
    return RankEstimate(pp_rank, components, terms, overhead or Overhead.none())


def _backward_transient(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    prec: Precision,
    params: list[ParamTensor],
    stage_ids: list[int],
    block_working: int,
    device_type: str,
) -> Component:
    """The larger of the loss's buffers (last stage) and the block backward working set. The
    latter also holds the root unit's gradients (produced by the head, first in backward) and,
    under FSDP, one block's unsharded gradient plus its fp32 reduce-scatter input."""
    units = unit_numels(params)
    root_grad_bytes = prec.compute if layout.uses_fsdp or layout.zero_stage == 1 else FP32
    working = block_working
    parts = ["block backward buffers"]
    if layout.uses_fsdp or not gradients_persist(layout, workload):
        working += root_grad_bytes * units.get("root", 0)
        parts.append("root-unit grads")
    if layout.uses_fsdp:
        largest_block = max((n for u, n in units.items() if u != "root"), default=0)
        working += (prec.compute + FP32) * largest_block
        parts.append("one block's unsharded grad + fp32 reduce-scatter input")
        if layout.zero_stage == 3:
            working += 2 * prec.compute * largest_block
            parts.append("current + prefetched block re-gathered")
    candidates = [Component("backward working set", working, "fwd_bwd", " + ".join(parts))]
    if layout.num_stages - 1 in stage_ids:
        candidates.append(loss_transient(args, layout, workload, prec, device_type))
    worst = max(candidates, key=lambda c: c.bytes)
    return Component(
        f"backward transient: {worst.name}",
        worst.bytes,
        "fwd_bwd",
        worst.formula + " (largest of: " + ", ".join(c.name for c in candidates) + ")",
    )


@dataclass
class Plan:
    """The estimate of every pipeline rank; `worst` is the one that needs the most memory."""

    ranks: list[RankEstimate]

    @property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.device_bytes)


def estimate(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> Plan:
    """The estimate of every pipeline rank."""
    return Plan(
        [estimate_rank(args, layout, workload, r, overhead, device_type) for r in range(layout.pp)]
    )


def largest_fitting_micro_batch(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    device_bytes: int,
    local_batch: int,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> tuple[int, Plan | None]:
    """The largest micro batch dividing `local_batch` (samples per data-parallel rank per step)
    whose worst rank fits in `device_bytes`, and its plan; (0, None) if none fits."""
    best: tuple[int, Plan | None] = (0, None)
    for micro in range(1, local_batch + 1):
        if local_batch % micro or (layout.pp > 1 and local_batch // micro < layout.pp):
            continue
        candidate = dataclasses.replace(
            workload, micro_batch=micro, microbatches=local_batch // micro
        )
        plan = estimate(args, layout, candidate, overhead, device_type)
        if plan.worst.device_bytes <= device_bytes:
            best = (micro, plan)
    return best


def recompute_options(n_layer: int) -> list[tuple[str, int]]:
    """From least to most recompute: none, selective every n_layer ... every 2, full."""
    options = [("none", 0)]
    options += [("selective", every) for every in range(n_layer, 1, -1)]
    return options + [("full", 1)]


def least_recompute_that_fits(
    args: BloomArgs,
    layout: Layout,
    workload: Workload,
    device_bytes: int,
    overhead: Overhead | None = None,
    device_type: str = "cuda",
) -> tuple[Workload, Plan] | None:
    """The activation-checkpointing setting with the least recomputation that fits: recompute
    costs a forward per checkpointed block, so fewer checkpointed blocks is faster."""
    seen_counts = set()
    for mode, every in recompute_options(args.n_layer):
        candidate = dataclasses.replace(workload, recompute=mode, recompute_every=max(every, 1))
        checkpointed = sum(_is_checkpointed(i, candidate) for i in range(args.n_layer))
        if checkpointed in seen_counts:
            continue  # same blocks checkpointed as a cheaper option already tried
        seen_counts.add(checkpointed)
        plan = estimate(args, layout, candidate, overhead, device_type)
        if plan.worst.device_bytes <= device_bytes:
            return candidate, plan
    return None


# --------------------------------------------------------------------------------- reporting


def format_rank(estimate_: RankEstimate) -> str:
    """A table of the components and totals of one rank."""
    phases = {"resident": "resident", "fwd_bwd": "fwd/bwd", "optimizer": "opt step"}
    width = max(len(c.name) for c in estimate_.components) + 2
    lines = [f"{'component':<{width}}{'when':>9}{'GiB':>10}  formula"]
    for c in estimate_.components:
        lines.append(f"{c.name:<{width}}{phases[c.phase]:>9}{c.gib:>10.3f}  {c.formula}")
    rule = "-" * (width + 19)
    peak = estimate_.peak_phase
    lines += [
        rule,
        f"{'resident':<{width}}{'':>9}{estimate_.phase_bytes('resident') / GiB:>10.3f}",
        f"{'+ forward/backward peak':<{width}}{'':>9}"
        f"{estimate_.phase_bytes('fwd_bwd') / GiB:>10.3f}"
        + ("  <- peak" if peak == "fwd_bwd" else ""),
        f"{'+ optimizer step':<{width}}{'':>9}"
        f"{estimate_.phase_bytes('optimizer') / GiB:>10.3f}"
        + ("  <- peak" if peak == "optimizer" else ""),
        f"{'allocated peak':<{width}}{'':>9}{estimate_.allocated_peak / GiB:>10.3f}",
        f"{'framework overhead (assumed)':<{width}}{'':>9}{estimate_.overhead_bytes / GiB:>10.3f}"
        f"  context {estimate_.overhead.context_bytes / GiB:.2f} GiB + "
        f"{estimate_.overhead.fragmentation:.0%} fragmentation",
        f"{'device memory needed':<{width}}{'':>9}{estimate_.device_bytes / GiB:>10.3f}",
    ]
    return "\n".join(lines)


def format_activation_terms(estimate_: RankEstimate) -> str:
    """The per-micro-batch activation terms (the Korthikanti-style breakdown)."""
    lines = []
    for part, terms in estimate_.activation_terms.items():
        lines.append(f"[{part}] {_sum(terms) / 2**20:.2f} MiB per micro batch")
        for t in terms:
            lines.append(
                f"  {t.name:<40}{t.elements:>16,} x {t.bytes_per_element} B"
                f" = {t.bytes / 2**20:>10.2f} MiB   {t.source}"
            )
    return "\n".join(lines)


def rank_to_dict(estimate_: RankEstimate) -> dict:
    return {
        "pp_rank": estimate_.pp_rank,
        "components": [
            {"name": c.name, "bytes": c.bytes, "gib": c.gib, "phase": c.phase, "formula": c.formula}
            for c in estimate_.components
        ],
        "resident_bytes": estimate_.phase_bytes("resident"),
        "fwd_bwd_bytes": estimate_.phase_bytes("fwd_bwd"),
        "optimizer_bytes": estimate_.phase_bytes("optimizer"),
        "peak_phase": estimate_.peak_phase,
        "allocated_peak_bytes": estimate_.allocated_peak,
        "overhead_bytes": estimate_.overhead_bytes,
        "device_bytes": estimate_.device_bytes,
        "device_gib": estimate_.device_bytes / GiB,
        "activation_terms": {
            part: [dataclasses.asdict(t) | {"bytes": t.bytes} for t in terms]
            for part, terms in estimate_.activation_terms.items()
        },
    }

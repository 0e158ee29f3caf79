"""What the planner is given and what an estimate is made of: the layout over devices, the
workload of one data-parallel rank, the framework overhead, the bytes per element they imply,
which blocks are recomputed, and the named components and activation terms an estimate lists."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from bloomnative.config import (
    LoRATarget,
    OptimizerImpl,
    ParallelismConfig,
    QuantizeBase,
    RecomputeMode,
)
from bloomnative.parallel.dims import ParallelDims
from bloomnative.parallel.fsdp import uses_fsdp

GiB = 2**30
FP32, BF16, INT64 = 4, 2, 8

RECOMPUTE_MODES: tuple[str, ...] = typing.get_args(RecomputeMode)
ATTENTION_MEMORY = ("flash", "sdpa_efficient", "materialized", "cpu_math")
OPTIMIZER_IMPLS: tuple[str, ...] = (*typing.get_args(OptimizerImpl), "bf16", "8bit")
ADAPTER_TARGETS: tuple[str, ...] = typing.get_args(LoRATarget)
FLOAT8_RECIPES = ("none", "rowwise", "tensorwise")


class PlanError(ValueError):
    """An input the planner cannot estimate, described with what to change."""


@dataclass(frozen=True)
class Layout:
    """How the model is split over devices: a [parallelism] section at a world size. Its degrees
    are read from `dims` only (a layout may be varied by replacing them), everything else from
    `parallelism`."""

    dims: ParallelDims
    """dp_replicate x dp_shard x cp x tp x pp, and what follows from them (dp, fsdp_shards)."""
    parallelism: ParallelismConfig
    """The section's options: pipeline schedule and split, sequence and loss parallelism,
    cpu_offload (FSDP2's CPUOffloadPolicy: sharded weights, gradients and AdamW moments, and
    the optimizer step, in host memory, counted as "host"), and zero_stage: 2 and 3 are FSDP2
    (weights, gradients and optimizer states sharded over dp_shard; 3 frees gathered weights
    after each block's forward); 1, which only the planner takes, is Megatron-DeepSpeed as
    BLOOM-176B ran (`deepspeed`)."""
    pp_keeps_outputs: bool = False
    """torch.distributed.pipelining's `step(return_outputs=True)` default: the last stage keeps
    every micro batch's logits and concatenates them at the end of the step. The trainer passes
    return_outputs=False; True models code that keeps the default."""

    @property
    def num_stages(self) -> int:
        return self.dims.pp * self.parallelism.pp_stages_per_rank

    @property
    def sequence_shards(self) -> int:
        """Shards of the residual stream along the sequence (tp with sequence parallelism)."""
        return self.dims.tp if self.dims.tp > 1 and self.parallelism.sequence_parallel else 1

    @property
    def deepspeed(self) -> bool:
        """zero_stage 1: the model in bf16, DeepSpeed's BF16Optimizer (bf16 weights, bf16 and
        fp32 gradients replicated; fp32 master weights and AdamW moments sharded over all
        data-parallel ranks) and DeepSpeed's pipeline buffers. Estimated only: the trainer does
        not implement it."""
        return self.parallelism.zero_stage == 1

    @property
    def reshards_after_forward(self) -> bool:
        """zero_stage 3: FSDP2 frees each block's gathered weights after its forward and gathers
        them again for its backward (2 keeps them until the backward)."""
        return self.parallelism.zero_stage == 3


@dataclass(frozen=True)
class Adapters:
    """Low-rank adapters on the blocks' linear layers (`[lora]`, bloomnative.adapters): the base
    is frozen, so only the adapters have gradients and AdamW moments."""

    rank: int
    targets: tuple[str, ...]
    """The adapted layers of every block, by name (`config.LoRATarget`)."""
    quantize_base: QuantizeBase = "none"
    """"nf4" (QLoRA): the blocks' frozen linear weights in torchao's NF4 tensor
    (bloomnative.adapters.quantize), not in fp32."""


@dataclass(frozen=True)
class Workload:
    """What one data-parallel rank computes per optimizer step, and how."""

    micro_batch: int
    seq_len: int
    """Tokens per sample (the whole sequence: a context-parallel rank holds seq_len / cp)."""
    microbatches: int = 1
    """Micro batches per optimizer step on one data-parallel rank (gradient accumulation; the
    pipeline's micro batches when pp > 1)."""
    precision: str = "bf16"
    """"bf16": bf16 compute, fp32 master weights and gradients; "fp32"."""
    recompute: RecomputeMode = "none"
    """Activation checkpointing: "none", "full" (every block) or "selective" (every N-th)."""
    recompute_every: int = 2
    attention: str = "flash"
    """What the attention kernel keeps for backward: "flash" (bloomnative's Triton and flex
    kernels: q, k, v, output, logsumexp), "sdpa_efficient" (CUDA SDPA with the additive ALiBi
    bias: also keeps the [heads, s, s] bias), "materialized" (Megatron's fused softmax: keeps the
    [b, heads, s, s] probabilities) or "cpu_math" (CPU SDPA's math path: as materialized, in
    fp32 even for bf16 inputs)."""
    segments: bool = False
    """Each sample's attention stays inside segments (`DataConfig.segmented`: packed pairs, or
    documents cut at the EOD): SDPA's additive bias is then one per sample, [b, heads, s, s]."""
    fused_loss: bool = False
    """Chunked lm head + cross-entropy (kernels.linear_cross_entropy): no [tokens, vocab] tensor."""
    compiled_loss: bool = False
    """The unfused loss under torch.compile (the trainer's with compile.enable and tp = 1): it keeps
    the logits themselves for backward instead of fp32 log-probabilities, and its backward writes
    the logits' gradient in their dtype in one pass."""
    dropout: bool = False
    """Dropout is on (model.hidden_dropout / attention_dropout > 0; BLOOM trained with 0.1 on
    both, Megatron's defaults): the hidden-dropout masks are kept, and with a materialised
    attention the attention-dropout mask too (flash kernels regenerate theirs)."""
    optimizer: str = "fused"
    """AdamW implementation: "fused" (no temporaries), "foreach" (one fp32 temporary the size of
    the trainable local parameters) or "for-loop" (one the size of the largest of them), all with
    fp32 moments; or, from optimizer.state_dtype, "bf16" (train/bf16_adamw.py: bf16 moments) or
    "8bit" (torchao's AdamW8bit, 8-bit moments)."""
    offload: bool = False
    """activation_checkpoint.offload: the blocks that are not recomputed keep their saved
    tensors in host memory (parallel/activation_offload.py), counted as "host"; one block's
    are on the device at a time (the block whose backward runs)."""
    adapters: Adapters | None = None
    """Low-rank adapters, the base frozen; None: every parameter trains. A block linear without
    an adapter keeps no input for backward (`activations.block_activation_terms`)."""
    float8: str = "none"
    """The FP8 recipe of the block linears (`[quantize] linear = "float8_<recipe>"`: "rowwise"
    or "tensorwise", torchao's float8 training), or "none". It keeps for backward what the
    linear it replaces keeps (`activations.block_activation_terms`); its backward holds FP8
    copies of its operands and their scales (`activations.float8_backward_casts`)."""
    float8_all_gather: bool = False
    """`quantize.fsdp_float8_all_gather`: FSDP2 gathers the FP8 block linears' weights in e4m3,
    one byte an element instead of the compute dtype's (`model_states.unit_gathered_bytes`)."""


@dataclass(frozen=True)
class Overhead:
    """Device memory outside the allocator's live tensors: on CUDA an assumption (the defaults
    below), on CPU measured (`cpu`)."""

    context_bytes: int = int(1.5 * GiB)
    """CUDA context + cuBLAS workspaces + NCCL communicator buffers (about 0.5-1 GiB of context
    on Hopper with lazy module loading, plus a few hundred MiB per NCCL communicator)."""
    fragmentation: float = 0.10
    """Caching-allocator slack as a fraction of the allocated peak (reserved / allocated - 1;
    typically 5-20% in training loops with varying shapes)."""

    @classmethod
    def none(cls) -> Overhead:
        """No overhead: a comparison with allocated (not reserved) bytes."""
        return cls(context_bytes=0, fragmentation=0.0)

    @classmethod
    def cpu(cls) -> Overhead:
        """A CPU training process's resident set (what /usr/bin/time -v, cluster accounting and
        `mem_peak_gib` measure) beyond its live tensors, measured with torch 2.13 and glibc
        2.36 (docs/benchmarks.md, "Memory planner against CPU measurements"):

        - context: the process itself, 0.43 GiB (Python, torch's and bloomnative's libraries,
          OpenMP and oneDNN, the data loader): the peak resident set of a 0.3M-parameter run
          less its 0.03 GiB of tensors, and the resident set of larger runs, freed memory
          returned (malloc_trim), less their live tensors (0.42-0.44 GiB);
        - fragmentation: free memory glibc's malloc keeps. It serves allocations below its
          mmap threshold, which rises to the size of each mmapped block it frees (up to 32
          MiB), from its heaps, and returns a freed chunk only from a heap's top, so blocks and
          activations of a few MiB leave resident holes. Measured at the peak: 4-7% of the
          allocated peak at BLOOM-560m's shape, 1-28% on smaller models (the larger shares where
          the allocated peak is small); 0.3% with a fixed threshold (MALLOC_MMAP_THRESHOLD_).
          8%: the 560m figure with a margin, as the holes grow over the first steps."""
        return cls(context_bytes=int(0.43 * GiB), fragmentation=0.08)

    @classmethod
    def for_device(cls, device_type: str) -> Overhead:
        """The default of a device type: CUDA's assumption, or a CPU process's (`cpu`)."""
        return cls() if device_type == "cuda" else cls.cpu()


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the tensors the step creates, and how the weights are held."""

    compute: int
    """Weights in use, activations, the residual stream and the pipeline's boundary tensors:
    2 with bf16 (FSDP2's MixedPrecisionPolicy on every layout, or Megatron's bf16 model with
    zero_stage 1), 4 with fp32."""
    fsdp: bool
    """FSDP2 wraps the model (`parallel.fsdp.uses_fsdp`: data parallelism, or bf16 on any
    layout; zero_stage 2 or 3)."""

    @classmethod
    def of(cls, layout: Layout, workload: Workload) -> Precision:
        bf16 = workload.precision == "bf16"
        fsdp = not layout.deepspeed and uses_fsdp(layout.dims.dp * layout.dims.cp, bf16)
        return cls(compute=BF16 if bf16 else FP32, fsdp=fsdp)


@dataclass(frozen=True)
class Component:
    """A named amount of memory, the moment it is counted in, and how it was computed."""

    name: str
    bytes: int
    phase: str
    """"resident", "fwd_bwd" (the forward/backward peak), "step_end" (after the backward:
    merged pipeline outputs, clipping, the optimizer step) or "host" (offloaded to CPU memory,
    not counted in the device's)."""
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


def is_checkpointed(index: int, workload: Workload) -> bool:
    """Mirrors `apply_activation_checkpointing`: every block, or indices divisible by every."""
    if workload.recompute == "full":
        return True
    return workload.recompute == "selective" and index % workload.recompute_every == 0


def recompute_options(n_layer: int) -> list[tuple[RecomputeMode, int]]:
    """From least to most recompute: none, selective every n_layer ... every 2, full."""
    options: list[tuple[RecomputeMode, int]] = [("none", 0)]
    options += [("selective", every) for every in range(n_layer, 1, -1)]
    return options + [("full", 1)]

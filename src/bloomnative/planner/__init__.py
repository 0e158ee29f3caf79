"""Per-rank memory planner: what one device holds while bloomnative trains a BLOOM model.

A cost model, not a plan: it predicts the memory of the layouts the parallel plans
(bloomnative.parallel) build, and the trainer asks it which activation checkpointing fits.
The estimate is a list of named components, each computed from a formula given in its
docstring, for every pipeline rank; the plan reports the rank that needs the most. Three moments
of a training step are considered:

- resident: lives for the whole step (fp32 master weights and AdamW moments, the fp32
  gradients once a micro batch has been back-propagated, pipeline receive buffers);
- forward/backward peak: resident + working (bf16, gathered) parameters + the stored activations
  of the micro batches in flight + the largest transient of the backward (the loss's fp32
  buffers, or one recomputed block and its gradient buffers);
- end of step: resident + gradients + the AdamW step's temporaries (and a pipeline's merged
  outputs).

The allocated peak is resident + the larger of the other two; the device needs that plus the
framework overhead (`Overhead`): on CUDA the context, NCCL buffers and caching-allocator
fragmentation, an assumption with a default; on CPU the process's runtime and the free memory
glibc's malloc keeps, measured (`Overhead.cpu`).

Sources
- Model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (2 + 2 + 12 bytes per parameter for mixed-precision Adam, stage 1 shards
  the 12), with FSDP2's semantics for zero_stage 2 and 3 (`bloomnative.parallel.fsdp`).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, adjusted term by term for
  BLOOM and for the attention kernel (`block_activation_terms` lists every kept term).
- Pipelines: the warm-up depths of torch.distributed.pipelining's schedules, its receive
  buffers (one per micro batch, allocated once and kept) and its kept outputs.

Checked against CPU measurements within 15% (tests/planner/test_memory_measured.py: allocated
bytes, and a process's peak resident set), against BLOOM-560m's peak resident set on CPU within
1% (docs/benchmarks.md) and against BLOOM-176B's published figures (docs/performance.md).

Modules: `inputs` (layout, workload, overhead, precision, components), `model_states`
(parameters and their ZeRO/FSDP sharding), `activations` (per-micro-batch terms and the loss),
`pipeline_buffers`, `rank_estimate` (assembly, `estimate`, and the searches for the largest
micro batch and the least recompute that fit) and `from_config` (a config's layout and workload,
and activation_checkpoint.mode = "auto"). Exported here: what the trainer, preflight, the tools
and the tests use (docs/api.md).
"""

from bloomnative.planner.activations import (
    block_activation_terms,
    block_linear_shapes,
    float8_linear_casts,
    loss_saved_terms,
    loss_transient,
)
from bloomnative.planner.from_config import (
    RecomputeChoice,
    auto_recompute,
    layout_from_config,
    least_recompute_or_raise,
    local_batch_size,
    workload_from_config,
)
from bloomnative.planner.inputs import (
    ATTENTION_MEMORY,
    RECOMPUTE_MODES,
    Adapters,
    GiB,
    Layout,
    Overhead,
    PlanError,
    Precision,
    Workload,
    recompute_options,
)
from bloomnative.planner.model_states import (
    ParamTensor,
    block_parameters,
    rank_parameters,
    stage_blocks,
)
from bloomnative.planner.pipeline_buffers import (
    in_flight_microbatches,
)
from bloomnative.planner.rank_estimate import (
    Plan,
    RankEstimate,
    estimate,
    estimate_rank,
    largest_fitting_micro_batch,
    least_recompute_that_fits,
    ring_attention_buffers,
)

__all__ = [
    "Adapters",
    "block_activation_terms",
    "block_linear_shapes",
    "float8_linear_casts",
    "loss_saved_terms",
    "loss_transient",
    "RecomputeChoice",
    "auto_recompute",
    "layout_from_config",
    "least_recompute_or_raise",
    "local_batch_size",
    "workload_from_config",
    "ATTENTION_MEMORY",
    "RECOMPUTE_MODES",
    "GiB",
    "Layout",
    "Overhead",
    "PlanError",
    "Precision",
    "Workload",
    "recompute_options",
    "ParamTensor",
    "block_parameters",
    "rank_parameters",
    "stage_blocks",
    "in_flight_microbatches",
    "Plan",
    "RankEstimate",
    "estimate",
    "estimate_rank",
    "largest_fitting_micro_batch",
    "least_recompute_that_fits",
    "ring_attention_buffers",
]

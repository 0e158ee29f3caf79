"""Per-rank memory planner: what one device holds while bloomnative trains a BLOOM model.

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
framework overhead (CUDA context, NCCL buffers, caching-allocator fragmentation), which is an
assumption with a default, not a measurement.

Sources
- Model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (2 + 2 + 12 bytes per parameter for mixed-precision Adam, stage 1 shards
  the 12), with FSDP2's semantics for zero_stage 2 and 3 (`bloomnative.parallel.fsdp`).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, adjusted term by term for
  BLOOM and for the attention kernel (`block_activation_terms` lists every kept term).
- Pipelines: the warm-up depths of torch.distributed.pipelining's schedules, its receive
  buffers (one per micro batch, allocated once and kept) and its kept outputs.

Checked against CPU measurements within 15% (tests/perf/test_memory_measured.py) and against
BLOOM-176B's published figures (docs/performance.md).

Modules: `inputs` (layout, workload, overhead, precision), `from_config`, `parameters`,
`components`, `recompute`, `model_states`, `activations`, `loss`, `backward`,
`pipeline_buffers`, `stage_activations`, `rank_estimate` (assembly, `estimate`), `search`
(largest micro batch, least recompute) and `auto_recompute` (activation_checkpoint.mode =
"auto"). Everything public is re-exported here.
"""

from bloomnative.parallel.memory_estimate.activations import (
    attention_terms,
    block_activation_terms,
    checkpointed_block_terms,
    embedding_terms,
    head_terms,
)
from bloomnative.parallel.memory_estimate.auto_recompute import (
    RecomputeChoice,
    choose_recompute,
    least_recompute_or_raise,
)
from bloomnative.parallel.memory_estimate.backward import (
    block_backward_buffers,
    ring_attention_buffers,
)
from bloomnative.parallel.memory_estimate.components import (
    ActivationTerm,
    Component,
)
from bloomnative.parallel.memory_estimate.from_config import (
    attention_memory_kind,
    compiles_the_loss,
    layout_from_config,
    local_batch_size,
    workload_from_config,
)
from bloomnative.parallel.memory_estimate.inputs import (
    ATTENTION_MEMORY,
    BF16,
    FP32,
    INT64,
    OPTIMIZER_IMPLS,
    PIPELINE_SCHEDULES,
    RECOMPUTE_MODES,
    GiB,
    Layout,
    Overhead,
    PlanError,
    Precision,
    Workload,
)
from bloomnative.parallel.memory_estimate.loss import (
    fused_loss_chunk_rows,
    local_vocab,
    loss_saved_terms,
    loss_transient,
)
from bloomnative.parallel.memory_estimate.model_states import (
    gradients_persist,
    model_state_components,
)
from bloomnative.parallel.memory_estimate.parameters import (
    ParamTensor,
    block_parameters,
    rank_parameters,
    rank_stage_ids,
    stage_blocks,
    stage_parameters,
    unit_numels,
)
from bloomnative.parallel.memory_estimate.pipeline_buffers import (
    in_flight_microbatches,
)
from bloomnative.parallel.memory_estimate.rank_estimate import (
    Plan,
    RankEstimate,
    activation_terms_for,
    estimate,
    estimate_rank,
    validate_plan,
)
from bloomnative.parallel.memory_estimate.recompute import (
    recompute_options,
)
from bloomnative.parallel.memory_estimate.search import (
    largest_fitting_micro_batch,
    least_recompute_that_fits,
)

__all__ = [
    "GiB",
    "FP32",
    "BF16",
    "INT64",
    "RECOMPUTE_MODES",
    "ATTENTION_MEMORY",
    "OPTIMIZER_IMPLS",
    "PIPELINE_SCHEDULES",
    "PlanError",
    "Layout",
    "Workload",
    "Overhead",
    "attention_memory_kind",
    "compiles_the_loss",
    "layout_from_config",
    "local_batch_size",
    "workload_from_config",
    "ParamTensor",
    "block_parameters",
    "stage_blocks",
    "stage_parameters",
    "rank_stage_ids",
    "rank_parameters",
    "unit_numels",
    "Component",
    "ActivationTerm",
    "Precision",
    "model_state_components",
    "gradients_persist",
    "attention_terms",
    "block_activation_terms",
    "checkpointed_block_terms",
    "embedding_terms",
    "head_terms",
    "local_vocab",
    "fused_loss_chunk_rows",
    "loss_saved_terms",
    "loss_transient",
    "block_backward_buffers",
    "ring_attention_buffers",
    "in_flight_microbatches",
    "RankEstimate",
    "activation_terms_for",
    "validate_plan",
    "estimate_rank",
    "Plan",
    "estimate",
    "largest_fitting_micro_batch",
    "recompute_options",
    "least_recompute_that_fits",
    "RecomputeChoice",
    "choose_recompute",
    "least_recompute_or_raise",
]

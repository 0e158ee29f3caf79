"""Parallelism applied from outside to a plain `Bloom`: device mesh, FSDP2, tensor/sequence/loss
parallelism, context parallelism (ring attention), pipeline stages, activation checkpointing,
activation offload to host memory, regional compile and FP8 block linears (torchao).

Each plan is a function of a module, a mesh and plain keyword arguments, applied to the
meta-device model in the order docs/architecture.md gives with the reason for each place.
See docs/api.md and examples/own_training_loop.py.
"""

from bloomnative.parallel.activation_checkpoint import apply_activation_checkpointing
from bloomnative.parallel.activation_offload import apply_activation_offload
from bloomnative.parallel.compile import apply_compile
from bloomnative.parallel.context_parallel import apply_context_parallel, shard_sequence
from bloomnative.parallel.dims import LayoutError, ParallelDims
from bloomnative.parallel.float8 import apply_float8, precompute_float8_scales
from bloomnative.parallel.fsdp import apply_fsdp
from bloomnative.parallel.grad_clip import clip_grad_norm_
from bloomnative.parallel.init import init_weights
from bloomnative.parallel.pipeline import (
    Pipeline,
    PipelineStages,
    TiedWeightSync,
    build_pipeline,
    split_for_pipeline,
)
from bloomnative.parallel.schedules import SCHEDULES
from bloomnative.parallel.tensor_parallel import apply_tensor_parallel

__all__ = [
    "SCHEDULES",
    "LayoutError",
    "ParallelDims",
    "Pipeline",
    "PipelineStages",
    "TiedWeightSync",
    "apply_activation_checkpointing",
    "apply_activation_offload",
    "apply_compile",
    "apply_context_parallel",
    "apply_float8",
    "apply_fsdp",
    "apply_tensor_parallel",
    "build_pipeline",
    "clip_grad_norm_",
    "init_weights",
    "precompute_float8_scales",
    "shard_sequence",
    "split_for_pipeline",
]

"""Parallelism applied from outside to a plain `Bloom`: device mesh, FSDP2, tensor/sequence/loss
parallelism, pipeline stages, activation checkpointing and regional compile."""

from bloomnative.parallel.dims import LayoutError, ParallelDims
from bloomnative.parallel.grad_clip import clip_grad_norm_
from bloomnative.parallel.init import init_weights

__all__ = ["LayoutError", "ParallelDims", "clip_grad_norm_", "init_weights"]

"""Triton kernels for BLOOM training, each an autograd-aware op with a pure-torch reference.

Every op runs its Triton kernel on CUDA tensors (and on CPU under ``TRITON_INTERPRET=1``) and
its torch reference otherwise, so model code calls them unconditionally; see
:mod:`bloomnative.kernels._dispatch` for the rule and ``docs/kernels.md`` for the math.

This folder is the package ``bloomnative.kernels`` through the link ``src/bloomnative/kernels``
(docs/architecture.md). Its modules are imported by their full names: where the repository root
is on ``sys.path``, transformers imports this folder as a top-level ``kernels`` (probing for
Hugging Face's kernel hub package), and that name then refers to these same ops instead of
loading and registering a second copy of each.
"""

from bloomnative.kernels._dispatch import poison_outputs, use_triton
from bloomnative.kernels.bias_gelu import bias_gelu, bias_gelu_reference
from bloomnative.kernels.flash_alibi_attention import (
    flash_alibi_attention,
    flash_alibi_attention_block,
    flash_alibi_attention_block_backward,
    segment_bounds,
)
from bloomnative.kernels.flash_alibi_reference import (
    alibi_attention_block_backward_reference,
    alibi_attention_block_reference,
    flash_alibi_attention_reference,
)
from bloomnative.kernels.flex_alibi_attention import causal_block_mask, flex_alibi_attention
from bloomnative.kernels.layer_norm import layer_norm, layer_norm_reference
from bloomnative.kernels.linear_cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_reference,
    vocab_parallel_linear_cross_entropy,
)

__all__ = [
    "alibi_attention_block_backward_reference",
    "alibi_attention_block_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "causal_block_mask",
    "flash_alibi_attention",
    "flash_alibi_attention_block",
    "flash_alibi_attention_block_backward",
    "flash_alibi_attention_reference",
    "flex_alibi_attention",
    "layer_norm",
    "layer_norm_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "poison_outputs",
    "segment_bounds",
    "use_triton",
    "vocab_parallel_linear_cross_entropy",
]

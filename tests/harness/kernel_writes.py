"""What each Triton kernel writes, and the calls that launch every kernel in each configuration
family a GPU runs: the contract two tests check from both sides.

* ``test_gpu_route.py``: on the route a GPU takes (torch.compile tracing the ``triton_op``
  bodies, gpu_route.py), torch's Triton mutation analysis reports exactly ``WRITES`` for every
  launch. A tensor it misses may be read by compiled code before the kernel wrote it; a tensor
  it adds is copied for nothing (or is an error, for a leaf that requires grad).
* ``test_kernel_writes.py``: run by Triton's interpreter, every launch writes into exactly
  these tensors, and nowhere outside its tensor arguments.

``CASES`` covers each dtype and head_dim family of the attention (powers of two, the split
80 = 64 + 16 and 96 = 64 + 32, padded 72 through pointer loads), causal and not, dropout, packed
segments, a layout TMA cannot describe, the ring-attention blocks with offsets and segments,
both LayerNorm backwards (one-pass and BLOOM-176B's 14336 wide), bias-GeLU and the fused loss.
Shapes are small: the interpreter runs them, and tracing does not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bloomnative.kernels import (
    bias_gelu,
    flash_alibi_attention,
    flash_alibi_attention_block,
    flash_alibi_attention_block_backward,
    layer_norm,
    linear_cross_entropy,
    segment_bounds,
)

WRITES: dict[str, Callable[[dict], set[str]]] = {
    "_flash_alibi_fwd_kernel": lambda c: {"OUT", "LSE"},
    "_flash_alibi_bwd_preprocess_kernel": lambda c: (
        {"DELTA"} | ({"DQ_ACC"} if c["ZERO_DQ"] else set())
    ),
    "_flash_alibi_bwd_kernel": lambda c: {"DK", "DV"} | ({"DQ_ACC"} if c["WITH_DQ"] else set()),
    "_flash_alibi_bwd_dq_kernel": lambda c: {"DQ"},
    "_layer_norm_fwd_kernel": lambda c: (
        {"Y", "MEAN", "RSTD"} | ({"H_OUT"} if c["HAS_RESIDUAL"] else set())
    ),
    "_layer_norm_bwd_kernel": lambda c: {"DX", "DW_PARTIAL", "DB_PARTIAL"},
    "_layer_norm_bwd_row_sums_kernel": lambda c: {"ROW_SUMS"},
    "_layer_norm_bwd_wide_kernel": lambda c: {"DX", "DW_PARTIAL", "DB_PARTIAL"},
    "_bias_gelu_fwd_kernel": lambda c: {"OUT"},
    "_bias_gelu_bwd_kernel": lambda c: {"DX", "DBIAS_PARTIAL"},
    "_row_stats_kernel": lambda c: {"ROW_MAX", "ROW_SUMEXP", "TARGET_LOGIT"},
    "_row_grad_kernel": lambda c: {"GRAD"},
}
"""Kernel name -> its constexprs -> the tensor parameters it writes."""

OPAQUE_OPS = {"bloomnative::linear_cross_entropy": ("_row_stats_kernel", "_row_grad_kernel")}
"""Ops that stay one opaque node in a compiled graph, with the kernels they launch eagerly.
The fused loss computes its gradients in the forward (a chunk loop of cuBLAS matmuls and two
row kernels writing in place): nothing to gain from tracing it, so torch.compile never analyses
these two kernels (the interpreter test still checks their writes)."""


@dataclass(frozen=True)
class Case:
    """One call of a public op, forward and (when an input requires grad) backward of the sum
    of its outputs: ``build()`` returns the function and its inputs."""

    name: str
    build: Callable[[], tuple[Callable[..., object], tuple]]
    on_an_h100: dict = field(default_factory=dict)
    """Constexprs every attention launch of the case takes on an H100 (the GPU route checks)."""


def _leaves(*shape_dtype_scale: tuple) -> tuple[torch.Tensor, ...]:
    return tuple(
        (scale * torch.randn(*shape)).to(dtype).requires_grad_()
        for shape, dtype, scale in shape_dtype_scale
    )


def _attention(
    head_dim: int,
    dtype: torch.dtype,
    causal: bool = True,
    dropout_p: float = 0.0,
    segments: tuple[int, ...] = (),
):
    def build():
        q, k, v = _leaves(*[((1, 2, 40, head_dim), dtype, 1.0)] * 3)
        slopes = torch.tensor([0.5, 0.25])
        seed = torch.tensor(7, dtype=torch.int64)
        ids = torch.arange(len(segments)).repeat_interleave(torch.tensor(segments, dtype=int))

        def attend(q, k, v):
            return flash_alibi_attention(
                q, k, v, slopes, causal=causal, dropout_p=dropout_p, rng_seed=seed,
                segments=segment_bounds(ids[None]) if segments else None,
            )  # fmt: skip

        return attend, (q, k, v)

    return build


def _attention_packed_qkv():
    """q, k, v as views of one [batch, seq, heads, 3, head_dim + 1] tensor: rows 16-byte
    misaligned, so the kernels take pointer loads instead of TMA."""

    def build():
        (qkv,) = _leaves(((1, 40, 2, 3, 65), torch.bfloat16, 1.0))

        def attend(qkv):
            q, k, v = (qkv[:, :, :, i, :64].transpose(1, 2) for i in range(3))
            return flash_alibi_attention(q, k, v, torch.tensor([0.5, 0.25]))

        return attend, (qkv,)

    return build


def _attention_ring_block():
    """One ring-attention block (context parallelism): queries at positions 40..79 against keys
    0..39 of a packed sequence, forward and the block backward, with dropout."""

    def build():
        q, k, v, grad_out = (torch.randn(1, 2, 40, 128, dtype=torch.bfloat16) for _ in range(4))
        slopes = torch.tensor([0.5, 0.25])
        seed = torch.tensor(3, dtype=torch.int64)
        start, end = segment_bounds(torch.tensor([[1] * 30 + [2] * 35 + [3] * 15]))
        block = dict(
            causal=True, softmax_scale=128**-0.5, q_offset=40, k_offset=0, dropout_p=0.1,
            rng_seed=seed, q_segment_start=start[:, 40:].contiguous(),
            k_segment_end=end[:, :40].contiguous(),
        )  # fmt: skip

        def ring_block(q, k, v, grad_out):
            out, lse2 = flash_alibi_attention_block(q, k, v, slopes, **block)
            grads = flash_alibi_attention_block_backward(
                grad_out, q, k, v, out, lse2, slopes, **block
            )
            return out, lse2, *grads

        return ring_block, (q, k, v, grad_out)

    return build


def _layer_norm(n: int, dtype: torch.dtype, residual: bool):
    def build():
        x, w, b = _leaves(((4, n), dtype, 1.0), ((n,), dtype, 0.1), ((n,), dtype, 0.1))
        if not residual:
            return (lambda x, w, b: layer_norm(x, w, b)), (x, w, b)
        (r,) = _leaves(((4, n), dtype, 1.0))
        return (lambda x, w, b, r: layer_norm(x, w, b, residual=r)), (x, w, b, r)

    return build


def _bias_gelu(dtype: torch.dtype):
    def build():
        x, b = _leaves(((4, 96), dtype, 1.0), ((96,), dtype, 0.1))
        return bias_gelu, (x, b)

    return build


def _fused_loss(token_weights: bool = False):
    def build():
        hidden, head = _leaves(((24, 32), torch.bfloat16, 1.0), ((100, 32), torch.bfloat16, 0.2))
        targets = torch.randint(0, 100, (24,))
        targets[::5] = -100  # ignored rows
        weights = torch.rand(24) + 0.1 if token_weights else None  # --norm-target-loss

        def loss(hidden, head):
            return linear_cross_entropy(hidden, head, targets, chunk_size=16, token_weights=weights)

        return loss, (hidden, head)

    return build


_TMA = {"USE_TMA": True, "DQ_TMA": True, "WITH_DQ": True}
_POINTERS = {"USE_TMA": False, "DQ_TMA": False, "WITH_DQ": True}
# head_dim > 80 with dropout or segments: dK/dV, then a dQ kernel that stores dQ (no reduction).
_TMA_TWO_KERNELS = {"USE_TMA": True, "DQ_TMA": False, "WITH_DQ": False}

CASES = [
    Case("attention-bf16-d64-causal", _attention(64, torch.bfloat16), _TMA),
    Case(
        "attention-fp32-d128-causal-dropout",
        _attention(128, torch.float32, dropout_p=0.1),
        _TMA_TWO_KERNELS,
    ),
    Case("attention-bf16-d80-not-causal", _attention(80, torch.bfloat16, causal=False), _TMA),
    Case(
        "attention-fp16-d96-causal-dropout",
        _attention(96, torch.float16, dropout_p=0.1),
        _TMA_TWO_KERNELS,
    ),
    Case("attention-bf16-d72-padded", _attention(72, torch.bfloat16), _POINTERS),
    Case("attention-bf16-d64-packed-qkv-pointer-loads", _attention_packed_qkv(), _POINTERS),
    Case(
        "attention-bf16-d64-packed-segments-dropout",
        _attention(64, torch.bfloat16, dropout_p=0.1, segments=(7, 1, 20, 12)),
        _TMA,
    ),
    Case(
        "attention-ring-block-d128-offsets-segments-dropout",
        _attention_ring_block(),
        _TMA_TWO_KERNELS,
    ),
    Case("layer_norm-bf16-n64-residual", _layer_norm(64, torch.bfloat16, residual=True)),
    Case("layer_norm-fp32-n96", _layer_norm(96, torch.float32, residual=False)),
    Case("layer_norm-bf16-n14336-wide-residual", _layer_norm(14336, torch.bfloat16, True)),
    Case("bias_gelu-bf16", _bias_gelu(torch.bfloat16)),
    Case("bias_gelu-fp32", _bias_gelu(torch.float32)),
    Case("linear_cross_entropy-bf16", _fused_loss()),
    Case("linear_cross_entropy-bf16-token-weights", _fused_loss(token_weights=True)),
]


def run_forward_backward(case: Case, wrap: Callable = lambda fn: fn) -> tuple:
    """Runs ``case`` as a training step would: the forward of ``wrap(fn)`` (e.g. a compiled
    ``fn``), then the backward of the sum of its outputs that require grad. Returns the
    forward's outputs."""
    fn, inputs = case.build()
    outputs = wrap(fn)(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    leaves = [t for t in inputs if t.requires_grad]
    if leaves:
        total = sum(o.float().sum() for o in outputs if o.requires_grad)
        torch.autograd.grad(total, leaves, allow_unused=True)
    return outputs

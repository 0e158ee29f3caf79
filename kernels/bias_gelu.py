"""Fused bias add + tanh GeLU (BLOOM's MLP activation), forward and backward in one pass each.

    y   = x + bias
    out = 0.5 * y * (1 + tanh(k0 * y * (1 + k1 * y^2)))        k0 = sqrt(2/pi), k1 = 0.044715

    d out / d y = 0.5 * (1 + t) + 0.5 * y * (1 - t^2) * k0 * (1 + 3 * k1 * y^2),   t = tanh(...)

The backward recomputes ``y`` and ``t`` from ``x`` and ``bias`` (nothing but the inputs is saved),
writes ``dx = grad * gelu'(y)`` and reduces ``dbias = sum over rows of dx``: each program sums its
rows into one fp32 row of a small partial buffer, and torch sums that buffer.
All arithmetic is fp32; inputs and outputs are fp32, bf16 or fp16.
"""

from __future__ import annotations

import torch

from ._dispatch import (
    autotune,
    check_float_dtype,
    empty,
    kernel_op,
    launch,
    num_programs_for_device,
    tl,
    triton,
    use_triton,
)

# Megatron's constants: k0 = sqrt(2 / pi), k1 = 0.044715 (the kernels spell them out, since a
# Triton kernel cannot read plain module globals).
_K0 = 0.79788456
_K1 = 0.044715


@triton.jit
def _tanh_of_gelu_arg(y):
    # tanh(k0 * y * (1 + k1 * y^2)) as 2 * sigmoid(2z) - 1: saturates cleanly to +-1, and
    # libdevice's tanh is not available in the interpreter.
    z = 0.79788456 * y * (1.0 + 0.044715 * y * y)
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@autotune(
    configs=[
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4),
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 256}, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 256}, num_warps=8),
    ],
    interpreter_config=triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}),
    key=["N"],
)
@triton.jit
def _bias_gelu_fwd_kernel(
    X, BIAS, OUT, M, N, stride_x, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows[:, None] < M) & col_ok[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    bias = tl.load(BIAS + cols, mask=col_ok, other=0.0)
    y = x.to(tl.float32) + bias.to(tl.float32)[None, :]
    t = _tanh_of_gelu_arg(y)
    out = 0.5 * y * (1.0 + t)
    tl.store(
        OUT + rows[:, None] * stride_out + cols[None, :],
        out.to(OUT.dtype.element_ty),
        mask=mask,
    )


# fmt: off
@autotune(
    configs=[
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 256}, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 256}, num_warps=8),
    ],
    interpreter_config=triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}),
    key=["N"],
)
@triton.jit
def _bias_gelu_bwd_kernel(
    GRAD, X, BIAS, DX, DBIAS_PARTIAL, M, N, stride_grad, stride_x, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Grid: (column blocks, row groups). Row group g handles row blocks g, g + G, g + 2G, ...
    # and writes its column sums of dx to row g of DBIAS_PARTIAL (even when it had no rows).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    num_groups = tl.num_programs(1)
    col_ok = cols < N
    bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    dbias = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row_start in range(group * BLOCK_M, M, num_groups * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & col_ok[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        g = tl.load(GRAD + rows[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0)
        y = x.to(tl.float32) + bias[None, :]
        t = _tanh_of_gelu_arg(y)
        # d/dy: 0.5 (1 + t) + 0.5 y (1 - t^2) k0 (1 + 3 k1 y^2); 3 k0 k1 = 0.1070322243.
        dgelu = 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * (0.79788456 + 0.1070322243 * y * y)
        dx = g.to(tl.float32) * dgelu
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
        )
        dbias += tl.sum(tl.where(mask, dx, 0.0), axis=0)
    tl.store(DBIAS_PARTIAL + group * N + cols, dbias, mask=col_ok)
# fmt: on


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """View ``t`` as [rows, n] with unit stride along n (copies only if it has to)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


@kernel_op("bloomnative::bias_gelu_fwd")
def _bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n = bias.shape[0]
    x2 = _as_rows(x, n)
    out = empty(x2.shape, x.dtype, x.device)
    m = x2.shape[0]

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

    launch(_bias_gelu_fwd_kernel, grid, x2, bias, out, m, n, x2.stride(0), out.stride(0))
    return out.view(x.shape)


@_bias_gelu_fwd.register_fake
def _(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _row_groups(m: int, device: torch.device) -> int:
    # Enough row groups to fill the GPU, few enough that the dbias partials stay small; a group
    # loops over row blocks, so the count does not depend on the autotuned BLOCK_M.
    return max(1, min(triton.cdiv(m, 64), num_programs_for_device(device, per_sm=4)))


@kernel_op("bloomnative::bias_gelu_bwd")
def _bias_gelu_bwd(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n = bias.shape[0]
    x2 = _as_rows(x, n)
    g2 = _as_rows(grad, n)
    m = x2.shape[0]
    dx = empty(x2.shape, x.dtype, x.device)
    groups = _row_groups(m, x.device)
    dbias_partial = empty((groups, n), torch.float32, x.device)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), groups)

    # fmt: off
    launch(
        _bias_gelu_bwd_kernel, grid, g2, x2, bias, dx, dbias_partial, m, n,
        g2.stride(0), x2.stride(0), dx.stride(0),
    )
    # fmt: on
    return dx.view(x.shape), dbias_partial.sum(0).to(bias.dtype)


@_bias_gelu_bwd.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), torch.empty_like(bias)


def _setup_context(ctx, inputs, output) -> None:
    x, bias = inputs
    ctx.save_for_backward(x, bias)


def _backward(ctx, grad: torch.Tensor):
    x, bias = ctx.saved_tensors
    dx, dbias = _bias_gelu_bwd(grad, x, bias)
    return dx, dbias


_bias_gelu_fwd.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``gelu_tanh(x + bias)`` with Megatron's constants, computed in fp32 (float64
    inputs stay float64), returned in ``x.dtype``."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(compute) + bias.to(compute)
    out = 0.5 * y * (1.0 + torch.tanh(_K0 * y * (1.0 + _K1 * y * y)))
    return out.to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x + bias)`` over the last dimension of ``x`` (bias has shape ``[x.shape[-1]]``).

    Runs the fused Triton kernels on CUDA tensors (or under ``TRITON_INTERPRET=1``), otherwise
    :func:`bias_gelu_reference`. Differentiable in ``x`` and ``bias``.
    """
    if bias.dim() != 1 or x.shape[-1] != bias.shape[0]:
        raise ValueError(
            f"bias_gelu: bias must have shape [{x.shape[-1]}] (the last dim of x, "
            f"x.shape={tuple(x.shape)}), got {tuple(bias.shape)}"
        )
    check_float_dtype("bias_gelu: x", x)
    if not use_triton(x) or x.numel() == 0:
        return bias_gelu_reference(x, bias)
    return _bias_gelu_fwd(x, bias)

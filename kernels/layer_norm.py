"""Fused LayerNorm over the last dimension, optionally fused with the residual add before it.

Forward, one program per row of ``h`` (``h = x``, or ``h = x + residual`` rounded to the input
dtype, which is also returned as the new residual stream: BLOOM's pre-LN block pattern):

    mean = sum(h) / N,   rstd = 1 / sqrt(sum((h - mean)^2) / N + eps),   xhat = (h - mean) * rstd
    y    = xhat * weight + bias

``mean`` and ``rstd`` are kept (fp32, one value per row) for the backward, which recomputes
``xhat`` from ``h``:

    wdy  = weight * dy
    dh   = rstd * (wdy - xhat * mean(wdy * xhat) - mean(wdy))  (+ the gradient of the returned h)
    dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy

The backward launches a fixed number of persistent programs; each walks a strided set of rows,
accumulates its dweight/dbias contributions in fp32 registers and writes them to one row of a
partial buffer that torch then sums. All statistics and arithmetic are fp32; x, residual and the
outputs are fp32, bf16 or fp16, weight and bias may be any of those (they are read as fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import (
    check_float_dtype,
    empty,
    kernel_op,
    launch,
    num_programs_for_device,
    tl,
    triton,
    use_triton,
)

# One row lives in registers; 64K fp32 values is where that stops being reasonable.
_MAX_FUSED_SIZE = 65536


@triton.jit
def _layer_norm_fwd_kernel(
    X, RESIDUAL, H_OUT, Y, W, B, MEAN, RSTD, N, eps,
    stride_x, stride_res, stride_h, stride_y,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(RESIDUAL + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the storage dtype first: the statistics then describe exactly the
        # residual stream that is returned, as in the unfused `h = x + residual; LN(h)`.
        h = (h.to(tl.float32) + res.to(tl.float32)).to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + row * stride_h + cols, h, mask=mask)
    h = h.to(tl.float32)
    mean = tl.sum(h, axis=0) / N
    centered = tl.where(mask, h - mean, 0.0)
    var = tl.sum(centered * centered, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    y = centered * rstd * w + b
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, H, W, MEAN, RSTD, DH_OUT, DX, DW_PARTIAL, DB_PARTIAL, M, N,
    stride_dy, stride_h, stride_dh_out, stride_dx,
    HAS_DH_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row in range(pid, M, tl.num_programs(0)):
        # Ordered so that at most four row-sized fp32 values are live (dw, db, xhat, w * dy):
        # BLOOM-176B's 14336 features then fit the registers of 16 warps.
        row64 = tl.cast(row, tl.int64)
        h = tl.load(H + row64 * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        dw += dy * xhat
        db += dy
        # weight is re-read (from L1/L2) every row rather than held next to dw and db.
        wdy = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DH_OUT:
            dh_out = tl.load(DH_OUT + row64 * stride_dh_out + cols, mask=mask, other=0.0)
            dx += dh_out.to(tl.float32)
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
    tl.store(DB_PARTIAL + pid * N + cols, db, mask=mask)


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """View ``t`` as [rows, n] with unit stride along n (copies only if it has to)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def _block_n(n: int) -> int:
    if n > _MAX_FUSED_SIZE:
        raise ValueError(
            f"layer_norm: the fused kernel keeps a row in registers and supports up to "
            f"{_MAX_FUSED_SIZE} features, got {n}"
        )
    return triton.next_power_of_2(n)


def _num_warps(block_n: int, values_per_thread: int) -> int:
    """Warps for one row of ``block_n`` lanes at about ``values_per_thread`` lanes a thread.

    The backward keeps four row-sized fp32 values live (dw, db, xhat, w * dy), so it asks for
    16 lanes a thread, the forward for 32; ptxas (sm_90) then reports no spills up to 8192
    features, and ~300 bytes at BLOOM-176B's 14336 in the backward (16 warps, the most that
    still leaves 128 registers a thread).
    """
    return min(16, max(4, block_n // (32 * values_per_thread)))


@kernel_op("bloomnative::layer_norm_fwd")
def _layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, h, mean, rstd); h is empty when there is no residual (h is x then)."""
    n = x.shape[-1]
    x2 = _as_rows(x, n)
    m = x2.shape[0]
    y = empty(x2.shape, x.dtype, x.device)
    mean = empty((m,), torch.float32, x.device)
    rstd = empty((m,), torch.float32, x.device)
    if residual is not None:
        res2 = _as_rows(residual, n)
        h = empty(x2.shape, x.dtype, x.device)
    else:
        res2 = x2  # not read
        h = x2.new_empty((0,))
    block_n = _block_n(n)
    launch(
        _layer_norm_fwd_kernel, (m,), x2, res2, h, y, weight, bias, mean, rstd, n, eps,
        x2.stride(0), res2.stride(0), n, y.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n, 32),
    )  # fmt: skip
    h = h.view(x.shape) if residual is not None else h
    return y.view(x.shape), h, mean, rstd


@_layer_norm_fwd.register_fake
def _(x, weight, bias, residual, eps):
    m = x.numel() // x.shape[-1]
    h = x.new_empty(x.shape) if residual is not None else x.new_empty((0,))
    stats = x.new_empty((m,), dtype=torch.float32)
    return x.new_empty(x.shape), h, stats, stats.new_empty((m,))


@kernel_op("bloomnative::layer_norm_bwd")
def _layer_norm_bwd(
    dy: torch.Tensor,
    dh_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dh, dweight, dbias); dh includes ``dh_out``, the gradient of the returned h."""
    n = h.shape[-1]
    h2 = _as_rows(h, n)
    dy2 = _as_rows(dy, n)
    dh_out2 = _as_rows(dh_out, n) if dh_out is not None else dy2
    m = h2.shape[0]
    dx = empty(h2.shape, h.dtype, h.device)
    programs = max(1, min(m, num_programs_for_device(h.device)))
    dw_partial = empty((programs, n), torch.float32, h.device)
    db_partial = empty((programs, n), torch.float32, h.device)
    block_n = _block_n(n)
    launch(
        _layer_norm_bwd_kernel, (programs,), dy2, h2, weight, mean, rstd, dh_out2, dx,
        dw_partial, db_partial, m, n, dy2.stride(0), h2.stride(0), dh_out2.stride(0), n,
        HAS_DH_OUT=dh_out is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n, 16),
    )  # fmt: skip
    return dx.view(h.shape), dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


@_layer_norm_bwd.register_fake
def _(dy, dh_out, h, weight, mean, rstd):
    return h.new_empty(h.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, eps = inputs
    y, h, mean, rstd = output
    ctx.has_residual = residual is not None
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(h if ctx.has_residual else x, weight, mean, rstd)


def _backward(ctx, dy, dh_out, dmean, drstd):
    # Custom-op autograd materializes the gradient of an unused output as zeros, so dy and
    # dh_out are tensors; dh_out is the (empty) placeholder when there is no residual.
    h, weight, mean, rstd = ctx.saved_tensors
    dh_out = dh_out if ctx.has_residual else None
    dh, dweight, dbias = _layer_norm_bwd(dy, dh_out, h, weight, mean, rstd)
    # x and residual enter only through h = x + residual, so both receive dh.
    return dh, dweight, dbias, (dh if ctx.has_residual else None), None


_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch LayerNorm in fp32 (float64 stays float64); same contract as
    :func:`layer_norm`."""
    h = x if residual is None else x + residual
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.layer_norm(h.to(compute), (h.shape[-1],), weight.to(compute), bias.to(compute), eps)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dimension of ``x`` with an affine ``weight`` and ``bias``.

    Without ``residual`` returns ``LN(x)``. With it returns ``(LN(h), h)`` for
    ``h = x + residual`` (same shape and dtype as ``x``), the add fused into the kernel: the
    pre-LN block pattern ``residual = x + residual; x = LN(residual)`` in one pass.

    Runs the fused Triton kernels on CUDA tensors (or under ``TRITON_INTERPRET=1``), otherwise
    :func:`layer_norm_reference`. Differentiable in x, weight, bias and residual.
    """
    n = x.shape[-1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(
            f"layer_norm: weight and bias must have shape [{n}] (the last dim of x), "
            f"got {tuple(weight.shape)} and {tuple(bias.shape)}"
        )
    check_float_dtype("layer_norm: x", x)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"layer_norm: residual must match x in shape and dtype, got {tuple(residual.shape)} "
            f"{residual.dtype} for x {tuple(x.shape)} {x.dtype}"
        )
    if not use_triton(x) or x.numel() == 0:
        return layer_norm_reference(x, weight, bias, eps, residual)
    y, h, _, _ = _layer_norm_fwd(x, weight, bias, residual, eps)
    return y if residual is None else (y, h)

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

Forward: one program per tile of rows (several rows when they are short, so each program has
about 4096 elements in flight). Backward, for rows up to 8192 features: a fixed number of
persistent programs (eight per SM) walk row tiles, write dx and keep their dweight/dbias sums in
fp32 registers, one row of a partial buffer each, which torch then sums. Wider rows (BLOOM-176B's
14336) would spill four row-sized vectors, so they take two kernels: one computes each row's
``mean(wdy * xhat)`` and ``mean(wdy)`` chunk by chunk, the other runs over (2048-column chunks,
row groups) and keeps only chunk-wide sums. All statistics and arithmetic are fp32; x, residual
and the outputs are fp32, bf16 or fp16, weight and bias may be any of those (read as fp32).
"""

from __future__ import annotations

from typing import overload

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
# Rows wider than this take the two-kernel backward (module docstring): the one-pass backward
# keeps four row-sized fp32 vectors per program, which BLOOM-176B's 14336 features would spill.
_MAX_ONE_PASS_BWD = 8192
_TILE_ELEMENTS = 4096  # elements of a [rows, BLOCK_N] tile a program handles at once
_WIDE_CHUNK = 2048  # columns a program of the wide backward owns


# fmt: off
@triton.jit
def _layer_norm_fwd_kernel(
    X, RESIDUAL, H_OUT, Y, W, B, MEAN, RSTD, M, N, eps,
    stride_x, stride_res, stride_h, stride_y,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    eps = tl.cast(eps, tl.float32)  # Inductor passes a Python float as fp64
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(RESIDUAL + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the storage dtype first: the statistics then describe exactly the
        # residual stream that is returned, as in the unfused `h = x + residual; LN(h)`.
        h = (h.to(tl.float32) + res.to(tl.float32)).to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
    h = h.to(tl.float32)
    mean = tl.sum(h, axis=1) / N
    centered = tl.where(mask, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rows < M)
    tl.store(RSTD + rows, rstd, mask=rows < M)


@triton.jit
def _bwd_row_tile(H, DY, MEAN, RSTD, rows, rows64, row_ok, cols, mask, stride_h, stride_dy):
    """The backward's inputs for the tile of `rows` x `cols`: h as stored, dy in fp32, and the
    forward's mean and rstd. Returns values only: torch.compile's write analysis attributes a
    helper's results to every pointer passed in, so store addresses are computed by the caller."""
    h = tl.load(H + rows64[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    return h, dy.to(tl.float32), mean, rstd


@triton.jit
def _store_dx(
    DX, DH_OUT, dx, rows64, cols, mask, stride_dx, stride_dh_out, HAS_DH_OUT: tl.constexpr
):
    """Stores dx, plus the gradient reaching the residual sum h directly when there is one."""
    if HAS_DH_OUT:
        dh_out = tl.load(
            DH_OUT + rows64[:, None] * stride_dh_out + cols[None, :], mask=mask, other=0.0
        )
        dx += dh_out.to(tl.float32)
    tl.store(
        DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
    )


@triton.jit
def _layer_norm_bwd_kernel(
    DY, H, W, MEAN, RSTD, DH_OUT, DX, DW_PARTIAL, DB_PARTIAL, M, N,
    stride_dy, stride_h, stride_dh_out, stride_dx,
    HAS_DH_OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One pass: each persistent program walks [BLOCK_R, BLOCK_N] row tiles with a stride of the
    # program count, writes dx and keeps its dw/db column sums in fp32 registers.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row0 in range(pid * BLOCK_R, M, tl.num_programs(0) * BLOCK_R):
        rows = row0 + tl.arange(0, BLOCK_R)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        h, dy, mean, rstd = _bwd_row_tile(
            H, DY, MEAN, RSTD, rows, rows64, row_ok, cols, mask, stride_h, stride_dy
        )
        xhat = tl.where(mask, (h.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        _store_dx(DX, DH_OUT, dx, rows64, cols, mask, stride_dx, stride_dh_out, HAS_DH_OUT)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_ok)
    tl.store(DB_PARTIAL + pid * N + cols, db, mask=col_ok)


@triton.jit
def _layer_norm_bwd_row_sums_kernel(
    DY, H, W, MEAN, RSTD, ROW_SUMS, N, stride_dy, stride_h, CHUNK: tl.constexpr,
):
    # Wide rows, step 1: c1 = mean(xhat * w dy) and c2 = mean(w dy) of one row, chunk by chunk.
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(MEAN + row)
    rstd = tl.load(RSTD + row)
    c1 = tl.zeros([CHUNK], dtype=tl.float32)
    c2 = tl.zeros([CHUNK], dtype=tl.float32)
    for col0 in range(0, N, CHUNK):
        cols = col0 + tl.arange(0, CHUNK)
        col_ok = cols < N
        h = tl.load(H + row * stride_h + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        wdy = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) * dy
        c1 += tl.where(col_ok, (h - mean) * rstd, 0.0) * wdy
        c2 += wdy
    tl.store(ROW_SUMS + 2 * row, tl.sum(c1, axis=0) / N)
    tl.store(ROW_SUMS + 2 * row + 1, tl.sum(c2, axis=0) / N)


@triton.jit
def _layer_norm_bwd_wide_kernel(
    DY, H, W, MEAN, RSTD, ROW_SUMS, DH_OUT, DX, DW_PARTIAL, DB_PARTIAL, M, N,
    stride_dy, stride_h, stride_dh_out, stride_dx,
    HAS_DH_OUT: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
):
    # Wide rows, step 2: grid (column chunks, row groups); a program owns CHUNK columns of every
    # BLOCK_R-row tile of its group, writes their dx and keeps only CHUNK-wide dw/db sums.
    cols = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    group = tl.program_id(1)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([CHUNK], dtype=tl.float32)
    db = tl.zeros([CHUNK], dtype=tl.float32)
    for row0 in range(group * BLOCK_R, M, tl.num_programs(1) * BLOCK_R):
        rows = row0 + tl.arange(0, BLOCK_R)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        h, dy, mean, rstd = _bwd_row_tile(
            H, DY, MEAN, RSTD, rows, rows64, row_ok, cols, mask, stride_h, stride_dy
        )
        c1 = tl.load(ROW_SUMS + 2 * rows, mask=row_ok, other=0.0)
        c2 = tl.load(ROW_SUMS + 2 * rows + 1, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (h.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        dx = (w[None, :] * dy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        _store_dx(DX, DH_OUT, dx, rows64, cols, mask, stride_dx, stride_dh_out, HAS_DH_OUT)
    tl.store(DW_PARTIAL + group * N + cols, dw, mask=col_ok)
    tl.store(DB_PARTIAL + group * N + cols, db, mask=col_ok)
# fmt: on


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


def _tile(block_n: int, values_per_thread: int) -> tuple[int, int]:
    """(rows per tile, warps) for [rows, block_n] tiles of about _TILE_ELEMENTS elements (one row
    when a row alone is bigger) at about ``values_per_thread`` elements a thread: several short
    rows per program keep enough loads in flight; ptxas reports no spills for either kernel."""
    rows = max(1, _TILE_ELEMENTS // block_n)
    warps = min(16, max(4, rows * block_n // (32 * values_per_thread)))
    return rows, warps


# fmt: off
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
    rows, warps = _tile(block_n, 16)
    launch(
        _layer_norm_fwd_kernel, (triton.cdiv(m, rows),), x2, res2, h, y, weight, bias, mean, rstd,
        m, n, eps, x2.stride(0), res2.stride(0), n, y.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_R=rows, BLOCK_N=block_n, num_warps=warps,
    )
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
    has_dh_out = dh_out is not None
    block_n = _block_n(n)
    if block_n <= _MAX_ONE_PASS_BWD:
        rows, warps = _tile(block_n, 16)
        programs = max(1, min(triton.cdiv(m, rows), num_programs_for_device(h.device, per_sm=8)))
        dw_partial = empty((programs, n), torch.float32, h.device)
        db_partial = empty((programs, n), torch.float32, h.device)
        launch(
            _layer_norm_bwd_kernel, (programs,), dy2, h2, weight, mean, rstd, dh_out2, dx,
            dw_partial, db_partial, m, n, dy2.stride(0), h2.stride(0), dh_out2.stride(0), n,
            HAS_DH_OUT=has_dh_out, BLOCK_R=rows, BLOCK_N=block_n, num_warps=warps,
        )
    else:
        row_sums = empty((m, 2), torch.float32, h.device)
        launch(
            _layer_norm_bwd_row_sums_kernel, (m,), dy2, h2, weight, mean, rstd, row_sums, n,
            dy2.stride(0), h2.stride(0), CHUNK=_WIDE_CHUNK, num_warps=8,
        )
        rows = _TILE_ELEMENTS // _WIDE_CHUNK
        chunks = triton.cdiv(n, _WIDE_CHUNK)
        groups = max(1, min(triton.cdiv(m, rows), num_programs_for_device(h.device, 8) // chunks))
        dw_partial = empty((groups, n), torch.float32, h.device)
        db_partial = empty((groups, n), torch.float32, h.device)
        launch(
            _layer_norm_bwd_wide_kernel, (chunks, groups), dy2, h2, weight, mean, rstd, row_sums,
            dh_out2, dx, dw_partial, db_partial, m, n,
            dy2.stride(0), h2.stride(0), dh_out2.stride(0), n,
            HAS_DH_OUT=has_dh_out, BLOCK_R=rows, CHUNK=_WIDE_CHUNK, num_warps=8,
        )
    return dx.view(h.shape), dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)
# fmt: on


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


@overload
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = ...,
    residual: None = ...,
) -> torch.Tensor: ...


@overload
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = ...,
    *,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]: ...


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

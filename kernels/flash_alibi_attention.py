"""FlashAttention-2 style attention with BLOOM's ALiBi bias computed inside the kernel.

For one (batch, head) with slope ``m`` and softmax scale ``c`` (default ``1/sqrt(head_dim)``):

    s[i, j] = c * q_i . k_j + m * (j - i)            (masked to -inf where j > i when causal)
    p[i, :] = softmax(s[i, :]),   out_i = sum_j p[i, j] v_j,   lse_i = logsumexp_j s[i, j]

``m * (j - i)`` equals BLOOM's ``m * j`` up to a per-row constant, which softmax ignores; the
relative form keeps the bias small (it is exactly 0 on the diagonal), so it loses no precision to
large positions. No seq x seq tensor exists anywhere: the bias and the causal mask are computed
per tile from the block offsets.

Forward (one program per query block of one head): stream over key/value blocks with an online
softmax in the base-2 domain (``exp2``, the scale and slopes pre-multiplied by log2(e)), keeping
fp32 running max, running sum and fp32 output accumulator. Key blocks wholly left of the query
block are processed without any masking; only the blocks on the diagonal (causal) or the ragged
last block (non-causal) are masked, and the loop stops at the diagonal. The program stores the
output and ``lse`` (natural log, fp32) for the backward.

Backward, atomic-free as in FlashAttention-2: ``delta_i = sum_d out_id * dout_id`` first; then
one kernel per key block accumulates ``dv = p^T dout`` and ``dk = c * ds^T q`` over the query blocks
at and below the diagonal, and a second per query block accumulates ``dq = c * ds k``, where
``p`` is recomputed from ``lse`` and ``ds = p * (dout v^T - delta)``.

Any head count (per-head slopes), any head_dim up to 256 (non-powers of two such as 80 or 96 are
padded to the next power of two with masked loads), fp32/bf16/fp16 inputs with fp32 statistics;
fp32 inputs use IEEE fp32 dot products. Slopes are constants: they get no gradient.
"""

from __future__ import annotations

import math

import torch

from ._dispatch import (
    autotune,
    check_float_dtype,
    dot_precision,
    empty,
    empty_like,
    kernel_op,
    launch,
    tl,
    triton,
    use_triton,
)

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_MAX_HEAD_DIM = 256


def _configs(*specs: tuple[int, int, int, int]) -> list:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        for bm, bn, warps, stages in specs
    ]


# H100 search spaces, (BLOCK_M, BLOCK_N, num_warps, num_stages): the configs that compile for
# sm_90 without register spills at head_dim 64 and 128 (checked offline with ptxas -v).
_FWD_CONFIGS = _configs(
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
    (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2),
)  # fmt: skip
_DKDV_CONFIGS = _configs(  # BLOCK_M walks queries, BLOCK_N is the key block a program owns
    (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3),
    (64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 3),
)  # fmt: skip
_DQ_CONFIGS = _configs(  # BLOCK_M is the query block a program owns, BLOCK_N walks keys
    (64, 32, 4, 2), (64, 32, 8, 3), (64, 64, 8, 2), (64, 64, 8, 3),
    (128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
)  # fmt: skip
# Small tiles for the interpreter, with BLOCK_M != BLOCK_N so the ragged-diagonal code runs.
_INTERPRETER_FWD = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})
_INTERPRETER_DKDV = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})
_INTERPRETER_DQ = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})
_PREPROCESS_BLOCK_M = 64
_AUTOTUNE_KEY = ["seq_len", "HEAD_DIM", "CAUSAL"]


@triton.jit
def _load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Masked only along the dimensions that can be ragged, so aligned tiles load unmasked.
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _alibi(slope2, offs_q, offs_k, TRANSPOSED: tl.constexpr):
    # log2(e) * slope * (key_pos - query_pos), laid out [q, k] or [k, q].
    if TRANSPOSED:
        bias = slope2 * (offs_k[:, None] - offs_q[None, :]).to(tl.float32)
    else:
        bias = slope2 * (offs_k[None, :] - offs_q[:, None]).to(tl.float32)
    return bias


@triton.jit
def _scores(
    q, kt, slope2, qk_scale, offs_m, offs_n, n_ok,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # log2(e) * (c q.k + ALiBi) of a [query, key] tile; -inf past the sequence end and, when
    # causal, right of the diagonal (only tiles that can hold such keys are MASKED).
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    s += _alibi(slope2, offs_m, offs_n, False)
    if MASKED:
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def _fwd_kv_loop(
    acc, m_i, l_i, q, K_BASE, V_BASE, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, d_ok, slope2, qk_scale, seq_len, lo, hi,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        kt = _load_tile(
            K_BASE + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
            d_ok, n_ok, PAD_D, MASKED,
        )  # fmt: skip
        v = _load_tile(
            V_BASE + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            n_ok, d_ok, MASKED, PAD_D,
        )  # fmt: skip
        s = _scores(q, kt, slope2, qk_scale, offs_m, offs_n, n_ok, MASKED, CAUSAL, PRECISION)
        # Every row sees at least one unmasked key in the first block it processes (key
        # `lo` <= its position), so m_new is finite and exp2(m_i - m_new) never meets -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@autotune(configs=_FWD_CONFIGS, interpreter_config=_INTERPRETER_FWD, key=_AUTOTUNE_KEY)
@triton.jit
def _flash_alibi_fwd_kernel(
    Q, K, V, SLOPES, OUT, LSE, seq_len, num_heads, qk_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM

    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    slope2 = tl.load(SLOPES + h) * 1.4426950408889634
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
    q = _load_tile(q_ptrs + offs_d[None, :] * stride_qd, m_ok, d_ok, True, PAD_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        unmasked_hi = (q_start // BLOCK_N) * BLOCK_N
        hi = tl.minimum(q_start + BLOCK_M, seq_len)
    else:
        unmasked_hi = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    acc, m_i, l_i = _fwd_kv_loop(
        acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
        offs_m, offs_d, d_ok, slope2, qk_scale, seq_len, 0, unmasked_hi,
        BLOCK_N, False, CAUSAL, PAD_D, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _fwd_kv_loop(
        acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
        offs_m, offs_d, d_ok, slope2, qk_scale, seq_len, unmasked_hi, hi,
        BLOCK_N, True, CAUSAL, PAD_D, PRECISION,
    )  # fmt: skip

    out = acc / l_i[:, None]
    o_ptrs = OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os
    o_ptrs += offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + bh.to(tl.int64) * seq_len + offs_m, lse, mask=m_ok)


@triton.jit
def _flash_alibi_bwd_preprocess_kernel(
    OUT, DOUT, DELTA, seq_len, num_heads,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_gb, stride_gh, stride_gs, stride_gd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # delta_i = sum_d out_id * dout_id, the row term of the softmax backward.
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    o_ptrs = OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os
    do_ptrs = DOUT + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gs
    o = _load_tile(o_ptrs + offs_d[None, :] * stride_od, m_ok, d_ok, True, BLOCK_D != HEAD_DIM)
    do = _load_tile(do_ptrs + offs_d[None, :] * stride_gd, m_ok, d_ok, True, BLOCK_D != HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * seq_len + offs_m, delta, mask=m_ok)


@triton.jit
def _dkdv_q_loop(
    dk, dv, k, v, Q_BASE, DO_BASE, LSE_BASE, DELTA_BASE,
    stride_qs, stride_qd, stride_gs, stride_gd,
    offs_n, offs_d, d_ok, slope2, qk_scale, seq_len, lo, hi,
    BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr, PAD_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # Works in the transposed [key, query] layout so dk and dv accumulate row-major.
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < seq_len
        qt = _load_tile(
            Q_BASE + offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qs,
            d_ok, m_ok, PAD_D, True,
        )  # fmt: skip
        do = _load_tile(
            DO_BASE + offs_m[:, None] * stride_gs + offs_d[None, :] * stride_gd,
            m_ok, d_ok, True, PAD_D,
        )  # fmt: skip
        # lse = +inf past the end of the sequence makes p = 0 for those query rows.
        lse2 = tl.load(LSE_BASE + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA_BASE + offs_m, mask=m_ok, other=0.0)
        st = tl.dot(k, qt, input_precision=PRECISION) * qk_scale
        st += _alibi(slope2, offs_m, offs_n, True)
        if CAUSAL_MASK:
            st = tl.where(offs_m[None, :] >= offs_n[:, None], st, float("-inf"))
        pt = tl.exp2(st - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
    return dk, dv


@autotune(configs=_DKDV_CONFIGS, interpreter_config=_INTERPRETER_DKDV, key=_AUTOTUNE_KEY)
@triton.jit
def _flash_alibi_bwd_dkdv_kernel(
    Q, K, V, SLOPES, DOUT, LSE, DELTA, DK, DV, seq_len, num_heads, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM

    k_start = tl.program_id(0) * BLOCK_N
    offs_n = k_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seq_len
    d_ok = offs_d < HEAD_DIM
    slope2 = tl.load(SLOPES + h) * 1.4426950408889634
    k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_ks
    v_ptrs = V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vs
    k = _load_tile(k_ptrs + offs_d[None, :] * stride_kd, n_ok, d_ok, True, PAD_D)
    v = _load_tile(v_ptrs + offs_d[None, :] * stride_vd, n_ok, d_ok, True, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DOUT + b * stride_gb + h * stride_gh
    lse_base = LSE + bh.to(tl.int64) * seq_len
    delta_base = DELTA + bh.to(tl.int64) * seq_len
    if CAUSAL:
        # Query blocks before this key block never see it; those overlapping it need the
        # causal mask; everything after sees the whole key block.
        lo = (k_start // BLOCK_M) * BLOCK_M
        band_hi = tl.minimum(((k_start + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, seq_len)
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base,
            stride_qs, stride_qd, stride_gs, stride_gd,
            offs_n, offs_d, d_ok, slope2, qk_scale, seq_len, lo, band_hi,
            BLOCK_M, True, PAD_D, PRECISION,
        )  # fmt: skip
    else:
        band_hi = 0
    dk, dv = _dkdv_q_loop(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base,
        stride_qs, stride_qd, stride_gs, stride_gd,
        offs_n, offs_d, d_ok, slope2, qk_scale, seq_len, band_hi, seq_len,
        BLOCK_M, False, PAD_D, PRECISION,
    )  # fmt: skip

    mask = n_ok[:, None] & d_ok[None, :]
    dk_ptrs = (
        DK + b * stride_dkb + h * stride_dkh
        + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd
    )  # fmt: skip
    dv_ptrs = (
        DV + b * stride_dvb + h * stride_dvh
        + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd
    )  # fmt: skip
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_kv_loop(
    dq, q, do, lse2, delta, K_BASE, V_BASE, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, d_ok, slope2, qk_scale, seq_len, lo, hi,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        kt = _load_tile(
            K_BASE + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
            d_ok, n_ok, PAD_D, MASKED,
        )  # fmt: skip
        vt = _load_tile(
            V_BASE + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn,
            d_ok, n_ok, PAD_D, MASKED,
        )  # fmt: skip
        s = _scores(q, kt, slope2, qk_scale, offs_m, offs_n, n_ok, MASKED, CAUSAL, PRECISION)
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    return dq


@autotune(configs=_DQ_CONFIGS, interpreter_config=_INTERPRETER_DQ, key=_AUTOTUNE_KEY)
@triton.jit
def _flash_alibi_bwd_dq_kernel(
    Q, K, V, SLOPES, DOUT, LSE, DELTA, DQ, seq_len, num_heads, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM

    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    slope2 = tl.load(SLOPES + h) * 1.4426950408889634
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
    q = _load_tile(q_ptrs + offs_d[None, :] * stride_qd, m_ok, d_ok, True, PAD_D)
    do_ptrs = DOUT + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gs
    do = _load_tile(do_ptrs + offs_d[None, :] * stride_gd, m_ok, d_ok, True, PAD_D)
    row_offset = bh.to(tl.int64) * seq_len
    lse2 = tl.load(LSE + row_offset + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_offset + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        unmasked_hi = (q_start // BLOCK_N) * BLOCK_N
        hi = tl.minimum(q_start + BLOCK_M, seq_len)
    else:
        unmasked_hi = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    dq = _dq_kv_loop(
        dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
        offs_m, offs_d, d_ok, slope2, qk_scale, seq_len, 0, unmasked_hi,
        BLOCK_N, False, CAUSAL, PAD_D, PRECISION,
    )  # fmt: skip
    dq = _dq_kv_loop(
        dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
        offs_m, offs_d, d_ok, slope2, qk_scale, seq_len, unmasked_hi, hi,
        BLOCK_N, True, CAUSAL, PAD_D, PRECISION,
    )  # fmt: skip
    dq_ptrs = (
        DQ + b * stride_dqb + h * stride_dqh
        + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
    )  # fmt: skip
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16


@kernel_op("bloomnative::flash_alibi_attention_fwd")
def _flash_alibi_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse): out like q, lse fp32 [batch, heads, seq] (natural log)."""
    batch, heads, seq, head_dim = q.shape
    out = empty_like(q)
    lse = empty((batch, heads, seq), torch.float32, q.device)

    def grid(meta):
        return (triton.cdiv(seq, meta["BLOCK_M"]), batch * heads)

    launch(
        _flash_alibi_fwd_kernel, grid, q, k, v, slopes, out, lse, seq, heads,
        softmax_scale * _LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out, lse


@_flash_alibi_fwd.register_fake
def _(q, k, v, slopes, causal, softmax_scale):
    batch, heads, seq, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seq), dtype=torch.float32)


@kernel_op("bloomnative::flash_alibi_attention_bwd")
def _flash_alibi_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv), each laid out like its input."""
    batch, heads, seq, head_dim = q.shape
    block_d = _block_d(head_dim)
    precision = dot_precision(q.dtype)
    delta = empty((batch, heads, seq), torch.float32, q.device)
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    launch(
        _flash_alibi_bwd_preprocess_kernel,
        (triton.cdiv(seq, _PREPROCESS_BLOCK_M), batch * heads),
        out, grad_out, delta, seq, heads, *out.stride(), *grad_out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=_PREPROCESS_BLOCK_M,
    )  # fmt: skip

    def dkdv_grid(meta):
        return (triton.cdiv(seq, meta["BLOCK_N"]), batch * heads)

    launch(
        _flash_alibi_bwd_dkdv_kernel, dkdv_grid, q, k, v, slopes, grad_out, lse, delta, dk, dv,
        seq, heads, softmax_scale * _LOG2E, softmax_scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
        CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d, PRECISION=precision,
    )  # fmt: skip

    def dq_grid(meta):
        return (triton.cdiv(seq, meta["BLOCK_M"]), batch * heads)

    launch(
        _flash_alibi_bwd_dq_kernel, dq_grid, q, k, v, slopes, grad_out, lse, delta, dq,
        seq, heads, softmax_scale * _LOG2E, softmax_scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(),
        CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d, PRECISION=precision,
    )  # fmt: skip
    return dq, dk, dv


@_flash_alibi_bwd.register_fake
def _(grad_out, q, k, v, out, lse, slopes, causal, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, slopes, causal, softmax_scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.save_for_backward(q, k, v, out, lse, slopes)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, slopes = ctx.saved_tensors
    dq, dk, dv = _flash_alibi_bwd(
        grad_out, q, k, v, out, lse, slopes, ctx.causal, ctx.softmax_scale
    )
    return dq, dk, dv, None, None, None


_flash_alibi_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_alibi_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Pure-torch ALiBi attention, same contract as :func:`flash_alibi_attention`.

    Materializes the [batch, heads, seq, seq] scores in fp32 (float64 inputs stay float64): the
    portable CPU path and the test oracle, not something to run at seq 2048 on a GPU.
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    seq, head_dim = q.shape[-2], q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    pos = torch.arange(seq, device=q.device, dtype=compute)
    bias = slopes.to(compute)[:, None, None] * (pos[None, None, :] - pos[None, :, None])
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scale + bias
    if causal:
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v.to(compute)).to(q.dtype)


def flash_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention with BLOOM's ALiBi bias, FlashAttention-2 style (no seq x seq tensor).

    Args:
        q, k, v: ``[batch, heads, seq, head_dim]`` like ``scaled_dot_product_attention``, same
            shape and dtype (fp32, bf16 or fp16), any strides; head_dim up to 256.
        slopes: ``[heads]`` ALiBi slopes (cast to fp32); the score of query i and key j gets
            ``slopes[h] * (j - i)``. Not differentiated.
        causal: mask keys after the query (BLOOM is causal).
        softmax_scale: multiplies ``q . k``; default ``1 / sqrt(head_dim)``.

    Returns:
        ``[batch, heads, seq, head_dim]`` in q's dtype (and, when possible, q's memory layout).

    Runs the Triton kernels on CUDA tensors (or under ``TRITON_INTERPRET=1``), otherwise
    :func:`flash_alibi_attention_reference`. Differentiable in q, k and v.
    """
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "flash_alibi_attention: q, k and v must all be [batch, heads, seq, head_dim] with the "
            f"same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_float_dtype("flash_alibi_attention: q", q)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            "flash_alibi_attention: q, k and v must share a dtype, "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    heads, head_dim = q.shape[1], q.shape[3]
    if slopes.shape != (heads,):
        raise ValueError(
            f"flash_alibi_attention: slopes must have shape [{heads}] (one per head), "
            f"got {tuple(slopes.shape)}"
        )
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(
            f"flash_alibi_attention: head_dim {head_dim} is larger than the supported "
            f"{_MAX_HEAD_DIM}"
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if not use_triton(q) or q.numel() == 0:
        return flash_alibi_attention_reference(q, k, v, slopes, causal, scale)
    slopes = slopes.to(device=q.device, dtype=torch.float32).contiguous()
    out, _ = _flash_alibi_fwd(q, k, v, slopes, causal, float(scale))
    return out

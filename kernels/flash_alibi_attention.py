"""FlashAttention-2/3 style attention with BLOOM's ALiBi bias and dropout inside the kernels.

For one (batch, head) with slope ``m`` and softmax scale ``c`` (default ``1/sqrt(head_dim)``):

    s[i, j] = c * q_i . k_j + m * (j - i)            (masked to -inf where j > i when causal)
    p[i, :] = softmax(s[i, :]),   out_i = sum_j p[i, j] keep[i, j] / P(keep) v_j

``m * (j - i)`` equals BLOOM's ``m * j`` up to a per-row constant, which softmax ignores. The
kernels go one step further: a per-row constant cancels, so the bias they add is the column
term ``m * (j - j0)`` with ``j0`` the first row (forward) or key (backward) of the program's
block. That is one vector per key block instead of a subtract, convert, multiply and add per
score, and it stays as small as the relative form where the softmax mass is, so no precision is
lost to large positions. The stored log-sum-exp is of the relative form, in log2 units
(``lse2_i = log2 sum_j 2^(log2(e) s[i, j])``); each program converts it to its own column form
with one multiply-add per row. The score is then one fused multiply-add per element:
``log2(e) c (q . k) + column term``.

Forward (one program per query block of one head): stream over key/value blocks with an online
softmax in base 2, fp32 running max, sum and output accumulator. Key blocks wholly left of the
query block run without any mask; only the diagonal blocks (causal) or the ragged last block
(non-causal) are masked, and the loop stops at the diagonal. On sm_90 the tiles come through TMA
tensor descriptors (``tl.make_tensor_descriptor``); elsewhere (pre-Hopper GPUs, the
interpreter with ``_use_tma`` off, strides TMA cannot describe) through pointer loads.

Backward, one pass per key block with five matmuls, as FlashAttention-2/3: the program owning a
key block walks the query blocks at and below the diagonal and computes
``S = K Q^T``, ``dP = V dO^T``, ``dV += P^T dO``, ``dK += dS^T Q`` and ``dQ_partial = dS K``,
with ``P`` recomputed from the stored log-sum-exp and ``dS = P * (dP - delta)``,
``delta_i = out_i . dout_i``. ``dQ_partial`` is added to an fp32 accumulator with atomics (a TMA
reduction on sm_90), then rounded to q's dtype. Where 64 query rows of that pass do not fit in
registers (head_dim 96 and 128 with dropout or segments, ``_TWO_KERNEL_BWD``) it runs without
``dQ`` and a second, query-major kernel recomputes ``S`` and ``dP`` per 64-row query tile and
computes ``dQ = dS K`` (docs/kernels.md, "Every matmul on wgmma").

Head dims that are not a power of two but a sum of two (80 = 64 + 16, 96 = 64 + 32, 48 = 32 + 16)
are split into two tiles and every matmul into two: no tensor-core work is spent on padding.
Other head dims (up to 256) are padded to the next power of two with masked pointer loads.

Dropout (``dropout_p > 0``) zeroes ``p[i, j]`` (after the softmax statistics, which stay exact)
where a Philox draw says so and scales the rest by ``1 / keep probability``; the backward
regenerates the same draws, so no mask is stored. Each draw is 8 bits, 16 of them per Philox
call, as FlashAttention-2 draws them: a quarter of the random numbers of one 32-bit word per
element. The draw for element ``(b, h, i, j)`` (``h`` the head index within the tensors passed
in) is byte ``j % 4`` (bits ``8 (j % 4)`` up) of word ``(j % 16) // 4`` of Philox-4x32-10
(Triton's ``tl.philox``) with key ``(seed mod 2^32, seed >> 32)`` and counter
``(i * 2^12 + j // 16, h, b, 0)``; the element is kept iff that byte is ``>= t``, ``t =
round(256 dropout_p)`` clamped to 1..255 (``dropout_threshold``), so the dropout probability is
``dropout_p`` rounded to 256ths (0.1 drops 26/256 = 0.1016) and a kept element is scaled by
``256 / (256 - t)`` (``dropout_scale``): the expectation is unchanged. A pure function of (seed,
b, h, i, j), whatever the tiling, batch size, head count or sequence length (up to 65,536).
:func:`~bloomnative.kernels.flash_alibi_reference.dropout_keep_mask` computes the same stream in
torch, so the reference path drops exactly the same elements.

fp32/bf16/fp16 inputs with fp32 statistics; fp32 inputs use IEEE fp32 dot products. Slopes are
constants: they get no gradient.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from ._dispatch import (
    INTERPRET,
    autotune,
    check_float_dtype,
    declare_written,
    dot_precision,
    empty,
    empty_like,
    install_tma_allocator,
    kernel_op,
    launch,
    tl,
    triton,
    use_triton,
)
from .flash_alibi_reference import (
    DROPOUT_KEYS_PER_DRAW,
    DROPOUT_MAX_POSITIONS,
    LOG2E,
    alibi_attention_block_backward_reference,
    alibi_attention_block_reference,
    draw_seed,
    dropout_scale,
    dropout_threshold,
    flash_alibi_attention_reference,
)

_MAX_HEAD_DIM = 256


def _configs(*specs: tuple[int, int, int, int]) -> list:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        for bm, bn, warps, stages in specs
    ]


# H100 search spaces, (BLOCK_M, BLOCK_N, num_warps, num_stages), kept short: every config is
# compiled and timed once per (seq bucket, head_dim, causal, dropout) key. All compile for sm_90
# without spills at head_dim 64, 80, 96 and 128, with and without dropout, under Triton 3.6 (the
# oldest supported) and the newest (tests/harness/sm90_compile_check.py).
_FWD_CONFIGS = _configs((128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3))
_FWD_DROPOUT_CONFIGS = _configs((128, 64, 8, 3), (64, 64, 4, 3))  # + Philox state per score
# Backward: BLOCK_M walks queries, BLOCK_N is the key block a program owns; it works in the
# transposed [key, query] layout, so S^T, dP^T, dV and dK have BLOCK_N rows and dQ BLOCK_M.
# Triton emits Hopper's warpgroup MMA (wgmma) only for result tiles of at least 64 rows and
# falls back to mma.sync below that, so every tile is at least 64x64, with 8 warps (two
# warpgroups). The program holds K, V and the fp32 dK, dV of its key block, so only head dims
# up to 80 leave room for 128 keys.
_BWD_CONFIGS_NARROW = _configs((64, 128, 8, 2), (64, 64, 8, 2))  # head_dim <= 80
_BWD_CONFIGS_WIDE = _configs((64, 64, 8, 2))
_BWD_SEGMENTS_CONFIGS_NARROW = _configs((64, 64, 8, 2))  # 64x128 spills at head_dim 80
_BWD_DROPOUT_CONFIGS_NARROW = _configs((64, 64, 8, 3))  # 3 stages: 2 spill at head_dim 80
_BWD_DROPOUT_SEGMENTS_CONFIGS_NARROW = _configs((64, 64, 8, 2))
# With segments (three query loops) or dropout (the Philox draws) at head_dim 96 and 128, a
# 64x64 tile of the one-kernel backward spills 12-144 bytes under Triton 3.6, and narrower query
# tiles put dQ (its BLOCK_M rows) on mma.sync. These variants run two kernels (_TWO_KERNEL_BWD):
# dK/dV without dQ, whose four matmuls all have BLOCK_N rows, so narrow query tiles stay on
# wgmma, then dQ query-major in 64-row tiles (_BWD_DQ_CONFIGS).
_BWD_SEGMENTS_CONFIGS_WIDE = _configs((16, 128, 8, 2), (32, 64, 8, 3))
_BWD_DROPOUT_CONFIGS_WIDE = _configs((32, 64, 8, 2))
_BWD_DQ_CONFIGS = _configs((64, 64, 4, 2), (64, 64, 4, 3))
# Small tiles for the interpreter, with BLOCK_M != BLOCK_N so the ragged-diagonal code runs.
_INTERPRETER_FWD = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})
_INTERPRETER_BWD = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})
_PREPROCESS_BLOCK_M = 64
_AUTOTUNE_KEY = ["SEQ_BUCKET", "HEAD_DIM", "CAUSAL", "DROPOUT"]


# fmt: off
@triton.jit
def _load_tile(
    src, row0, col0, n_rows, stride_row, stride_col, head_dim,
    ROWS: tl.constexpr, COLS: tl.constexpr, USE_TMA: tl.constexpr,
    CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr,
):
    # The [ROWS, COLS] tile at (row0, col0) of an [n_rows, head_dim] matrix, zero past its end:
    # a TMA load from a tensor descriptor (which zero-fills by itself), or masked pointer loads
    # along the dimensions that can be ragged.
    if USE_TMA:
        tile = src.load([row0, col0])
    else:
        rows = row0 + tl.arange(0, ROWS)
        cols = col0 + tl.arange(0, COLS)
        ptrs = src + rows[:, None] * stride_row + cols[None, :] * stride_col
        if CHECK_ROWS and CHECK_COLS:
            tile = tl.load(
                ptrs, mask=(rows < n_rows)[:, None] & (cols < head_dim)[None, :], other=0.0
            )
        elif CHECK_ROWS:
            tile = tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
        elif CHECK_COLS:
            tile = tl.load(ptrs, mask=(cols < head_dim)[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _store_tile(
    dst, value, row0, col0, n_rows, stride_row, stride_col, head_dim,
    ROWS: tl.constexpr, COLS: tl.constexpr, USE_TMA: tl.constexpr, CHECK_COLS: tl.constexpr,
):
    if USE_TMA:
        dst.store([row0, col0], value)  # rows past the end are clipped by the TMA unit
    else:
        rows = row0 + tl.arange(0, ROWS)
        cols = col0 + tl.arange(0, COLS)
        mask = (rows < n_rows)[:, None]
        if CHECK_COLS:
            mask = mask & (cols < head_dim)[None, :]
        tl.store(dst + rows[:, None] * stride_row + cols[None, :] * stride_col, value, mask=mask)


@triton.jit
def _matrix(
    base, n_rows, stride_row, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # What _load_tile / _store_tile read: a TMA descriptor of the [n_rows, HEAD_DIM] matrix at
    # `base` (unit column stride) with [ROWS, COLS] boxes, or the plain pointer.
    if USE_TMA:
        src = tl.make_tensor_descriptor(
            base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1], block_shape=[ROWS, COLS]
        )
    else:
        src = base
    return src


@triton.jit
def _dropout_keep(seed, b, h, offs_q, k0, threshold, BLOCK_N: tl.constexpr):
    # The documented stream, for queries offs_q and keys k0 .. k0 + BLOCK_N (k0 a multiple of
    # 16): one Philox call per 16 consecutive keys, counter (i * 2^12 + j // 16, h, b, 0); key j
    # draws byte j % 4 of word (j % 16) // 4 and is kept iff it is >= threshold. Laid out
    # [query, key].
    rows: tl.constexpr = offs_q.shape[0]
    groups = k0 // 16 + tl.arange(0, BLOCK_N // 16)
    c0 = offs_q[:, None] * 4096 + groups[None, :]
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, zero + h.to(tl.int32), zero + b.to(tl.int32), zero)
    # join(join(w0, w2), join(w1, w3))[..., x, y] is word 2x + y: row-major that is 4g + w.
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [rows, BLOCK_N // 4])
    draws = (words[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
    return tl.reshape(draws, [rows, BLOCK_N]).to(tl.int32) >= threshold


@triton.jit
def _visible(offs_n, seq_len, last_key, first_key, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr):
    # [query, key]: which keys of this block each query row sees (in range; causal: up to its
    # last key; with segments: from its segment's first key on).
    keep = (offs_n < seq_len)[None, :]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= last_key[:, None])
    if SEGMENTS:
        keep = keep & (offs_n[None, :] >= first_key[:, None])
    return keep


@triton.jit
def _fwd_kv_loop(
    acc, acc_t, m_i, l_i, q, q_t, k_src, k_src_t, v_src, v_src_t,
    stride_ks, stride_kd, stride_vs, stride_vd, last_key, first_key, col0, slope2, qk_scale,
    seq_len, seed, drop_threshold, drop_rows, k_offset, b, h, lo, hi,
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
):
    # last_key: per query row, the last key it may see (causal); first_key: the first (where
    # its segment starts, with SEGMENTS); col0: the key index where the column term is 0 (the
    # block's first row, shifted by the query-key offset).
    PAD_D: tl.constexpr = D0 > HEAD_DIM
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(
            k_src, start_n, 0, seq_len, stride_ks, stride_kd, HEAD_DIM,
            BLOCK_N, D0, USE_TMA, MASKED, PAD_D,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if D1 > 0:
            k_t = _load_tile(
                k_src_t, start_n, D0, seq_len, stride_ks, stride_kd, HEAD_DIM,
                BLOCK_N, D1, USE_TMA, MASKED, False,
            )
            s = tl.dot(q_t, tl.trans(k_t), s, input_precision=PRECISION)
        # log2(e) * (c q.k + m (j - col0)): the scale and the ALiBi column term in one FMA.
        column = slope2 * (offs_n - col0).to(tl.float32)
        s = s * qk_scale + column[None, :]
        if MASKED:
            keep = _visible(offs_n, seq_len, last_key, first_key, CAUSAL, SEGMENTS)
            s = tl.where(keep, s, float("-inf"))
        # Without segments every row sees at least one unmasked key in the first block it
        # processes (key 0, as causal calls have shift >= 0), so m_new is finite and
        # exp2(m_i - m_new) never meets -inf - -inf. With segments a row whose segment starts
        # past this block sees none of its keys: its exponents use 0 until it meets its first.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_exp = m_new
        if SEGMENTS and MASKED:
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_exp[:, None])
        alpha = tl.exp2(m_i - m_exp)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DROPOUT:  # the statistics stay those of the full softmax; only the sum over v drops
            keep = _dropout_keep(seed, b, h, drop_rows, start_n + k_offset, drop_threshold, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        v = _load_tile(
            v_src, start_n, 0, seq_len, stride_vs, stride_vd, HEAD_DIM,
            BLOCK_N, D0, USE_TMA, MASKED, PAD_D,
        )
        p = p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        if D1 > 0:
            v_t = _load_tile(
                v_src_t, start_n, D0, seq_len, stride_vs, stride_vd, HEAD_DIM,
                BLOCK_N, D1, USE_TMA, MASKED, False,
            )
            acc_t = tl.dot(p, v_t, acc_t * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, acc_t, m_i, l_i


@triton.jit
def _flash_alibi_fwd_kernel(
    Q, K, V, SLOPES, OUT, LSE, SEED, QSTART, seq_len, num_heads, qk_scale, drop_threshold,
    drop_scale, q_offset, k_offset,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    SEQ_BUCKET, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (a direct launch as fp32): without these casts
    # every score and the accumulator would be promoted to fp64 under torch.compile.
    qk_scale = tl.cast(qk_scale, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    PAD_D: tl.constexpr = D0 > HEAD_DIM
    DT: tl.constexpr = D1 if D1 > 0 else 16  # tail tiles exist only when D1 > 0

    q0 = pid_m * BLOCK_M
    offs_m = q0 + tl.arange(0, BLOCK_M)
    slope2 = tl.load(SLOPES + h) * 1.4426950408889634
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    o_base = OUT + b * stride_ob + h * stride_oh
    q_src = _matrix(q_base, seq_len, stride_qs, HEAD_DIM, BLOCK_M, D0, USE_TMA)
    k_src = _matrix(k_base, seq_len, stride_ks, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    v_src = _matrix(v_base, seq_len, stride_vs, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    q_src_t = _matrix(q_base, seq_len, stride_qs, HEAD_DIM, BLOCK_M, DT, USE_TMA and D1 > 0)
    k_src_t = _matrix(k_base, seq_len, stride_ks, HEAD_DIM, BLOCK_N, DT, USE_TMA and D1 > 0)
    v_src_t = _matrix(v_base, seq_len, stride_vs, HEAD_DIM, BLOCK_N, DT, USE_TMA and D1 > 0)
    q = _load_tile(
        q_src, q0, 0, seq_len, stride_qs, stride_qd, HEAD_DIM, BLOCK_M, D0, USE_TMA, True, PAD_D
    )
    q_t = q  # unused unless D1 > 0
    if D1 > 0:
        q_t = _load_tile(
            q_src_t, q0, D0, seq_len, stride_qs, stride_qd, HEAD_DIM,
            BLOCK_M, DT, USE_TMA, True, False,
        )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_M, DT], dtype=tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    # Query i (local) sees key j (local) iff j <= i + shift: the global positions are
    # q_offset + i and k_offset + j. The ALiBi term depends on the same difference only.
    shift = q_offset - k_offset
    last_key = offs_m + shift
    col0 = q0 + shift
    drop_rows = offs_m + q_offset
    full_blocks_end = (seq_len // BLOCK_N) * BLOCK_N
    if CAUSAL:  # keys before the block's first diagonal key need no mask
        unmasked_hi = tl.minimum((col0 // BLOCK_N) * BLOCK_N, full_blocks_end)
        hi = tl.minimum(col0 + BLOCK_M, seq_len)
    else:
        unmasked_hi = full_blocks_end
        hi = seq_len
    # With segments (causal only) a query sees the keys from its segment's start: key blocks
    # before the block's first query's start are never visited, those before its last query's
    # start are masked, the rest up to the diagonal are not. Segment starts never decrease.
    lo = 0
    unmasked_lo = 0
    first_key = last_key  # unused unless SEGMENTS
    if SEGMENTS:
        starts = QSTART + b * seq_len
        first_key = tl.load(starts + offs_m, mask=offs_m < seq_len, other=0) - k_offset
        last_row = tl.minimum(q0 + BLOCK_M, seq_len) - 1
        lo = (tl.maximum(tl.load(starts + q0) - k_offset, 0) // BLOCK_N) * BLOCK_N
        clear = tl.maximum(tl.load(starts + last_row) - k_offset, 0)
        clear = ((clear + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        unmasked_lo = tl.minimum(tl.maximum(clear, lo), unmasked_hi)
        acc, acc_t, m_i, l_i = _fwd_kv_loop(
            acc, acc_t, m_i, l_i, q, q_t, k_src, k_src_t, v_src, v_src_t,
            stride_ks, stride_kd, stride_vs, stride_vd, last_key, first_key, col0, slope2,
            qk_scale, seq_len, seed, drop_threshold, drop_rows, k_offset, b, h, lo, unmasked_lo,
            HEAD_DIM, D0, D1, BLOCK_N, True, CAUSAL, SEGMENTS, DROPOUT, USE_TMA, PRECISION,
        )
    acc, acc_t, m_i, l_i = _fwd_kv_loop(
        acc, acc_t, m_i, l_i, q, q_t, k_src, k_src_t, v_src, v_src_t,
        stride_ks, stride_kd, stride_vs, stride_vd, last_key, first_key, col0, slope2, qk_scale,
        seq_len, seed, drop_threshold, drop_rows, k_offset, b, h, unmasked_lo, unmasked_hi,
        HEAD_DIM, D0, D1, BLOCK_N, False, CAUSAL, SEGMENTS, DROPOUT, USE_TMA, PRECISION,
    )
    acc, acc_t, m_i, l_i = _fwd_kv_loop(
        acc, acc_t, m_i, l_i, q, q_t, k_src, k_src_t, v_src, v_src_t,
        stride_ks, stride_kd, stride_vs, stride_vd, last_key, first_key, col0, slope2, qk_scale,
        seq_len, seed, drop_threshold, drop_rows, k_offset, b, h, tl.maximum(lo, unmasked_hi), hi,
        HEAD_DIM, D0, D1, BLOCK_N, True, CAUSAL, SEGMENTS, DROPOUT, USE_TMA, PRECISION,
    )

    seen = l_i
    if SEGMENTS:  # a query whose segment starts past this block's keys sees none: out 0
        seen = tl.where(l_i > 0.0, l_i, 1.0)
    inv_l = drop_scale / seen
    o_src = _matrix(o_base, seq_len, stride_os, HEAD_DIM, BLOCK_M, D0, USE_TMA)
    _store_tile(
        o_src, (acc * inv_l[:, None]).to(OUT.dtype.element_ty), q0, 0, seq_len,
        stride_os, stride_od, HEAD_DIM, BLOCK_M, D0, USE_TMA, PAD_D,
    )
    if D1 > 0:
        o_src_t = _matrix(o_base, seq_len, stride_os, HEAD_DIM, BLOCK_M, DT, USE_TMA)
        _store_tile(
            o_src_t, (acc_t * inv_l[:, None]).to(OUT.dtype.element_ty), q0, D0, seq_len,
            stride_os, stride_od, HEAD_DIM, BLOCK_M, DT, USE_TMA, False,
        )
    # Back from this block's column form to the relative form: subtract m (i - q0) (log2 units).
    lse2 = m_i + tl.log2(seen) - slope2 * (offs_m - q0).to(tl.float32)  # -inf without keys
    tl.store(LSE + bh.to(tl.int64) * seq_len + offs_m, lse2, mask=offs_m < seq_len)


@triton.jit
def _flash_alibi_bwd_preprocess_kernel(
    OUT, DOUT, DELTA, DQ_ACC, seq_len, num_heads,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_gb, stride_gh, stride_gs, stride_gd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    # delta_i = sum_d out_id * dout_id, the row term of the softmax backward; and (ZERO_DQ)
    # zeros for the dq accumulator the main kernel adds into.
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seq_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o_ptrs = OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os
    do_ptrs = DOUT + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gs
    o = tl.load(o_ptrs + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(do_ptrs + offs_d[None, :] * stride_gd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = bh.to(tl.int64) * seq_len + offs_m
    tl.store(DELTA + row, delta, mask=offs_m < seq_len)
    if ZERO_DQ:
        zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        tl.store(DQ_ACC + row[:, None] * HEAD_DIM + offs_d[None, :], zeros, mask=mask)


@triton.jit
def _add_dq(
    dq_dst, value, row0, col0, seq_len, HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, USE_TMA: tl.constexpr, CHECK_COLS: tl.constexpr,
):
    # dq_acc[rows, cols] += value: a TMA reduction on sm_90, relaxed atomics elsewhere (and
    # under the interpreter, which has no TMA reductions).
    if USE_TMA:
        dq_dst.atomic_add([row0, col0], value)
    else:
        rows = row0 + tl.arange(0, ROWS)
        cols = col0 + tl.arange(0, COLS)
        mask = (rows < seq_len)[:, None]
        if CHECK_COLS:
            mask = mask & (cols < HEAD_DIM)[None, :]
        ptrs = dq_dst + rows[:, None] * HEAD_DIM + cols[None, :]
        tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")


@triton.jit
def _bwd_q_loop(
    dk, dk_t, dv, dv_t, k, k_t, v, v_t, q_src, q_src_t, do_src, do_src_t, dq_dst, dq_dst_t,
    LSE_ROW, DELTA_ROW, QSTART_ROW, stride_qs, stride_qd, stride_gs, stride_gd,
    first_row, key_pos, row0, column, slope2, qk_scale, sm_scale, seq_len,
    seed, drop_threshold, drop_scale, q_offset, drop_k0, b, h, lo, hi,
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SEGMENTS: tl.constexpr,
    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, DQ_TMA: tl.constexpr, PRECISION: tl.constexpr,
    WITH_DQ: tl.constexpr,
):
    # Works in the transposed [key, query] layout so dk and dv accumulate row-major. Query rows
    # past the end load as zeros with lse = +inf, so their p is exactly 0; key rows past the end
    # are zero, so they add nothing to dq (and their dk, dv rows are never stored). first_row:
    # per key, the first query row that sees it (causal); key_pos: the keys' global positions,
    # which a query sees only from its segment's start on (QSTART_ROW, with SEGMENTS); row0: the
    # query row where this key block's column form of the lse needs no correction (n0 shifted by
    # the query-key offset).
    PAD_D: tl.constexpr = D0 > HEAD_DIM
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < seq_len
        q = _load_tile(
            q_src, start_m, 0, seq_len, stride_qs, stride_qd, HEAD_DIM,
            BLOCK_M, D0, USE_TMA, True, PAD_D,
        )
        do = _load_tile(
            do_src, start_m, 0, seq_len, stride_gs, stride_gd, HEAD_DIM,
            BLOCK_M, D0, USE_TMA, True, PAD_D,
        )
        # This key block's column form of the stored lse: lse2_i + m (i - row0).
        lse = tl.load(LSE_ROW + offs_m, mask=m_ok, other=float("inf"))
        lse = lse + slope2 * (offs_m - row0).to(tl.float32)
        delta = tl.load(DELTA_ROW + offs_m, mask=m_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # matmul 1: S^T
        if D1 > 0:
            q_t = _load_tile(
                q_src_t, start_m, D0, seq_len, stride_qs, stride_qd, HEAD_DIM,
                BLOCK_M, DT, USE_TMA, True, False,
            )
            do_t = _load_tile(
                do_src_t, start_m, D0, seq_len, stride_gs, stride_gd, HEAD_DIM,
                BLOCK_M, DT, USE_TMA, True, False,
            )
            st = tl.dot(k_t, tl.trans(q_t), st, input_precision=PRECISION)
        pt = tl.exp2(st * qk_scale + column[:, None] - lse[None, :])
        if MASKED:  # causal diagonal band (exp2 of a masked score may be inf: select, not scale)
            pt = tl.where(offs_m[None, :] >= first_row[:, None], pt, 0.0)
            if SEGMENTS:
                starts = tl.load(QSTART_ROW + offs_m, mask=m_ok, other=0)
                pt = tl.where(starts[None, :] <= key_pos[:, None], pt, 0.0)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # matmul 2: dP^T
        if D1 > 0:
            dpt = tl.dot(v_t, tl.trans(do_t), dpt, input_precision=PRECISION)
        if DROPOUT:
            keep = _dropout_keep(seed, b, h, offs_m + q_offset, drop_k0, drop_threshold, BLOCK_N)
            keep = tl.trans(keep)
            pdt = tl.where(keep, pt * drop_scale, 0.0)
            dpt = tl.where(keep, dpt * drop_scale, 0.0)
        else:
            pdt = pt
        pdt = pdt.to(do.dtype)
        dv = tl.dot(pdt, do, dv, input_precision=PRECISION)  # matmul 3: dV += P^T dO
        if D1 > 0:
            dv_t = tl.dot(pdt, do_t, dv_t, input_precision=PRECISION)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk, input_precision=PRECISION)  # matmul 4: dK += dS^T Q
        if D1 > 0:
            dk_t = tl.dot(dst, q_t, dk_t, input_precision=PRECISION)
        if WITH_DQ:
            ds = tl.trans(dst)
            dq = tl.dot(ds, k, input_precision=PRECISION) * sm_scale  # matmul 5: dQ += dS K
            _add_dq(dq_dst, dq, start_m, 0, seq_len, HEAD_DIM, BLOCK_M, D0, DQ_TMA, PAD_D)
            if D1 > 0:
                dq_t = tl.dot(ds, k_t, input_precision=PRECISION) * sm_scale
                _add_dq(
                    dq_dst_t, dq_t, start_m, D0, seq_len, HEAD_DIM, BLOCK_M, DT, DQ_TMA, False
                )
    return dk, dk_t, dv, dv_t


@triton.jit
def _flash_alibi_bwd_kernel(
    Q, K, V, SLOPES, DOUT, LSE, DELTA, DQ_ACC, DK, DV, SEED, QSTART, KEND,
    seq_len, num_heads, qk_scale, sm_scale, drop_threshold, drop_scale, q_offset, k_offset,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    SEQ_BUCKET, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    DQ_TMA: tl.constexpr, PRECISION: tl.constexpr, WITH_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # WITH_DQ off: dK and dV only (DQ_ACC unused), for _flash_alibi_bwd_dq_kernel to do dQ.
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 from Inductor: see the forward kernel
    sm_scale = tl.cast(sm_scale, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    PAD_D: tl.constexpr = D0 > HEAD_DIM
    DT: tl.constexpr = D1 if D1 > 0 else 16
    TAIL_TMA: tl.constexpr = USE_TMA and D1 > 0

    if DQ_TMA and WITH_DQ:  # dQ is written by TMA reductions only: torch.compile cannot see
        declare_written(DQ_ACC)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slope2 = tl.load(SLOPES + h) * 1.4426950408889634
    column = slope2 * (offs_n - n0).to(tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    k_src = _matrix(k_base, seq_len, stride_ks, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    v_src = _matrix(v_base, seq_len, stride_vs, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    k = _load_tile(
        k_src, n0, 0, seq_len, stride_ks, stride_kd, HEAD_DIM, BLOCK_N, D0, USE_TMA, True, PAD_D
    )
    v = _load_tile(
        v_src, n0, 0, seq_len, stride_vs, stride_vd, HEAD_DIM, BLOCK_N, D0, USE_TMA, True, PAD_D
    )
    k_t = k  # the tails are unused unless D1 > 0
    v_t = v
    if D1 > 0:
        k_src_t = _matrix(k_base, seq_len, stride_ks, HEAD_DIM, BLOCK_N, DT, USE_TMA)
        v_src_t = _matrix(v_base, seq_len, stride_vs, HEAD_DIM, BLOCK_N, DT, USE_TMA)
        k_t = _load_tile(
            k_src_t, n0, D0, seq_len, stride_ks, stride_kd, HEAD_DIM,
            BLOCK_N, DT, USE_TMA, True, False,
        )
        v_t = _load_tile(
            v_src_t, n0, D0, seq_len, stride_vs, stride_vd, HEAD_DIM,
            BLOCK_N, DT, USE_TMA, True, False,
        )
    dk = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    dk_t = tl.zeros([BLOCK_N, DT], dtype=tl.float32)
    dv_t = tl.zeros([BLOCK_N, DT], dtype=tl.float32)

    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DOUT + b * stride_gb + h * stride_gh
    dq_base = DQ_ACC + bh.to(tl.int64) * seq_len * HEAD_DIM
    q_src = _matrix(q_base, seq_len, stride_qs, HEAD_DIM, BLOCK_M, D0, USE_TMA)
    do_src = _matrix(do_base, seq_len, stride_gs, HEAD_DIM, BLOCK_M, D0, USE_TMA)
    dq_dst = _matrix(dq_base, seq_len, HEAD_DIM, HEAD_DIM, BLOCK_M, D0, DQ_TMA)
    q_src_t = _matrix(q_base, seq_len, stride_qs, HEAD_DIM, BLOCK_M, DT, TAIL_TMA)
    do_src_t = _matrix(do_base, seq_len, stride_gs, HEAD_DIM, BLOCK_M, DT, TAIL_TMA)
    dq_dst_t = _matrix(dq_base, seq_len, HEAD_DIM, HEAD_DIM, BLOCK_M, DT, DQ_TMA and D1 > 0)
    lse_row = LSE + bh.to(tl.int64) * seq_len
    delta_row = DELTA + bh.to(tl.int64) * seq_len
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    # Query i (local) sees key j (local) iff i >= j - shift (module docstring: global positions
    # q_offset + i and k_offset + j); the ALiBi term depends on the same difference only.
    shift = q_offset - k_offset
    row0 = n0 - shift
    first_row = offs_n - shift
    drop_k0 = n0 + k_offset
    key_pos = offs_n + k_offset
    qstart_row = QSTART + b * seq_len
    # With segments (causal only) a key is seen by the queries up to its segment's end: query
    # blocks past the last key's end are never visited, those past the first key's end are
    # masked, the rest (after the causal band) are not. Segment ends never decrease.
    rows_hi = seq_len
    clear = seq_len
    if SEGMENTS:
        ends = KEND + b * seq_len
        last_key = tl.minimum(n0 + BLOCK_N, seq_len) - 1
        rows_hi = tl.maximum(tl.load(ends + last_key) - q_offset, 0)
        rows_hi = tl.minimum(((rows_hi + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, seq_len)
        clear = tl.maximum(tl.load(ends + n0) - q_offset, 0)
        clear = tl.minimum((clear // BLOCK_M) * BLOCK_M, rows_hi)
    if CAUSAL:
        # Query blocks before this key block's first row never see it; those overlapping its
        # diagonal band need the causal mask; everything after sees the whole key block.
        lo = (tl.maximum(row0, 0) // BLOCK_M) * BLOCK_M
        band_end = tl.maximum(row0 + BLOCK_N, 0)
        band_hi = tl.minimum(((band_end + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, seq_len)
        band_hi = tl.maximum(tl.minimum(band_hi, rows_hi), lo)
        dk, dk_t, dv, dv_t = _bwd_q_loop(
            dk, dk_t, dv, dv_t, k, k_t, v, v_t, q_src, q_src_t, do_src, do_src_t,
            dq_dst, dq_dst_t, lse_row, delta_row, qstart_row, stride_qs, stride_qd, stride_gs,
            stride_gd, first_row, key_pos, row0, column, slope2, qk_scale, sm_scale, seq_len,
            seed, drop_threshold, drop_scale, q_offset, drop_k0, b, h, lo, band_hi,
            HEAD_DIM, D0, D1, DT, BLOCK_M, BLOCK_N, True, SEGMENTS, DROPOUT, USE_TMA, DQ_TMA,
            PRECISION, WITH_DQ,
        )
    else:
        band_hi = 0
    unmasked_hi = tl.maximum(band_hi, clear)
    dk, dk_t, dv, dv_t = _bwd_q_loop(
        dk, dk_t, dv, dv_t, k, k_t, v, v_t, q_src, q_src_t, do_src, do_src_t,
        dq_dst, dq_dst_t, lse_row, delta_row, qstart_row, stride_qs, stride_qd, stride_gs,
        stride_gd, first_row, key_pos, row0, column, slope2, qk_scale, sm_scale, seq_len,
        seed, drop_threshold, drop_scale, q_offset, drop_k0, b, h, band_hi, unmasked_hi,
        HEAD_DIM, D0, D1, DT, BLOCK_M, BLOCK_N, False, SEGMENTS, DROPOUT, USE_TMA, DQ_TMA,
        PRECISION, WITH_DQ,
    )
    if SEGMENTS:
        dk, dk_t, dv, dv_t = _bwd_q_loop(
            dk, dk_t, dv, dv_t, k, k_t, v, v_t, q_src, q_src_t, do_src, do_src_t,
            dq_dst, dq_dst_t, lse_row, delta_row, qstart_row, stride_qs, stride_qd, stride_gs,
            stride_gd, first_row, key_pos, row0, column, slope2, qk_scale, sm_scale, seq_len,
            seed, drop_threshold, drop_scale, q_offset, drop_k0, b, h, unmasked_hi, rows_hi,
            HEAD_DIM, D0, D1, DT, BLOCK_M, BLOCK_N, True, SEGMENTS, DROPOUT, USE_TMA, DQ_TMA,
            PRECISION, WITH_DQ,
        )

    dk_base = DK + b * stride_dkb + h * stride_dkh
    dv_base = DV + b * stride_dvb + h * stride_dvh
    dk_dst = _matrix(dk_base, seq_len, stride_dks, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    dv_dst = _matrix(dv_base, seq_len, stride_dvs, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    _store_tile(
        dk_dst, (dk * sm_scale).to(DK.dtype.element_ty), n0, 0, seq_len, stride_dks, stride_dkd,
        HEAD_DIM, BLOCK_N, D0, USE_TMA, PAD_D,
    )
    _store_tile(
        dv_dst, dv.to(DV.dtype.element_ty), n0, 0, seq_len, stride_dvs, stride_dvd,
        HEAD_DIM, BLOCK_N, D0, USE_TMA, PAD_D,
    )
    if D1 > 0:
        dk_dst_t = _matrix(dk_base, seq_len, stride_dks, HEAD_DIM, BLOCK_N, DT, USE_TMA)
        dv_dst_t = _matrix(dv_base, seq_len, stride_dvs, HEAD_DIM, BLOCK_N, DT, USE_TMA)
        _store_tile(
            dk_dst_t, (dk_t * sm_scale).to(DK.dtype.element_ty), n0, D0, seq_len,
            stride_dks, stride_dkd, HEAD_DIM, BLOCK_N, DT, USE_TMA, False,
        )
        _store_tile(
            dv_dst_t, dv_t.to(DV.dtype.element_ty), n0, D0, seq_len,
            stride_dvs, stride_dvd, HEAD_DIM, BLOCK_N, DT, USE_TMA, False,
        )


@triton.jit
def _bwd_dq_kv_loop(
    dq, dq_t, q, q_t, do, do_t, k_src, k_src_t, v_src, v_src_t, stride_ks, stride_kd,
    stride_vs, stride_vd, offs_m, lse, delta, last_key, first_key, col0, slope2, qk_scale,
    seq_len, seed, drop_threshold, drop_scale, drop_rows, k_offset, b, h, lo, hi,
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, DT: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr,
    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
):
    # The dQ half of the two-kernel backward, query-major like the forward: P and dS of this
    # query tile are recomputed block by block of keys (lse: the rows' stored lse in this tile's
    # column form, as _fwd_kv_loop's col0), and dQ accumulates in registers.
    PAD_D: tl.constexpr = D0 > HEAD_DIM
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(
            k_src, start_n, 0, seq_len, stride_ks, stride_kd, HEAD_DIM,
            BLOCK_N, D0, USE_TMA, True, PAD_D,
        )
        v = _load_tile(
            v_src, start_n, 0, seq_len, stride_vs, stride_vd, HEAD_DIM,
            BLOCK_N, D0, USE_TMA, True, PAD_D,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # matmul 1: S
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # matmul 2: dP
        k_t = k
        if D1 > 0:
            k_t = _load_tile(
                k_src_t, start_n, D0, seq_len, stride_ks, stride_kd, HEAD_DIM,
                BLOCK_N, DT, USE_TMA, True, False,
            )
            v_t = _load_tile(
                v_src_t, start_n, D0, seq_len, stride_vs, stride_vd, HEAD_DIM,
                BLOCK_N, DT, USE_TMA, True, False,
            )
            s = tl.dot(q_t, tl.trans(k_t), s, input_precision=PRECISION)
            dp = tl.dot(do_t, tl.trans(v_t), dp, input_precision=PRECISION)
        column = slope2 * (offs_n - col0).to(tl.float32)
        p = tl.exp2(s * qk_scale + column[None, :] - lse[:, None])
        # Every block is masked (keys past the end: their exp2 may be inf, so select, not scale).
        p = tl.where(_visible(offs_n, seq_len, last_key, first_key, CAUSAL, SEGMENTS), p, 0.0)
        if DROPOUT:
            keep = _dropout_keep(seed, b, h, drop_rows, start_n + k_offset, drop_threshold, BLOCK_N)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)  # matmul 3: dQ += dS K
        if D1 > 0:
            dq_t = tl.dot(ds, k_t, dq_t, input_precision=PRECISION)
    return dq, dq_t


@triton.jit
def _flash_alibi_bwd_dq_kernel(
    Q, K, V, SLOPES, DOUT, LSE, DELTA, DQ, SEED, QSTART,
    seq_len, num_heads, qk_scale, sm_scale, drop_threshold, drop_scale, q_offset, k_offset,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gs, stride_gd,
    SEQ_BUCKET, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dQ of one query tile (DQ contiguous [batch, heads, seq, head_dim]); dK and dV come from
    # _flash_alibi_bwd_kernel with WITH_DQ off. Masks follow the forward kernel.
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 from Inductor: see the forward kernel
    sm_scale = tl.cast(sm_scale, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    PAD_D: tl.constexpr = D0 > HEAD_DIM
    DT: tl.constexpr = D1 if D1 > 0 else 16
    TAIL_TMA: tl.constexpr = USE_TMA and D1 > 0
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seq_len
    slope2 = tl.load(SLOPES + h) * 1.4426950408889634
    shift = q_offset - k_offset
    # Key j's ALiBi term relative to this tile: slope2 (j - i - shift) = column_j - row_i with
    # col0 = start_m + shift, so the row part joins the lse.
    col0 = start_m + shift
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + offs_m, mask=m_ok, other=float("inf"))
    lse = lse + slope2 * (offs_m - start_m).to(tl.float32)
    delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + offs_m, mask=m_ok, other=0.0)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DOUT + b * stride_gb + h * stride_gh
    q_src = _matrix(q_base, seq_len, stride_qs, HEAD_DIM, BLOCK_M, D0, USE_TMA)
    do_src = _matrix(do_base, seq_len, stride_gs, HEAD_DIM, BLOCK_M, D0, USE_TMA)
    q = _load_tile(
        q_src, start_m, 0, seq_len, stride_qs, stride_qd, HEAD_DIM, BLOCK_M, D0, USE_TMA, True,
        PAD_D,
    )
    do = _load_tile(
        do_src, start_m, 0, seq_len, stride_gs, stride_gd, HEAD_DIM, BLOCK_M, D0, USE_TMA, True,
        PAD_D,
    )
    q_t = q  # the tails are unused unless D1 > 0
    do_t = do
    if D1 > 0:
        q_src_t = _matrix(q_base, seq_len, stride_qs, HEAD_DIM, BLOCK_M, DT, TAIL_TMA)
        do_src_t = _matrix(do_base, seq_len, stride_gs, HEAD_DIM, BLOCK_M, DT, TAIL_TMA)
        q_t = _load_tile(
            q_src_t, start_m, D0, seq_len, stride_qs, stride_qd, HEAD_DIM,
            BLOCK_M, DT, TAIL_TMA, True, False,
        )
        do_t = _load_tile(
            do_src_t, start_m, D0, seq_len, stride_gs, stride_gd, HEAD_DIM,
            BLOCK_M, DT, TAIL_TMA, True, False,
        )
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    k_src = _matrix(k_base, seq_len, stride_ks, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    v_src = _matrix(v_base, seq_len, stride_vs, HEAD_DIM, BLOCK_N, D0, USE_TMA)
    k_src_t = _matrix(k_base, seq_len, stride_ks, HEAD_DIM, BLOCK_N, DT, TAIL_TMA)
    v_src_t = _matrix(v_base, seq_len, stride_vs, HEAD_DIM, BLOCK_N, DT, TAIL_TMA)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    # Query i (local) sees key j (local) iff j <= i + shift, and with segments iff k_offset + j
    # is at or after its segment's start (starts never decrease along the queries).
    last_key = offs_m + shift
    first_key = offs_m * 0
    lo = 0
    if SEGMENTS:
        first_key = tl.load(QSTART + b * seq_len + offs_m, mask=m_ok, other=0) - k_offset
        lo = (tl.maximum(tl.load(QSTART + b * seq_len + start_m) - k_offset, 0) // BLOCK_N)
        lo = lo * BLOCK_N
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), seq_len)
    dq = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    dq_t = tl.zeros([BLOCK_M, DT], dtype=tl.float32)
    dq, dq_t = _bwd_dq_kv_loop(
        dq, dq_t, q, q_t, do, do_t, k_src, k_src_t, v_src, v_src_t, stride_ks, stride_kd,
        stride_vs, stride_vd, offs_m, lse, delta, last_key, first_key, col0, slope2, qk_scale,
        seq_len, seed, drop_threshold, drop_scale, offs_m + q_offset, k_offset, b, h, lo, hi,
        HEAD_DIM, D0, D1, DT, BLOCK_N, CAUSAL, SEGMENTS, DROPOUT, USE_TMA,
        PRECISION,
    )
    dq_base = DQ + bh.to(tl.int64) * seq_len * HEAD_DIM
    dq_dst = _matrix(dq_base, seq_len, HEAD_DIM, HEAD_DIM, BLOCK_M, D0, USE_TMA)
    _store_tile(
        dq_dst, (dq * sm_scale).to(DQ.dtype.element_ty), start_m, 0, seq_len, HEAD_DIM, 1,
        HEAD_DIM, BLOCK_M, D0, USE_TMA, PAD_D,
    )
    if D1 > 0:
        dq_dst_t = _matrix(dq_base, seq_len, HEAD_DIM, HEAD_DIM, BLOCK_M, DT, TAIL_TMA)
        _store_tile(
            dq_dst_t, (dq_t * sm_scale).to(DQ.dtype.element_ty), start_m, D0, seq_len,
            HEAD_DIM, 1, HEAD_DIM, BLOCK_M, DT, TAIL_TMA, False,
        )
# fmt: on


def _autotuned(kernel, configs: list, interpreter_config, zeroed: list[str] | None = None):
    return autotune(configs, interpreter_config, _AUTOTUNE_KEY, reset_to_zero=zeroed)(kernel)


# One autotuner per search space (the same kernel): the spaces differ in what fits in registers.
_fwd_kernels = {
    False: _autotuned(_flash_alibi_fwd_kernel, _FWD_CONFIGS, _INTERPRETER_FWD),
    True: _autotuned(_flash_alibi_fwd_kernel, _FWD_DROPOUT_CONFIGS, _INTERPRETER_FWD),
}
_BWD_SEARCH_SPACES = {  # (dropout, head_dim > 80, segments)
    (False, False, False): _BWD_CONFIGS_NARROW,
    (False, True, False): _BWD_CONFIGS_WIDE,
    (False, False, True): _BWD_SEGMENTS_CONFIGS_NARROW,
    (False, True, True): _BWD_SEGMENTS_CONFIGS_WIDE,
    (True, False, False): _BWD_DROPOUT_CONFIGS_NARROW,
    (True, False, True): _BWD_DROPOUT_SEGMENTS_CONFIGS_NARROW,
    (True, True, False): _BWD_DROPOUT_CONFIGS_WIDE,
    (True, True, True): _BWD_DROPOUT_CONFIGS_WIDE,
}
_bwd_kernels = {
    key: _autotuned(_flash_alibi_bwd_kernel, configs, _INTERPRETER_BWD, ["DQ_ACC"])
    for key, configs in _BWD_SEARCH_SPACES.items()
}
# The search-space keys whose backward is two kernels (dK/dV, then dQ): those where no one-kernel
# tile both keeps dQ on wgmma (64 query rows) and fits in registers (see _BWD_DQ_CONFIGS).
_TWO_KERNEL_BWD = {(True, True, False), (True, True, True), (False, True, True)}
_bwd_dq_kernel = _autotuned(_flash_alibi_bwd_dq_kernel, _BWD_DQ_CONFIGS, _INTERPRETER_BWD)


def head_dim_split(head_dim: int) -> tuple[int, int]:
    """How the kernels tile ``head_dim``: ``(d0, d1)`` with d0 a power of two >= 16 and d1 0
    or a power of two >= 16 such that ``d0 + d1 == head_dim`` (80 -> (64, 16), 96 -> (64, 32));
    ``(next power of two, 0)`` with masked padding when no such split exists."""
    pow2 = max(16, triton.next_power_of_2(head_dim))
    if pow2 == head_dim:
        return head_dim, 0
    d0, d1 = pow2 // 2, head_dim - pow2 // 2
    if d0 >= 16 and d1 >= 16 and d1 & (d1 - 1) == 0:
        return d0, d1
    return pow2, 0


def _seq_bucket(seq: int) -> int:
    """Autotuning key for the sequence length: its power-of-two bucket, so a handful of lengths
    share one tuning run instead of re-tuning (and re-timing every config) for each."""
    return triton.next_power_of_2(max(seq, 1))


def _tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether every tensor can be read through a TMA descriptor of its [seq, head_dim] slices:
    unit last stride, 16-byte aligned first element and row/head/batch strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or not _aligned_16(t):
            return False
        if any((stride * size) % 16 for stride in t.stride()[:-1]):
            return False
    return True


def _aligned_16(t: torch.Tensor) -> bool:
    """Whether ``t``'s first element is 16-byte aligned. A tensor torch.compile is tracing has
    no memory (it is fake): it is judged by its offset into its storage, as storages come from
    allocators that align them to at least 16 bytes (torch's caching allocator and Inductor's
    buffers)."""
    if is_fake(t):
        return (t.storage_offset() * t.element_size()) % 16 == 0
    return t.data_ptr() % 16 == 0


def _device_has_tma(device: torch.device) -> bool:
    """TMA descriptors: Hopper (sm_90) and newer GPUs, and the interpreter, which emulates
    them (the TMA reduction with `_dispatch`'s help)."""
    if device.type == "cpu":
        return INTERPRET
    return torch.cuda.get_device_capability(device)[0] >= 9


def _use_tma(head_dim: int, *tensors: torch.Tensor) -> bool:
    """TMA descriptors where the device has them; pointer loads on older GPUs, for padded
    head dims and for layouts TMA cannot describe."""
    return (
        head_dim_split(head_dim)[0] <= head_dim
        and _tma_compatible(*tensors)
        and _device_has_tma(tensors[0].device)
    )


def _placeholder_if_none(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A kernel's optional tensor argument: its constexpr (DROPOUT, SEGMENTS) says whether it
    is read; when it is not, any tensor holds its place."""
    return t if t is not None else placeholder


# fmt: off
@kernel_op("bloomnative::flash_alibi_attention_fwd")
def _flash_alibi_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    dropout_p: float,
    rng_seed: torch.Tensor | None,
    q_offset: int = 0,
    k_offset: int = 0,
    q_segment_start: torch.Tensor | None = None,
    k_segment_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse2): out like q, lse2 fp32 [batch, heads, seq], the log-sum-exp of the
    relative-form scores in log2 units. The segment bounds (int32 [batch, seq], global
    positions; `segment_bounds`) are given together or not at all; the forward reads the
    queries' starts, the backward also the keys' ends."""
    batch, heads, seq, head_dim = q.shape
    d0, d1 = head_dim_split(head_dim)
    out = empty_like(q)
    lse = empty((batch, heads, seq), torch.float32, q.device)
    use_tma = _use_tma(head_dim, q, k, v, out)
    if use_tma and not INTERPRET:
        install_tma_allocator()

    def grid(meta):
        return (triton.cdiv(seq, meta["BLOCK_M"]), batch * heads)

    launch(
        _fwd_kernels[dropout_p > 0], grid, q, k, v, slopes, out, lse,
        _placeholder_if_none(rng_seed, slopes), _placeholder_if_none(q_segment_start, slopes),
        seq, heads, softmax_scale * LOG2E, dropout_threshold(dropout_p),
        dropout_scale(dropout_p), q_offset, k_offset,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), _seq_bucket(seq),
        CAUSAL=causal, SEGMENTS=q_segment_start is not None, HEAD_DIM=head_dim, D0=d0, D1=d1,
        DROPOUT=dropout_p > 0, USE_TMA=use_tma, PRECISION=dot_precision(q.dtype),
    )
    return out, lse


@_flash_alibi_fwd.register_fake
def _(
    q, k, v, slopes, causal, softmax_scale, dropout_p, rng_seed, q_offset=0, k_offset=0,
    q_segment_start=None, k_segment_end=None,
):
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
    dropout_p: float,
    rng_seed: torch.Tensor | None,
    q_offset: int = 0,
    k_offset: int = 0,
    q_segment_start: torch.Tensor | None = None,
    k_segment_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv); dk and dv are laid out like k and v, dq is contiguous."""
    batch, heads, seq, head_dim = q.shape
    d0, d1 = head_dim_split(head_dim)
    space = (dropout_p > 0, head_dim > 80, q_segment_start is not None)
    two_kernels = space in _TWO_KERNEL_BWD
    delta = empty((batch, heads, seq), torch.float32, q.device)
    # Zeroed by the preprocess kernel, not poisoned: the main kernel adds into it. With two
    # kernels the dQ kernel writes dQ itself (in q's dtype) and the accumulator is not needed.
    dq_shape = (batch, heads, seq, head_dim)
    dq_acc = torch.empty(
        dq_shape if not two_kernels else (1,), dtype=torch.float32, device=q.device
    )
    dk, dv = empty_like(k), empty_like(v)
    launch(
        _flash_alibi_bwd_preprocess_kernel,
        (triton.cdiv(seq, _PREPROCESS_BLOCK_M), batch * heads),
        out, grad_out, delta, dq_acc, seq, heads, *out.stride(), *grad_out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=_PREPROCESS_BLOCK_M,
        ZERO_DQ=not two_kernels,
    )
    use_tma = _use_tma(head_dim, q, k, v, grad_out, dk, dv)
    if use_tma and not INTERPRET:
        install_tma_allocator()

    def grid(meta):
        return (triton.cdiv(seq, meta["BLOCK_N"]), batch * heads)

    seed = _placeholder_if_none(rng_seed, slopes)
    q_start = _placeholder_if_none(q_segment_start, slopes)
    launch(
        _bwd_kernels[space], grid,
        q, k, v, slopes, grad_out, lse, delta, dq_acc, dk, dv,
        seed, q_start, _placeholder_if_none(k_segment_end, slopes), seq, heads,
        softmax_scale * LOG2E, softmax_scale, dropout_threshold(dropout_p),
        dropout_scale(dropout_p), q_offset, k_offset,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
        _seq_bucket(seq), CAUSAL=causal, SEGMENTS=q_segment_start is not None,
        HEAD_DIM=head_dim, D0=d0, D1=d1, DROPOUT=dropout_p > 0, USE_TMA=use_tma,
        DQ_TMA=use_tma and not two_kernels, PRECISION=dot_precision(q.dtype),
        WITH_DQ=not two_kernels,
    )
    if not two_kernels:
        return dq_acc.to(q.dtype), dk, dv
    dq = torch.empty(dq_shape, dtype=q.dtype, device=q.device)

    def dq_grid(meta):
        return (triton.cdiv(seq, meta["BLOCK_M"]), batch * heads)

    launch(
        _bwd_dq_kernel, dq_grid,
        q, k, v, slopes, grad_out, lse, delta, dq, seed, q_start, seq, heads,
        softmax_scale * LOG2E, softmax_scale, dropout_threshold(dropout_p),
        dropout_scale(dropout_p), q_offset, k_offset,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(),
        _seq_bucket(seq), CAUSAL=causal, SEGMENTS=q_segment_start is not None,
        HEAD_DIM=head_dim, D0=d0, D1=d1, DROPOUT=dropout_p > 0, USE_TMA=use_tma,
        PRECISION=dot_precision(q.dtype),
    )
    return dq, dk, dv


@_flash_alibi_bwd.register_fake
def _(
    grad_out, q, k, v, out, lse, slopes, causal, softmax_scale, dropout_p, rng_seed,
    q_offset=0, k_offset=0, q_segment_start=None, k_segment_end=None,
):
    return (
        q.new_empty(q.shape),
        torch.empty_like(k),
        torch.empty_like(v),
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, slopes, causal, softmax_scale, dropout_p, rng_seed, q_offset, k_offset, *bounds = (
        inputs
    )
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.dropout_p = dropout_p
    ctx.offsets = (q_offset, k_offset)
    ctx.save_for_backward(q, k, v, out, lse, slopes, rng_seed, *bounds)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, slopes, rng_seed, *bounds = ctx.saved_tensors
    dq, dk, dv = _flash_alibi_bwd(
        grad_out, q, k, v, out, lse, slopes, ctx.causal, ctx.softmax_scale, ctx.dropout_p,
        rng_seed, *ctx.offsets, *bounds,
    )
    return dq, dk, dv, *(None for _ in range(7 + len(bounds)))
# fmt: on


_flash_alibi_fwd.register_autograd(_backward, setup_context=_setup_context)


def segment_bounds(segment_ids: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token's segment starts and ends: ``(start, end)``, int32 ``[batch, seq]``
    positions (``offset`` + index; end exclusive) of the run of equal ids in ``segment_ids``
    ``[batch, seq]`` that holds the token. A segment is a run: ids that repeat after another
    id begin a new segment."""
    batch, seq = segment_ids.shape
    index = torch.arange(seq, device=segment_ids.device).expand(batch, seq)
    new_run = torch.ones_like(segment_ids, dtype=torch.bool)
    new_run[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start = torch.where(new_run, index, 0).cummax(dim=1).values
    run_ends = torch.ones_like(new_run)
    run_ends[:, :-1] = new_run[:, 1:]
    end = torch.where(run_ends, index + 1, seq).flip(1).cummin(dim=1).values.flip(1)
    return (start + offset).to(torch.int32), (end + offset).to(torch.int32)


def _check_inputs(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    dropout_p: float,
    rng_seed: torch.Tensor | None,
    q_offset: int,
    k_offset: int,
) -> None:
    """The argument checks shared by the public ops, each a one-line error naming the value."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"{name}: q, k and v must all be [batch, heads, seq, head_dim] with the "
            f"same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_float_dtype(f"{name}: q", q)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{name}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    heads, seq, head_dim = q.shape[1], q.shape[2], q.shape[3]
    if slopes.shape != (heads,):
        raise ValueError(
            f"{name}: slopes must have shape [{heads}] (one per head), got {tuple(slopes.shape)}"
        )
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(
            f"{name}: head_dim {head_dim} is larger than the supported {_MAX_HEAD_DIM}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name}: dropout_p must be in [0, 1), got {dropout_p}")
    if rng_seed is not None and (
        rng_seed.dim() != 0 or rng_seed.dtype != torch.int64 or rng_seed.device != q.device
    ):
        raise ValueError(
            f"{name}: rng_seed must be a 0-d int64 tensor on q's device "
            f"({q.device}), got shape {tuple(rng_seed.shape)} {rng_seed.dtype} on "
            f"{rng_seed.device}"
        )
    if q_offset < 0 or k_offset < 0:
        raise ValueError(
            f"{name}: q_offset and k_offset are positions, got {q_offset} and {k_offset}"
        )
    if causal and q_offset < k_offset:
        raise ValueError(
            f"{name}: causal with q_offset {q_offset} < k_offset {k_offset} leaves the first "
            "queries without any key; a block of queries wholly before its keys is skipped by "
            "the caller, one that straddles them is split at the first key"
        )
    if dropout_p > 0:
        end = max(q_offset, k_offset) + seq
        if end > DROPOUT_MAX_POSITIONS:
            raise ValueError(
                f"{name}: dropout supports positions up to {DROPOUT_MAX_POSITIONS} (its random "
                f"stream is indexed by i * 2^12 + j // 16), got positions up to {end}"
            )
        if k_offset % DROPOUT_KEYS_PER_DRAW:
            raise ValueError(
                f"{name}: with dropout, k_offset must be a multiple of {DROPOUT_KEYS_PER_DRAW} "
                f"(the kernels draw one Philox call per {DROPOUT_KEYS_PER_DRAW} keys), got "
                f"{k_offset}"
            )


def _check_segment_bounds(
    name: str, q: torch.Tensor, causal: bool, bounds: tuple[torch.Tensor | None, ...]
) -> None:
    """Segment bounds are int32 ``[batch, seq]`` on q's device, all given or none, with causal
    attention (a segment's tokens see its earlier tokens: packed documents)."""
    given = [t for t in bounds if t is not None]
    if not given:
        return
    if len(given) != len(bounds):
        raise ValueError(f"{name}: q_segment_start and k_segment_end go together")
    if not causal:
        raise ValueError(f"{name}: segments are supported with causal attention only")
    for t in given:
        if t.shape != q.shape[:1] + q.shape[2:3] or t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(
                f"{name}: segment bounds must be int32 [batch, seq] = {[q.shape[0], q.shape[2]]} "
                f"on {q.device} (segment_bounds makes them), got {t.dtype} {list(t.shape)} on "
                f"{t.device}"
            )


def flash_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    dropout_p: float = 0.0,
    rng_seed: torch.Tensor | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention with BLOOM's ALiBi bias, FlashAttention style (no seq x seq tensor).

    Args:
        q, k, v: ``[batch, heads, seq, head_dim]`` like ``scaled_dot_product_attention``, same
            shape and dtype (fp32, bf16 or fp16), any strides; head_dim up to 256.
        slopes: ``[heads]`` ALiBi slopes (cast to fp32); the score of query i and key j gets
            ``slopes[h] * (j - i)``, positions counted from the offsets. Not differentiated.
        causal: mask keys after the query (BLOOM is causal).
        softmax_scale: multiplies ``q . k``; default ``1 / sqrt(head_dim)``.
        dropout_p: attention-probability dropout in ``[0, 1)``, applied inside the kernel.
        rng_seed: int64 0-d tensor on q's device, read inside the kernel (no host sync). The
            keep-mask of element (b, h, i, j) is a pure function of (rng_seed, b, h, i, j), h the
            head index within these tensors and i, j positions (module docstring;
            :func:`~bloomnative.kernels.flash_alibi_reference.dropout_keep_mask`). None draws a
            seed from torch's default generator for q's device.
        q_offset, k_offset: the positions of the first query and the first key, so that a
            block of a longer sequence (context parallelism) gets the ALiBi term, the causal
            mask and the dropout draws of its place in the whole: query row i is position
            ``q_offset + i``, key row j position ``k_offset + j``. Causal needs
            ``q_offset >= k_offset``; dropout a ``k_offset`` that is a multiple of 16.
        segments: packed sequences, with causal attention and ``q_offset == k_offset``:
            ``(start, end)``, int32 ``[batch, seq]``, the positions where each token's segment
            starts and ends, as :func:`segment_bounds` makes them from segment ids (a segment
            is a run of equal ids). A token attends only to the earlier tokens of its own
            segment. Key blocks wholly before a query block's segments are never visited, so
            many short segments cost less than one causal sequence. ALiBi is relative, so no
            position resets.

    Returns:
        ``[batch, heads, seq, head_dim]`` in q's dtype (and, when possible, q's memory layout).

    Runs the Triton kernels on CUDA tensors (or under ``TRITON_INTERPRET=1``), otherwise
    :func:`flash_alibi_attention_reference`. Differentiable in q, k and v.
    """
    name = "flash_alibi_attention"
    _check_inputs(name, q, k, v, slopes, causal, dropout_p, rng_seed, q_offset, k_offset)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if dropout_p == 0.0:
        rng_seed = None
    elif rng_seed is None:
        rng_seed = draw_seed(q.device)
    bounds: tuple[torch.Tensor, ...] = ()
    if segments is not None:
        if q_offset != k_offset:
            raise ValueError(
                f"{name}: segments need queries and keys at the same positions, got q_offset "
                f"{q_offset} and k_offset {k_offset} (the block API takes both sides' bounds)"
            )
        bounds = tuple(segments)
        _check_segment_bounds(name, q, causal, bounds)
    # fmt: off
    if not use_triton(q) or q.numel() == 0:
        return flash_alibi_attention_reference(
            q, k, v, slopes, causal, scale, dropout_p=dropout_p, rng_seed=rng_seed,
            q_offset=q_offset, k_offset=k_offset, segments=segments,
        )
    slopes = slopes.to(device=q.device, dtype=torch.float32).contiguous()
    out, _ = _flash_alibi_fwd(
        q, k, v, slopes, causal, float(scale), float(dropout_p), rng_seed, q_offset, k_offset,
        *bounds,
    )
    # fmt: on
    return out


def flash_alibi_attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    q_offset: int,
    k_offset: int,
    dropout_p: float = 0.0,
    rng_seed: torch.Tensor | None = None,
    q_segment_start: torch.Tensor | None = None,
    k_segment_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of a longer attention (ring attention): the queries at ``q_offset`` against
    the keys at ``k_offset`` only, as :func:`flash_alibi_attention` with the same arguments.

    Returns ``(out, lse2)``: ``out`` normalised over this block's keys, and ``lse2`` fp32
    ``[batch, heads, seq]``, the log-sum-exp of the block's relative-form scores in log2 units,
    by which blocks of the same queries merge. Not differentiable: the gradient of the merged
    result comes from :func:`flash_alibi_attention_block_backward` per block. With dropout,
    ``rng_seed`` is required (every block of one attention passes the same seed).

    Packed sequences: ``q_segment_start`` (where each query's segment starts) and
    ``k_segment_end`` (where each key's ends), int32 ``[batch, seq]`` global positions of the
    whole sequence (:func:`segment_bounds`), the keys' travelling with k and v around a ring.
    A query that sees no key of this block gets ``out`` 0 and ``lse2`` -inf (weight 0 when
    blocks merge).
    """
    name = "flash_alibi_attention_block"
    _check_inputs(name, q, k, v, slopes, causal, dropout_p, rng_seed, q_offset, k_offset)
    _check_block_seed(dropout_p, rng_seed)
    bounds = (q_segment_start, k_segment_end)
    _check_segment_bounds(name, q, causal, bounds)
    # fmt: off
    if not use_triton(q) or q.numel() == 0:
        return alibi_attention_block_reference(
            q, k, v, slopes, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset,
            k_offset=k_offset, dropout_p=dropout_p, rng_seed=rng_seed,
            q_segment_start=q_segment_start,
        )
    slopes = slopes.to(device=q.device, dtype=torch.float32).contiguous()
    seed = rng_seed if dropout_p > 0 else None
    return _flash_alibi_fwd(
        q, k, v, slopes, causal, float(softmax_scale), float(dropout_p), seed, q_offset, k_offset,
        *bounds,
    )
    # fmt: on


def flash_alibi_attention_block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse2: torch.Tensor,
    slopes: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    q_offset: int,
    k_offset: int,
    dropout_p: float = 0.0,
    rng_seed: torch.Tensor | None = None,
    q_segment_start: torch.Tensor | None = None,
    k_segment_end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the gradients of a merged attention: ``out`` and ``lse2`` are
    those of the whole (merged over every block of these queries), so the probabilities
    recomputed here are the whole softmax's. Returns ``(dq, dk, dv)`` in the inputs' dtype: dq
    to be summed over the blocks of these queries, dk and dv over the blocks of these keys.
    The segment bounds are those given to the block's forward."""
    _check_block_seed(dropout_p, rng_seed)
    bounds = (q_segment_start, k_segment_end)
    _check_segment_bounds("flash_alibi_attention_block_backward", q, causal, bounds)
    # fmt: off
    if not use_triton(q) or q.numel() == 0:
        return alibi_attention_block_backward_reference(
            grad_out, q, k, v, out, lse2, slopes, causal=causal, softmax_scale=softmax_scale,
            q_offset=q_offset, k_offset=k_offset, dropout_p=dropout_p, rng_seed=rng_seed,
            q_segment_start=q_segment_start,
        )
    slopes = slopes.to(device=q.device, dtype=torch.float32).contiguous()
    seed = rng_seed if dropout_p > 0 else None
    return _flash_alibi_bwd(
        grad_out, q, k, v, out, lse2.contiguous(), slopes, causal, float(softmax_scale),
        float(dropout_p), seed, q_offset, k_offset, *bounds,
    )
    # fmt: on


def _check_block_seed(dropout_p: float, rng_seed: torch.Tensor | None) -> None:
    if dropout_p > 0 and rng_seed is None:
        raise ValueError(
            "flash_alibi_attention_block: dropout needs an explicit rng_seed, the same for every "
            "block of one attention"
        )

"""ALiBi attention through FlexAttention: the compiler-generated peer of the hand-written kernel.

``torch.nn.attention.flex_attention`` with

* a ``score_mod`` adding ``slopes[h] * (kv_idx - q_idx)`` to each scaled score (the same
  relative ALiBi form as :mod:`bloomnative.kernels.flash_alibi_attention`), and
* a causal ``BlockMask`` (built once per (q_len, kv_len, device) and cached), so blocks above the
  diagonal are skipped and only diagonal blocks evaluate the mask; with segments (packed
  sequences) a mask that also keeps each token inside its segment, built for the segments given
  (the last one is kept: every layer of a forward passes the same).

On CUDA the call goes through a ``torch.compile``d wrapper (FlexAttention is only fast compiled;
inside an outer ``torch.compile`` region it is simply inlined). Elsewhere it runs FlexAttention's
eager reference implementation, which has no backward on CPU: this op is for GPUs, and the
portable CPU path is :func:`~bloomnative.kernels.flash_alibi_attention` / SDPA.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_BLOCK_MASKS: dict[tuple[int, int, str], BlockMask] = {}
_SEGMENT_MASK: list[tuple[torch.Tensor, int, BlockMask]] = []  # the last segments' mask
_compiled_flex_alibi: Any = None


def _causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
    return q_idx >= kv_idx


def causal_block_mask(q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """The causal ``BlockMask`` for these lengths on ``device``, built once and cached.

    Call it outside ``torch.compile`` regions to build the mask ahead of time (as
    :func:`flex_alibi_attention` does when called eagerly).
    """
    key = (q_len, kv_len, str(device))
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        mask = create_block_mask(_causal, None, None, q_len, kv_len, device=device)
        _BLOCK_MASKS[key] = mask
    return mask


def segment_block_mask(start: torch.Tensor) -> BlockMask:
    """The ``BlockMask`` of causal attention inside segments: query ``i`` of sample ``b`` sees
    key ``j`` iff ``start[b, i] <= j <= i`` (``start`` int32 ``[batch, seq]``: where each token's
    segment starts, ``kernels.segment_bounds``). The mask of the last ``start`` is cached, for
    the other layers of the same forward: the cache holds that tensor itself (so its memory is
    never another tensor's while cached) and its version counter (so an in-place change misses)."""
    if _SEGMENT_MASK and _SEGMENT_MASK[0][0] is start and _SEGMENT_MASK[0][1] == start._version:
        return _SEGMENT_MASK[0][2]

    def inside_segment(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= start[b, q_idx])

    batch, seq = start.shape
    mask = create_block_mask(inside_segment, batch, None, seq, seq, device=start.device)
    _SEGMENT_MASK[:] = [(start, start._version, mask)]
    return mask


def _flex_alibi(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    block_mask: BlockMask | None,
    scale: float,
) -> torch.Tensor:
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    # Without return_lse/return_aux it returns the output alone (torch 2.11 types a union).
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, scale=scale)
    return cast(torch.Tensor, out)


def flex_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """ALiBi attention with FlexAttention; same contract as
    :func:`~bloomnative.kernels.flash_alibi_attention` (``[batch, heads, seq, head_dim]``,
    fp32 ``slopes[heads]``, score ``q.k * scale + slope * (key_pos - query_pos)``, ``segments``
    the bounds of packed segments, causal only).

    Differentiable on CUDA. On CPU only the forward is available (FlexAttention has no CPU
    backward).
    """
    global _compiled_flex_alibi
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "flex_alibi_attention: q, k and v must all be [batch, heads, seq, head_dim] with the "
            f"same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if slopes.shape != (q.shape[1],):
        raise ValueError(
            f"flex_alibi_attention: slopes must have shape [{q.shape[1]}] (one per head), "
            f"got {tuple(slopes.shape)}"
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    slopes = slopes.to(device=q.device, dtype=torch.float32)
    seq = q.shape[-2]
    block_mask: BlockMask | None
    if segments is not None:
        if not causal:
            raise ValueError("flex_alibi_attention: segments are supported with causal only")
        block_mask = segment_block_mask(segments[0].to(q.device))
    else:
        block_mask = causal_block_mask(seq, seq, q.device) if causal else None
    if q.is_cuda and not torch.compiler.is_compiling():
        if _compiled_flex_alibi is None:
            _compiled_flex_alibi = torch.compile(_flex_alibi, fullgraph=True, dynamic=False)
        return _compiled_flex_alibi(q, k, v, slopes, block_mask, scale)
    return _flex_alibi(q, k, v, slopes, block_mask, scale)

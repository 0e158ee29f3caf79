"""Attention backends: each computes dropout(softmax(q k^T / sqrt(d) + ALiBi, causal)) v.

All take q, k, v as [batch, heads, seq, head_dim], per-head ALiBi slopes [heads], the dropout
probability on the attention probabilities (0 outside training) and, for packed sequences, the
bounds of every token's segment (`Segments`). Dropout masks come from torch's
default generator on q's device, so whoever sets that generator's state (parallel/dropout_rng.py for
tensor-parallel ranks) decides the masks.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from bloomnative.kernels import flash_alibi_attention, flex_alibi_attention
from bloomnative.model.alibi import alibi_causal_bias

AttentionBackend = Literal["sdpa", "flex", "triton"]
ATTENTION_BACKENDS: tuple[str, ...] = typing.get_args(AttentionBackend)
PORTABLE_BACKEND: AttentionBackend = "sdpa"
"""The backend that runs forward and backward on every device: what `model.attention = "auto"`
stands for where nothing is timed, without context parallelism on a GPU
(`attention_for_planning`)."""

Segments = tuple[torch.Tensor, torch.Tensor]
"""Packed sequences: ``(start, end)``, int32 ``[batch, seq]``, the positions where each token's
segment starts and ends (``kernels.segment_bounds``); a token attends only to the earlier
tokens of its segment."""

AttentionFn = Callable[..., torch.Tensor]
"""``attend(q, k, v, slopes, dropout_p=0.0, segments=None)``: q, k, v ``[batch, heads, seq,
head_dim]``, slopes ``[heads]``, ``segments`` optional ``Segments``."""


def sdpa_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    dropout_p: float = 0.0,
    segments: Segments | None = None,
) -> torch.Tensor:
    """Portable path: SDPA with a materialised [heads, q_len, k_len] ALiBi + causal bias (with
    segments [batch, heads, q_len, k_len]: also -inf before each query's segment start). k may
    be longer than q (keys of earlier tokens from a KV cache): q holds the last positions.

    The bias is kept in fp32 when q is fp32; with low-precision inputs SDPA's kernels still
    accumulate the softmax in fp32.
    """
    q_len, k_len = q.shape[-2], k.shape[-2]
    bias = alibi_causal_bias(slopes, q_len, q.dtype, past_len=k_len - q_len)
    if segments is not None:
        keys = torch.arange(k_len, device=q.device)
        before_segment = keys[None, None, :] < segments[0].to(q.device)[:, :, None]
        bias = bias.unsqueeze(0).masked_fill(before_segment.unsqueeze(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)


def _triton_attention(q, k, v, slopes, dropout_p=0.0, segments=None):
    # The kernel regenerates its mask from a seed it draws from the default generator.
    return flash_alibi_attention(
        q, k, v, slopes, causal=True, dropout_p=dropout_p, segments=segments
    )


def _flex_attention(q, k, v, slopes, dropout_p=0.0, segments=None):
    if dropout_p:
        choices = " or ".join(backends_with("dropout"))
        raise ValueError(f"the flex attention backend has no dropout; use {choices}")
    return flex_alibi_attention(q, k, v, slopes, causal=True, segments=segments)


_BACKENDS: dict[str, AttentionFn] = {
    "sdpa": sdpa_alibi_attention,
    "triton": _triton_attention,
    "flex": _flex_attention,
}


@dataclass(frozen=True)
class BackendTraits:
    """What an attention backend supports besides computing attention: every module that has
    to know (model arguments, the layout checks, context parallelism, "auto") asks here."""

    title: str
    """What the backend is, for messages."""
    dropout: bool
    """Dropout on the attention probabilities (model.attention_dropout)."""
    context_parallel: bool
    """A ring form over context-parallel ranks (parallel/context_parallel.py's block functions)."""
    cpu_backward: bool
    """A backward pass on CPU (FlexAttention compiles its backward for GPUs only)."""


TRAITS: dict[str, BackendTraits] = {
    "sdpa": BackendTraits("SDPA", dropout=True, context_parallel=True, cpu_backward=True),
    # On CPU the kernels run in Triton's interpreter or as their torch references.
    "triton": BackendTraits(
        "the Triton flash kernel", dropout=True, context_parallel=True, cpu_backward=True
    ),
    "flex": BackendTraits(
        "FlexAttention", dropout=False, context_parallel=False, cpu_backward=False
    ),
}


def backends_with(trait: str) -> tuple[str, ...]:
    """The backends that support `trait` (a field of BackendTraits), in ATTENTION_BACKENDS order."""
    return tuple(name for name in ATTENTION_BACKENDS if getattr(TRAITS[name], trait))


def attention_for_planning(
    name: AttentionBackend | Literal["auto"], cp: int = 1, device_type: str | None = None
) -> AttentionBackend:
    """The backend `name` stands for where nothing is timed: a backend is itself; "auto" is, with
    context parallelism on a GPU, the Triton kernels' ring (which is never timed: "flex" has no
    ring form, "sdpa"'s materialises each block's scores), else the portable backend (on CPU, on
    a device not known yet, and in checks and plans made before a run times the candidates)."""
    if name != "auto":
        return name
    return "triton" if cp > 1 and device_type == "cuda" else PORTABLE_BACKEND


def attention_backend(name: str) -> AttentionFn:
    """The attention function registered under `name` ("sdpa", "flex" or "triton")."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]

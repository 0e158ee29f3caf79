"""Flash ALiBi attention in plain torch: the kernels' Philox dropout stream and reference ops.

The stream is specified in :mod:`bloomnative.kernels.flash_alibi_attention`'s docstring; the ops
there run these references where Triton does not run, and the tests use them as the oracle.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634
DROPOUT_KEYS_PER_DRAW = 16
"""Keys per Philox call: its four 32-bit words give a byte each to 16 consecutive keys. With
dropout, the first key position of a kernel call (``k_offset``) must be a multiple of this."""
_DROPOUT_ROW_STRIDE = 4096  # counter word 0 is i * 2^12 + j // 16: unique for seq <= 65536
DROPOUT_MAX_POSITIONS = DROPOUT_KEYS_PER_DRAW * _DROPOUT_ROW_STRIDE
"""With dropout, query and key positions (offsets included) must stay below this."""


def dropout_threshold(dropout_p: float) -> int:
    """An element is kept iff its draw, one byte of a Philox word (0 to 255), is at least this:
    ``dropout_p`` in 256ths, rounded, at least 1 and at most 255 for ``dropout_p > 0`` (0.1 gives
    26: elements are dropped with probability 26/256 = 0.1016); 0 without dropout."""
    return min(255, max(1, round(dropout_p * 256))) if dropout_p > 0 else 0


def dropout_scale(dropout_p: float) -> float:
    """What a kept element is multiplied by: 1 / its keep probability, 256 / (256 - threshold)
    (``dropout_threshold``), so that dropout leaves the expectation unchanged."""
    return 256 / (256 - dropout_threshold(dropout_p))


def draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh int64 seed from torch's default generator for ``device``, on the device (no host
    synchronisation, capturable by torch.compile)."""
    return torch.randint(0, 2**62, (), device=device, dtype=torch.int64)


def _philox_uint32_mul(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product of the constant ``a`` and the uint32
    values in ``x`` (int64 tensor), without overflowing int64: x is split into 16-bit halves."""
    x_hi, x_lo = x >> 16, x & 0xFFFF
    p_hi, p_lo = a * x_hi, a * x_lo  # each < 2^48
    mid = p_hi + (p_lo >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def _philox_words(
    seed: torch.Tensor, counter: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox-4x32-10 as Triton's ``tl.philox(seed, *counter)``
    computes them: key (seed mod 2^32, seed >> 32). uint32 values held in int64 tensors."""
    mask = 0xFFFFFFFF
    k0, k1 = seed & mask, (seed >> 32) & mask
    c0, c1, c2, c3 = (c & mask for c in counter)
    for _ in range(10):
        hi_b, lo_b = _philox_uint32_mul(0xCD9E8D57, c2)
        hi_a, lo_a = _philox_uint32_mul(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def dropout_keep_mask(
    rng_seed: torch.Tensor,
    shape: tuple[int, ...],
    dropout_p: float,
    q_offset: int = 0,
    k_offset: int = 0,
) -> torch.Tensor:
    """The ``[batch, heads, q_len, k_len]`` boolean keep-mask that the kernels draw for
    ``rng_seed`` (a pure function of the seed and (b, h, i, j)), for queries at positions
    ``q_offset + i`` and keys at ``k_offset + j``. For references and tests: it materialises
    ``q_len x k_len``, the kernels never do."""
    batch, heads, q_len, k_len = shape
    per_draw = DROPOUT_KEYS_PER_DRAW
    first_group, end_group = k_offset // per_draw, -(-(k_offset + k_len) // per_draw)
    groups = end_group - first_group

    def index(n: int, dim: int, start: int = 0) -> torch.Tensor:
        view = [1, 1, 1, 1]
        view[dim] = n
        return torch.arange(start, start + n, device=rng_seed.device, dtype=torch.int64).view(view)

    full = (batch, heads, q_len, groups)
    rows = index(q_len, 2, q_offset)
    c0 = (rows * _DROPOUT_ROW_STRIDE + index(groups, 3, first_group)).expand(full)
    counter = (c0, index(heads, 1).expand(full), index(batch, 0).expand(full), c0 * 0)
    words = torch.stack(_philox_words(rng_seed.to(torch.int64), counter), dim=-1)
    shifts = torch.arange(0, 32, 8, device=rng_seed.device)
    # Key 16 g + 4 w + r of group g draws byte r (bits 8 r .. 8 r + 7) of word w.
    draws = ((words[..., None] >> shifts) & 0xFF).reshape(batch, heads, q_len, per_draw * groups)
    first = k_offset - per_draw * first_group
    return draws[..., first : first + k_len] >= dropout_threshold(dropout_p)


def _alibi_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    scale: float,
    q_offset: int,
    k_offset: int,
    q_segment_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scale q.k + slope (key position - query position)``, -inf where a causal query may not
    see the key (after it, or before its segment's start), in fp32 (float64 for float64
    inputs): ``[batch, heads, q_len, k_len]``."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_pos = torch.arange(q_offset, q_offset + q.shape[-2], device=q.device)
    k_pos = torch.arange(k_offset, k_offset + k.shape[-2], device=q.device)
    distance = k_pos[None, :] - q_pos[:, None]
    bias = slopes.to(device=q.device, dtype=compute)[:, None, None] * distance.to(compute)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scale + bias
    if causal:
        scores = scores.masked_fill(distance > 0, float("-inf"))
    if q_segment_start is not None:
        before_segment = k_pos[None, None, :] < q_segment_start.to(q.device)[:, :, None]
        scores = scores.masked_fill(before_segment[:, None], float("-inf"))
    return scores


def flash_alibi_attention_reference(
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
    """Pure-torch ALiBi attention, same contract as
    :func:`~bloomnative.kernels.flash_alibi_attention` (dropout and segments included: the same
    elements are dropped for the same seed).

    Materializes the [batch, heads, seq, seq] scores in fp32 (float64 inputs stay float64): the
    portable CPU path and the test oracle, not something to run at seq 2048 on a GPU.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    starts = segments[0] if segments is not None else None
    scores = _alibi_scores(q, k, slopes, causal, scale, q_offset, k_offset, starts)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        seed = rng_seed if rng_seed is not None else draw_seed(q.device)
        keep = dropout_keep_mask(seed, tuple(scores.shape), dropout_p, q_offset, k_offset)
        probs = probs * keep * dropout_scale(dropout_p)
    return (probs @ v.to(scores.dtype)).to(q.dtype)


def alibi_attention_block_reference(
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
    """:func:`~bloomnative.kernels.flash_alibi_attention_block` in torch ops with an explicit
    bias block: the ``[batch, heads, q_len, k_len]`` scores with ALiBi at the blocks' positions,
    in fp32 (float64 for float64 inputs, whose lse2 is then float64 too). A query that sees no
    key of the block gets out 0 and lse2 -inf, as from the kernel; ``k_segment_end`` is accepted
    (and unused) so that both block forms take the same arguments."""
    scores = _alibi_scores(q, k, slopes, causal, softmax_scale, q_offset, k_offset, q_segment_start)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(nan=0.0)  # -inf - -inf: no key
    if dropout_p > 0:
        assert rng_seed is not None, "dropout needs the rng_seed the kernels drew with"
        keep = dropout_keep_mask(rng_seed, tuple(scores.shape), dropout_p, q_offset, k_offset)
        probs = probs * keep * dropout_scale(dropout_p)
    out = (probs @ v.to(scores.dtype)).to(q.dtype)
    return out, lse * LOG2E


def alibi_attention_block_backward_reference(
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
    """:func:`~bloomnative.kernels.flash_alibi_attention_block_backward` in torch ops (the
    softmax backward with the merged statistics: ``dS = P (dP - rowsum(dO * O))``). The mask
    needs the queries' segment starts only; ``k_segment_end`` (which the kernels use to skip
    blocks) is accepted so that both block forms take the same arguments."""
    scores = _alibi_scores(q, k, slopes, causal, softmax_scale, q_offset, k_offset, q_segment_start)
    compute = scores.dtype
    probs = torch.exp(scores - lse2.to(compute)[..., None] / LOG2E)
    dout = grad_out.to(compute)
    dprobs = dout @ v.to(compute).transpose(-1, -2)
    kept = probs
    if dropout_p > 0:
        assert rng_seed is not None, "dropout needs the rng_seed the kernels drew with"
        keep = dropout_keep_mask(rng_seed, tuple(scores.shape), dropout_p, q_offset, k_offset)
        kept = probs * keep * dropout_scale(dropout_p)
        dprobs = dprobs * keep * dropout_scale(dropout_p)
    dv = kept.transpose(-1, -2) @ dout
    delta = (out.to(compute) * dout).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * softmax_scale
    dq = dscores @ k.to(compute)
    dk = dscores.transpose(-1, -2) @ q.to(compute)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

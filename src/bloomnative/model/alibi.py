"""ALiBi: a per-head linear penalty on query-key distance instead of position embeddings."""

from __future__ import annotations

import math

import torch


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Per-head slopes of Press et al. (2022), fp32, shape [n_head].

    For a power of two n the slopes are the geometric sequence 2^(-8i/n), i = 1..n. Otherwise the
    first 2^floor(log2 n) heads take that sequence and the remaining heads take every other
    element of the sequence for twice that power of two (the odd exponents), which interleaves
    them between the existing slopes. BLOOM-176B (112 heads) relies on the second rule.
    """
    if n_head < 1:
        raise ValueError(f"n_head must be positive, got {n_head}")
    base_count = 2 ** math.floor(math.log2(n_head))

    def geometric(n: int, exponents: torch.Tensor) -> torch.Tensor:
        ratio = 2.0 ** (-8.0 / n)
        return torch.pow(torch.tensor(ratio, dtype=torch.float64), exponents)

    slopes = geometric(base_count, torch.arange(1, base_count + 1, dtype=torch.float64))
    extra = n_head - base_count
    if extra:
        odd = torch.arange(1, 2 * extra, 2, dtype=torch.float64)
        slopes = torch.cat([slopes, geometric(2 * base_count, odd)])
    return slopes.to(torch.float32)


def alibi_causal_bias(
    slopes: torch.Tensor, seq_len: int, dtype: torch.dtype, past_len: int = 0
) -> torch.Tensor:
    """Additive attention bias [heads, seq, past_len + seq]: slope * (key - query) on and below
    the diagonal, -inf above it. Under the causal softmax this equals BLOOM's slope * key
    position (each row differs by a constant), but keeps the values small. With `past_len`
    cached keys (incremental decoding) the queries are the last `seq_len` positions."""
    query = torch.arange(past_len, past_len + seq_len, device=slopes.device)
    key = torch.arange(past_len + seq_len, device=slopes.device)
    distance = (key[None, :] - query[:, None]).to(torch.float32)
    bias = slopes.to(torch.float32)[:, None, None] * distance
    bias = bias.masked_fill(distance > 0, float("-inf"))
    return bias.to(dtype)

"""flash_alibi_attention at position offsets (a block of a longer sequence, as context
parallelism calls it) and its block API, through the interpreter against float64 references of
the whole sequence."""

import importlib
import math

import pytest
import torch

from bloomnative.kernels import (
    alibi_attention_block_backward_reference,
    alibi_attention_block_reference,
    flash_alibi_attention,
    flash_alibi_attention_block,
    flash_alibi_attention_block_backward,
    flash_alibi_attention_reference,
)
from bloomnative.kernels.flash_alibi_reference import dropout_keep_mask
from harness.kernel_checks import (
    TOLERANCE,
    assert_close_to_reference,
    bloom_alibi_slopes,
    float64_leaves,
)

fa_module = importlib.import_module("bloomnative.kernels.flash_alibi_attention")

# (seq, head_dim, dtype, causal, q_offset, k_offset) against the interpreter's 32x16 forward and
# 16x32 backward tiles: a diagonal shifted by 32 (straddling tiles), a diagonal at an offset
# (split head_dim, bf16), a shift that is no multiple of a tile (padded head_dim: the pointer
# path), queries wholly after their keys (no mask at all), and keys after the queries (not
# causal).
CASES = [
    (37, 64, torch.float32, True, 40, 8),
    (45, 80, torch.bfloat16, True, 64, 64),
    (33, 24, torch.float32, True, 57, 20),
    (37, 96, torch.float32, True, 90, 0),
    (50, 64, torch.float32, False, 0, 56),
]


def _ids(case):
    seq, head_dim, dtype, causal, q_offset, k_offset = case
    mode = "causal" if causal else "full"
    return f"s{seq}-d{head_dim}-{str(dtype)[6:]}-{mode}-q{q_offset}-k{k_offset}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_offsets_place_alibi_and_the_causal_mask_at_global_positions(triton_kernels, case):
    seq, head_dim, dtype, causal, q_offset, k_offset = case
    q, k, v = (torch.randn(1, 3, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(3)
    offsets = {"q_offset": q_offset, "k_offset": k_offset}
    out = flash_alibi_attention(q, k, v, slopes, causal, **offsets)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    # The reference: the same rows and keys placed inside one longer sequence, where the
    # positions are plain indices (zero keys elsewhere are masked out of the softmax).
    total = max(q_offset, k_offset) + seq
    q64, k64, v64 = float64_leaves(q, k, v)
    full = [torch.zeros(1, 3, total, head_dim, dtype=torch.float64) for _ in range(3)]
    rows, keys = slice(q_offset, q_offset + seq), slice(k_offset, k_offset + seq)
    full[0][:, :, rows], full[1][:, :, keys], full[2][:, :, keys] = q64, k64, v64
    pos = torch.arange(total)
    visible = (pos[None, :] >= k_offset) & (pos[None, :] < k_offset + seq)
    if causal:
        visible = visible & (pos[None, :] <= pos[:, None])
    scores = full[0] @ full[1].transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores + slopes.double()[:, None, None] * (pos[None, :] - pos[:, None])
    ref = torch.softmax(scores.masked_fill(~visible, -math.inf)[..., rows, :], -1) @ full[2]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())

    tol = TOLERANCE[dtype]
    assert_close_to_reference(out, ref, tol, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close_to_reference(got, want, tol, name)
    ref_offsets = flash_alibi_attention_reference(q64, k64, v64, slopes.double(), causal, **offsets)
    assert_close_to_reference(ref_offsets, ref, 1e-12, "reference with offsets")


def test_dropout_at_offsets_draws_the_whole_sequences_stream(triton_kernels):
    seed = torch.tensor(77, dtype=torch.int64)
    whole = dropout_keep_mask(seed, (1, 2, 96, 96), 0.3)
    window = dropout_keep_mask(seed, (1, 2, 30, 30), 0.3, q_offset=61, k_offset=36)
    assert torch.equal(window, whole[:, :, 61:91, 36:66])  # the reference takes any offset

    q, k, v = (torch.randn(1, 2, 30, 32, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    kwargs = {"dropout_p": 0.3, "rng_seed": seed, "q_offset": 61, "k_offset": 32}
    out = flash_alibi_attention(q, k, v, slopes, **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = float64_leaves(q, k, v)
    ref = flash_alibi_attention_reference(q64, k64, v64, slopes.double(), **kwargs)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    assert_close_to_reference(out, ref, 1e-5, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close_to_reference(got, want, 1e-5, name)


def test_stored_lse_is_that_of_the_global_relative_scores(triton_kernels):
    q, k, v = (torch.randn(2, 3, 37, 64) for _ in range(3))
    slopes = bloom_alibi_slopes(3)
    out, lse2 = flash_alibi_attention_block(
        q, k, v, slopes, causal=True, softmax_scale=0.125, q_offset=50, k_offset=30
    )
    ref_out, ref_lse2 = alibi_attention_block_reference(
        q.double(), k.double(), v.double(), slopes, causal=True, softmax_scale=0.125,
        q_offset=50, k_offset=30,
    )  # fmt: skip
    q_pos, k_pos = torch.arange(50, 87.0), torch.arange(30, 67.0)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.125
    scores = scores + slopes.double()[:, None, None] * (k_pos[None, :] - q_pos[:, None])
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    assert_close_to_reference(lse2 * math.log(2.0), torch.logsumexp(scores, -1), 1e-5, "lse")
    assert_close_to_reference(ref_lse2, lse2, 1e-5, "reference lse2")
    assert_close_to_reference(out, ref_out, 1e-5, "out")


@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton", "torch"])
def test_blocks_merged_by_lse_give_the_whole_attention_and_its_gradients(
    triton_kernels, use_kernel
):
    # Keys [0, 48) of 48 queries in three blocks of 16 (ring attention on one process): the
    # forward merges the blocks by their lse, the backward gives each block the merged
    # statistics and sums the blocks' gradients.
    from bloomnative.parallel.context_parallel import merge_partial_attention

    forward, backward = (
        (flash_alibi_attention_block, flash_alibi_attention_block_backward)
        if use_kernel
        else (alibi_attention_block_reference, alibi_attention_block_backward_reference)
    )
    heads, seq, head_dim, chunk = 2, 48, 32, 16
    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    grad_out = torch.randn(1, heads, seq, head_dim)
    slopes = bloom_alibi_slopes(heads)
    seed = torch.tensor(3, dtype=torch.int64)
    common = {"softmax_scale": head_dim**-0.5, "dropout_p": 0.2, "rng_seed": seed}

    def chunks(t, i):
        return t[:, :, i * chunk : (i + 1) * chunk]

    out = torch.empty_like(q)
    lses = []
    for qi in range(3):
        merged = None
        for ki in range(qi + 1):
            block = forward(
                chunks(q, qi), chunks(k, ki), chunks(v, ki), slopes, causal=qi == ki,
                q_offset=qi * chunk, k_offset=ki * chunk, **common,
            )  # fmt: skip
            merged = block if merged is None else merge_partial_attention(*merged, *block)
        chunks(out, qi).copy_(merged[0])
        lses.append(merged[1].float())
    dq, dk, dv = (torch.zeros_like(q) for _ in range(3))
    for qi in range(3):
        for ki in range(qi + 1):
            grads = backward(
                chunks(grad_out, qi), chunks(q, qi), chunks(k, ki), chunks(v, ki),
                chunks(out, qi), lses[qi], slopes, causal=qi == ki,
                q_offset=qi * chunk, k_offset=ki * chunk, **common,
            )  # fmt: skip
            for total, grad, i in zip((dq, dk, dv), grads, (qi, ki, ki), strict=True):
                chunks(total, i).add_(grad)

    q64, k64, v64 = float64_leaves(q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
    ref = flash_alibi_attention_reference(
        q64, k64, v64, slopes.double(), dropout_p=0.2, rng_seed=seed
    )
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    assert_close_to_reference(out, ref, 1e-5, "out")
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, strict=True):
        assert_close_to_reference(got, want, 1e-5, name)


def test_offsets_pass_opcheck(triton_kernels):
    q, k, v = (torch.randn(1, 2, 19, 64, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    seed = torch.tensor(7, dtype=torch.int64)
    torch.library.opcheck(
        fa_module._flash_alibi_fwd, (q, k, v, slopes, True, 0.125, 0.25, seed, 40, 16)
    )


def test_offsets_that_cannot_work_are_reported():
    q = torch.randn(1, 2, 8, 32)
    slopes = torch.ones(2)
    with pytest.raises(ValueError, match="causal with q_offset 8 < k_offset 16"):
        flash_alibi_attention(q, q, q, slopes, q_offset=8, k_offset=16)
    with pytest.raises(ValueError, match=r"k_offset must be a multiple of 16 \(.*\), got 4"):
        flash_alibi_attention(q, q, q, slopes, dropout_p=0.1, q_offset=8, k_offset=4)
    with pytest.raises(ValueError, match="are positions, got -1 and 0"):
        flash_alibi_attention(q, q, q, slopes, q_offset=-1)
    with pytest.raises(ValueError, match="positions up to 65544"):
        flash_alibi_attention(q, q, q, slopes, dropout_p=0.1, q_offset=65536, k_offset=0)
    with pytest.raises(ValueError, match="dropout needs an explicit rng_seed"):
        flash_alibi_attention_block(
            q, q, q, slopes, causal=True, softmax_scale=1.0, q_offset=0, k_offset=0,
            dropout_p=0.1,
        )  # fmt: skip

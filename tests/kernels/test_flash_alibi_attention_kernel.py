"""flash_alibi_attention (Triton, via the interpreter) against a float64 reference."""

import importlib
import math
import warnings

import pytest
import torch

from bloomnative.kernels import (
    _dispatch,
    flash_alibi_attention,
    flash_alibi_attention_reference,
    flex_alibi_attention,
)
from bloomnative.kernels.flash_alibi_reference import (
    _philox_words,
    dropout_keep_mask,
    dropout_scale,
    dropout_threshold,
)
from harness.kernel_checks import (
    TOLERANCE,
    assert_close_to_reference,
    bloom_alibi_slopes,
    float64_leaves,
)

fa_module = importlib.import_module("bloomnative.kernels.flash_alibi_attention")

# (batch, heads, seq, head_dim, dtype, causal): ragged sequence lengths (1, 37, 130 are not
# multiples of the 16/32 interpreter tiles), head counts that are not powers of two, head_dim
# 64/128, split ones (80 = 64 + 16, 96 = 64 + 32) and a padded one (24 -> 32), every dtype, both
# mask modes, bf16 non-causal and bf16 80/96 causal.
CASES = [
    (1, 3, 37, 64, torch.float32, True),
    (1, 5, 130, 64, torch.bfloat16, True),
    (2, 3, 37, 128, torch.float16, True),
    (1, 3, 1, 64, torch.float32, True),
    (1, 5, 50, 80, torch.float32, False),
    (1, 3, 45, 96, torch.bfloat16, True),
    (1, 2, 40, 80, torch.bfloat16, True),
    (1, 3, 50, 64, torch.bfloat16, False),
    (2, 2, 130, 32, torch.float32, False),
    (1, 2, 33, 24, torch.float32, True),
]


def _ids(case):
    b, h, s, d, dtype, causal = case
    return f"b{b}-h{h}-s{s}-d{d}-{str(dtype)[6:]}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_and_gradients_match_float64_reference(triton_kernels, case):
    batch, heads, seq, head_dim, dtype, causal = case
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3)
    )
    slopes = bloom_alibi_slopes(heads)
    out = flash_alibi_attention(q, k, v, slopes, causal=causal)
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)

    q64, k64, v64 = float64_leaves(q, k, v)
    ref = flash_alibi_attention_reference(q64, k64, v64, slopes.double(), causal=causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())

    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, tol, "out")
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, strict=True):
        assert_close_to_reference(got, want, tol, name)


def test_logsumexp_of_the_relative_scores_is_stored_in_log2_units(triton_kernels):
    # The kernels add ALiBi as a column term relative to each block; the stored lse must still be
    # that of the documented relative-form scores, whatever the block.
    q, k, v = (torch.randn(2, 3, 37, 64) for _ in range(3))
    slopes = bloom_alibi_slopes(3)
    scale = 0.125
    out, lse2 = torch.ops.bloomnative.flash_alibi_attention_fwd(
        q, k, v, slopes, True, scale, 0.0, None
    )
    lse = lse2 * math.log(2.0)
    pos = torch.arange(37, dtype=torch.float64)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores + slopes.double()[:, None, None] * (pos[None, :] - pos[:, None])
    scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    assert_close_to_reference(lse, torch.logsumexp(scores, dim=-1), 1e-5, "lse")


def test_explicit_softmax_scale_is_used(triton_kernels):
    q, k, v = (torch.randn(1, 2, 20, 64) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    out = flash_alibi_attention(q, k, v, slopes, softmax_scale=0.3)
    ref = flash_alibi_attention_reference(q.double(), k.double(), v.double(), slopes, True, 0.3)
    assert_close_to_reference(out, ref, 1e-5)


def test_strided_inputs_from_a_fused_qkv_projection(triton_kernels):
    # BLOOM's fused QKV is [batch, seq, heads, 3, head_dim]; q/k/v are strided views of it and
    # the output keeps the [batch, seq, heads, head_dim] memory order of q.
    batch, seq, heads, head_dim = 2, 40, 3, 64
    qkv = torch.randn(batch, seq, heads, 3, head_dim, requires_grad=True)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    slopes = bloom_alibi_slopes(heads)
    out = flash_alibi_attention(q, k, v, slopes)
    assert out.transpose(1, 2).is_contiguous()
    grad_out = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, grad_out)

    (qkv64,) = float64_leaves(qkv)
    q64, k64, v64 = (qkv64[..., i, :].transpose(1, 2) for i in range(3))
    ref = flash_alibi_attention_reference(q64, k64, v64, slopes.double())
    (ref_dqkv,) = torch.autograd.grad(ref, qkv64, grad_out.double())
    assert_close_to_reference(out, ref, 1e-5, "out")
    assert_close_to_reference(dqkv, ref_dqkv, 1e-5, "dqkv")


def test_alibi_relative_form_equals_blooms_absolute_key_position_bias(triton_kernels):
    # BLOOM adds slope * key_pos; the kernel adds slope * (key_pos - query_pos). Under softmax
    # the per-row constant cancels, causal or not.
    q, k, v = (torch.randn(1, 4, 30, 64, dtype=torch.float64) for _ in range(3))
    slopes = bloom_alibi_slopes(4).double()
    for causal in (True, False):
        scores = q @ k.transpose(-1, -2) / 8.0 + slopes[:, None, None] * torch.arange(30.0)
        if causal:
            scores = scores.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), -torch.inf)
        bloom = torch.softmax(scores, dim=-1) @ v
        out = flash_alibi_attention(q.float(), k.float(), v.float(), slopes.float(), causal)
        assert_close_to_reference(out, bloom, 1e-5, f"causal={causal}")


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_fake_autograd_and_schema_registrations_pass_opcheck(triton_kernels, dropout_p):
    q, k, v = (torch.randn(1, 2, 19, 64, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    seed = torch.tensor(7, dtype=torch.int64) if dropout_p else None
    torch.library.opcheck(
        fa_module._flash_alibi_fwd, (q, k, v, slopes, True, 0.125, dropout_p, seed)
    )


def _fwd_bwd_against_reference(shape, dtype, causal, dropout_p=0.0, seed=None):
    batch, heads, seq, head_dim = shape
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(heads)
    out = flash_alibi_attention(q, k, v, slopes, causal, dropout_p=dropout_p, rng_seed=seed)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = float64_leaves(q, k, v)
    ref = flash_alibi_attention_reference(
        q64, k64, v64, slopes.double(), causal, dropout_p=dropout_p, rng_seed=seed
    )
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    tol = TOLERANCE[dtype]
    assert_close_to_reference(out, ref, tol, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close_to_reference(got, want, tol, name)


# The GPU search spaces run through the interpreter too (their tiles, not only the interpreter's
# 32x16 / 16x32), on lengths that leave every tile ragged. Each forward tile is paired with a
# backward tile; head_dim 80 exercises the split path, 64 the plain one.
GPU_TILE_CASES = [
    ((128, 128), (64, 128), 80, 0.0),
    ((128, 64), (64, 64), 80, 0.2),
    ((64, 64), (16, 128), 96, 0.0),
    ((128, 64), (32, 64), 64, 0.2),
]


@pytest.mark.skipif(
    not _dispatch.INTERPRET,
    reason="forces the interpreter through the GPU tiles; on a GPU the autotuner runs them",
)
@pytest.mark.parametrize(
    "fwd_tile, bwd_tile, head_dim, dropout_p",
    GPU_TILE_CASES,
    ids=[f"fwd{f[0]}x{f[1]}-bwd{b[0]}x{b[1]}-d{d}-p{p}" for f, b, d, p in GPU_TILE_CASES],
)
def test_gpu_tile_shapes_match_reference(
    triton_kernels, monkeypatch, fwd_tile, bwd_tile, head_dim, dropout_p
):

    def config(tile):
        return [fa_module.triton.Config({"BLOCK_M": tile[0], "BLOCK_N": tile[1]})]

    for tuner in fa_module._fwd_kernels.values():
        monkeypatch.setattr(tuner, "configs", config(fwd_tile))
    for tuner in fa_module._bwd_kernels.values():
        monkeypatch.setattr(tuner, "configs", config(bwd_tile))
    seed = torch.tensor(2024, dtype=torch.int64) if dropout_p else None
    _fwd_bwd_against_reference((1, 2, 150, head_dim), torch.float32, True, dropout_p, seed)


@pytest.mark.parametrize(
    "head_dim, causal, tma", [(64, True, True), (80, False, True), (80, True, False)]
)
def test_dropout_matches_reference_drawing_the_same_stream(
    triton_kernels, monkeypatch, head_dim, causal, tma
):
    # The reference materialises the keep-mask from the documented Philox stream; the kernels
    # regenerate it per tile in the forward and again in the backward.
    if not tma:
        monkeypatch.setattr(fa_module, "_use_tma", lambda *args: False)
    seed = torch.tensor(-(2**40) + 12345, dtype=torch.int64)
    _fwd_bwd_against_reference((2, 3, 37, head_dim), torch.float32, causal, 0.3, seed)


def test_dropout_mask_is_a_pure_function_of_seed_batch_head_query_key():
    seed = torch.tensor(99, dtype=torch.int64)
    big = dropout_keep_mask(seed, (2, 5, 40, 40), 0.1)
    small = dropout_keep_mask(seed, (2, 3, 21, 21), 0.1)
    assert torch.equal(big[:2, :3, :21, :21], small)  # batch, heads and length do not matter
    other = dropout_keep_mask(torch.tensor(100, dtype=torch.int64), (2, 5, 40, 40), 0.1)
    assert not torch.equal(big, other)
    assert not torch.equal(big[0, 0], big[0, 1]) and not torch.equal(big[0, 0], big[1, 0])
    keep = dropout_keep_mask(seed, (4, 4, 256, 256), 0.1).float().mean().item()
    # 0.1 in 256ths is 26: 230 of the 256 byte values keep. 2^20 draws: standard error 3e-4.
    assert abs(keep - 230 / 256) < 0.002, keep
    assert dropout_scale(0.1) == 256 / 230


def test_each_philox_call_gives_a_byte_to_each_of_16_keys():
    """The documented stream, element by element: key j of query i draws byte j % 4 of word
    (j % 16) // 4 of the Philox call with counter (i * 2^12 + j // 16, h, b, 0)."""
    seed, (batch, heads, q_len, k_len), p = torch.tensor(2**33 + 5), (2, 2, 5, 40), 0.3
    mask = dropout_keep_mask(seed, (batch, heads, q_len, k_len), p)
    for b, h, i, j in [(0, 0, 0, 0), (1, 1, 4, 39), (0, 1, 3, 17), (1, 0, 2, 31), (0, 0, 4, 8)]:
        counter = tuple(torch.tensor([c]) for c in (i * 4096 + j // 16, h, b, 0))
        word = _philox_words(seed, counter)[(j % 16) // 4]
        draw = (int(word) >> (8 * (j % 4))) & 0xFF
        assert bool(mask[b, h, i, j]) == (draw >= dropout_threshold(p)), (b, h, i, j)
    assert [dropout_threshold(x) for x in (0.0, 0.001, 0.1, 0.5, 0.999)] == [0, 1, 26, 128, 255]


def test_dropout_is_reproducible_from_the_seed_and_varies_without_one(triton_kernels):
    q, k, v = (torch.randn(1, 2, 24, 32) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    seed = torch.tensor(5, dtype=torch.int64)
    first = flash_alibi_attention(q, k, v, slopes, dropout_p=0.5, rng_seed=seed)
    again = flash_alibi_attention(q, k, v, slopes, dropout_p=0.5, rng_seed=seed.clone())
    assert torch.equal(first, again)
    drawn = [flash_alibi_attention(q, k, v, slopes, dropout_p=0.5) for _ in range(2)]
    assert not torch.equal(drawn[0], drawn[1])
    no_dropout = flash_alibi_attention(q, k, v, slopes)
    assert torch.equal(flash_alibi_attention(q, k, v, slopes, dropout_p=0.0), no_dropout)


def test_cpu_without_interpreter_dispatches_to_the_reference(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton op must not run on CPU without the interpreter")

    monkeypatch.setattr(fa_module, "use_triton", lambda tensor: False)
    monkeypatch.setattr(fa_module, "_flash_alibi_fwd", fail)
    q, k, v = (torch.randn(1, 2, 9, 32) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    torch.testing.assert_close(
        flash_alibi_attention(q, k, v, slopes), flash_alibi_attention_reference(q, k, v, slopes)
    )


def test_invalid_shapes_are_reported_with_the_offending_values():
    q = torch.randn(1, 3, 8, 64)
    with pytest.raises(ValueError, match=r"slopes must have shape \[3\]"):
        flash_alibi_attention(q, q, q, torch.ones(4))
    with pytest.raises(ValueError, match="same shape"):
        flash_alibi_attention(q, q[:, :, :4], q, torch.ones(3))
    with pytest.raises(ValueError, match="head_dim 320"):
        big = torch.randn(1, 1, 4, 320)
        flash_alibi_attention(big, big, big, torch.ones(1))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.0"):
        flash_alibi_attention(q, q, q, torch.ones(3), dropout_p=1.0)
    with pytest.raises(ValueError, match="rng_seed must be a 0-d int64 tensor"):
        flash_alibi_attention(q, q, q, torch.ones(3), dropout_p=0.1, rng_seed=torch.tensor(1.0))


@pytest.mark.parametrize("causal", [True, False])
def test_flex_alibi_attention_forward_matches_reference(causal):
    q, k, v = (torch.randn(2, 3, 37, 64) for _ in range(3))
    slopes = bloom_alibi_slopes(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unoptimized
        out = flex_alibi_attention(q, k, v, slopes, causal=causal)
    ref = flash_alibi_attention_reference(q.double(), k.double(), v.double(), slopes, causal)
    assert_close_to_reference(out, ref, 1e-5)

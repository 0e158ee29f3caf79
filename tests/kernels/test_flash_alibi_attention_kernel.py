"""flash_alibi_attention (Triton, via the interpreter) against a float64 reference."""

import importlib
import warnings

import pytest
import torch
from kernel_test_utils import (
    TOLERANCE,
    assert_close_to_reference,
    bloom_alibi_slopes,
    float64_leaves,
)

from bloomnative.kernels import (
    flash_alibi_attention,
    flash_alibi_attention_reference,
    flex_alibi_attention,
)

fa_module = importlib.import_module("bloomnative.kernels.flash_alibi_attention")

# (batch, heads, seq, head_dim, dtype, causal): ragged sequence lengths (1, 37, 130 are not
# multiples of the 16/32 interpreter tiles), head counts that are not powers of two, head_dim
# 64/128 and non-powers of two (80, 96 pad to 128 with masks), every dtype, both mask modes.
CASES = [
    (1, 3, 37, 64, torch.float32, True),
    (1, 5, 130, 64, torch.bfloat16, True),
    (2, 3, 37, 128, torch.float16, True),
    (1, 3, 1, 64, torch.float32, True),
    (1, 5, 50, 80, torch.float32, False),
    (1, 3, 45, 96, torch.bfloat16, True),
    (2, 2, 130, 32, torch.float32, False),
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


def test_logsumexp_is_stored_in_natural_log_for_the_backward(triton_kernels):
    q, k, v = (torch.randn(2, 3, 37, 64) for _ in range(3))
    slopes = bloom_alibi_slopes(3)
    scale = 0.125
    out, lse = torch.ops.bloomnative.flash_alibi_attention_fwd(q, k, v, slopes, True, scale)
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


def test_fake_autograd_and_schema_registrations_pass_opcheck(triton_kernels):
    q, k, v = (torch.randn(1, 2, 19, 64, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    torch.library.opcheck(fa_module._flash_alibi_fwd, (q, k, v, slopes, True, 0.125))


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


@pytest.mark.parametrize("causal", [True, False])
def test_flex_alibi_attention_forward_matches_reference(causal):
    q, k, v = (torch.randn(2, 3, 37, 64) for _ in range(3))
    slopes = bloom_alibi_slopes(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unoptimized
        out = flex_alibi_attention(q, k, v, slopes, causal=causal)
    ref = flash_alibi_attention_reference(q.double(), k.double(), v.double(), slopes, causal)
    assert_close_to_reference(out, ref, 1e-5)

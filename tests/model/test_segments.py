"""Packed sequences in the model: with segments every attention backend keeps each token inside
its own segment, so a packed sample gets what each of its segments gets alone. The oracle runs
every segment as its own causal sequence in float64 (positions from 0: ALiBi is relative, so
packing moves nothing) and puts the pieces side by side; the backends see the packed sample
once. The kernel's own cases are in tests/kernels/test_flash_alibi_attention_segments.py, the
ring's in tests/parallel/test_context_parallel.py."""

import math

import numpy as np
import pytest
import torch

from bloomnative.kernels import _dispatch, segment_bounds
from bloomnative.model import Bloom, BloomArgs, alibi_slopes
from bloomnative.model.attention import attention_backend

# Per sample, segment lengths summing to SEQ: one of length 1, segments starting mid-tile of the
# interpreter's 32x16 / 16x32 tiles, and a sample that is one segment.
SEQ = 40
LENGTHS = [[5, 1, 11, 15, 8], [40]]
HEADS, HEAD_DIM = 4, 16

NEEDS_INTERPRETER = pytest.mark.skipif(
    not _dispatch.INTERPRET,
    reason="the Triton backend runs on CPU only in Triton's interpreter (TRITON_INTERPRET=1 set "
    "before Triton is imported)",
)
BACKENDS = [
    "sdpa",
    pytest.param("triton", marks=NEEDS_INTERPRETER),
    "flex",
]


def packed_segments(lengths_per_sample: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [np.repeat(np.arange(len(lengths)), lengths) for lengths in lengths_per_sample]
    return segment_bounds(torch.from_numpy(np.stack(ids)))


def each_segment_alone(q, k, v, slopes, lengths_per_sample):
    """float64 attention with every segment a causal sequence of its own."""
    samples = []
    for b, lengths in enumerate(lengths_per_sample):
        pieces, start = [], 0
        for n in lengths:
            qs, ks, vs = (t[b : b + 1, :, start : start + n].double() for t in (q, k, v))
            pos = torch.arange(n)
            scores = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
            scores = scores + slopes.double()[:, None, None] * (pos[None, :] - pos[:, None])
            scores = scores.masked_fill(pos[None, :] > pos[:, None], -math.inf)
            pieces.append(torch.softmax(scores, -1) @ vs)
            start += n
        samples.append(torch.cat(pieces, dim=2))
    return torch.cat(samples, dim=0)


def qkv(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (len(LENGTHS), HEADS, SEQ, HEAD_DIM)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_attends_inside_segments_as_each_segment_alone(backend):
    """Output and (where the backend has a backward on CPU) the q, k, v gradients."""
    dtype = torch.float64 if backend == "sdpa" else torch.float32
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    backward = backend != "flex"  # FlexAttention has no backward on CPU (model.attention.TRAITS)
    q, k, v = (t.requires_grad_(backward) for t in qkv(dtype))
    slopes = alibi_slopes(HEADS)
    grad = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = each_segment_alone(*leaves, slopes, LENGTHS)
    want_grads = torch.autograd.grad(want, leaves, grad)

    got = attention_backend(backend)(q, k, v, slopes, 0.0, packed_segments(LENGTHS))
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if not backward:
        return
    got_grads = torch.autograd.grad(got, (q, k, v), grad.to(dtype))
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=f"d{name}")


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("triton", marks=NEEDS_INTERPRETER)])
def test_with_dropout_no_token_sees_another_segment(backend):
    """With attention dropout (the same draw each time), changing the keys and values of every
    other segment leaves each segment's output, and the gradient into it, unchanged."""
    slopes = alibi_slopes(HEADS)
    segments = packed_segments(LENGTHS)
    q, k, v = qkv(torch.float32)
    starts = np.cumsum([0, *LENGTHS[0][:-1]])
    for start, n in zip(starts, LENGTHS[0], strict=True):
        inside = torch.zeros(SEQ, dtype=torch.bool)
        inside[start : start + n] = True
        others = qkv(torch.float32, seed=1)
        k2, v2 = (torch.where(inside[:, None], t, o) for t, o in ((k, others[1]), (v, others[2])))
        outs = []
        for keys, values in ((k, v), (k2, v2)):
            leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
            torch.manual_seed(5)
            out = attention_backend(backend)(*leaves, slopes, 0.3, segments)
            (dq,) = torch.autograd.grad(out[0, :, inside].sum(), leaves[:1])
            outs.append((out[0, :, inside], dq[0, :, inside]))
        (out_a, dq_a), (out_b, dq_b) = outs
        assert not torch.equal(outs[0][0], torch.zeros_like(out_a))
        torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dq_b, dq_a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("triton", marks=NEEDS_INTERPRETER)])
def test_the_model_on_a_packed_sample_equals_each_segment_run_alone(backend):
    """Bloom's logits over a packed sample (segments into every layer) against the model run on
    each segment as a sample of its own."""
    args = BloomArgs(n_layer=2, hidden_size=32, n_head=HEADS, vocab_size=64, attention=backend)
    model = Bloom(args)
    model.init_weights(seed=0)
    dtype = torch.float64 if backend == "sdpa" else torch.float32
    model.to(dtype)
    tokens = torch.randint(0, 64, (len(LENGTHS), SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(tokens, segments=packed_segments(LENGTHS))
        for b, lengths in enumerate(LENGTHS):
            start = 0
            for n in lengths:
                alone = model(tokens[b : b + 1, start : start + n])
                torch.testing.assert_close(
                    packed[b : b + 1, start : start + n], alone, rtol=2e-5, atol=2e-5
                )
                start += n
        # Without segments the same sample is one sequence: the later segments differ.
        whole = model(tokens)
    assert not torch.allclose(whole[0, 6:], packed[0, 6:], atol=1e-3)


def test_flex_builds_the_mask_of_every_new_packing():
    """FlexAttention caches the block mask of the last segments for the other layers of a
    forward; new segments (a new tensor, possibly where the last one was freed) get their own."""
    q, k, v = qkv(torch.float32)
    slopes = alibi_slopes(HEADS)
    for lengths in (LENGTHS, [[20, 20], [1, 39]], LENGTHS, [[40], [39, 1]]):
        got = attention_backend("flex")(q, k, v, slopes, 0.0, packed_segments(lengths))
        want = each_segment_alone(q, k, v, slopes, lengths)
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)

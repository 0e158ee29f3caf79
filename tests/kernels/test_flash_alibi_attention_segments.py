"""flash_alibi_attention with segments (packed sequences): through the interpreter, each segment
gets what it gets alone. The oracle runs every segment of every sample as its own causal
sequence in float64 (positions from 0: ALiBi is relative, so packing moves nothing) and puts the
pieces side by side; the kernel sees the packed sample once."""

import importlib
import math

import numpy as np
import pytest
import torch

from bloomnative.kernels import (
    flash_alibi_attention,
    flash_alibi_attention_block,
    flash_alibi_attention_block_backward,
    flash_alibi_attention_reference,
    segment_bounds,
)
from harness.kernel_checks import TOLERANCE, assert_close_to_reference, bloom_alibi_slopes

fa_module = importlib.import_module("bloomnative.kernels.flash_alibi_attention")

# Segment lengths per sample, against the interpreter's 32x16 forward and 16x32 backward tiles:
# segments starting mid-block, one of length 1, padding (id 0) at the end, a segment longer than
# a tile, one sample that is a single segment.
SAMPLES = {
    "mixed": [[5, 1, 20, 37, 9, 3], [70, 5]],
    "short": [[1] * 11 + [64], [8] * 9 + [3]],
}


def _segment_ids(lengths: list[int], pad_last: bool) -> torch.Tensor:
    ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    if pad_last:  # the last segment is padding, id 0 (Megatron-DeepSpeed's packed samples)
        ids[-lengths[-1] :] = 0
    return torch.from_numpy(ids)


def _each_segment_alone(q, k, v, slopes, lengths_per_sample, grad_out):
    """float64 output and gradients, every segment attended on its own."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    samples = []
    for b, lengths in enumerate(lengths_per_sample):
        pieces, start = [], 0
        for n in lengths:
            piece = [t[b : b + 1, :, start : start + n] for t in leaves]
            scores = piece[0] @ piece[1].transpose(-1, -2) / math.sqrt(q.shape[-1])
            pos = torch.arange(n)
            scores = scores + slopes.double()[:, None, None] * (pos[None, :] - pos[:, None])
            scores = scores.masked_fill(pos[None, :] > pos[:, None], -math.inf)
            pieces.append(torch.softmax(scores, -1) @ piece[2])
            start += n
        samples.append(torch.cat(pieces, dim=2))
    out = torch.cat(samples, dim=0)
    return out, torch.autograd.grad(out, leaves, grad_out.double())


@pytest.mark.parametrize("sample", SAMPLES, ids=str)
@pytest.mark.parametrize(
    "head_dim, dtype",
    [(64, torch.float32), (80, torch.bfloat16), (40, torch.float32)],
    ids=["d64-fp32-tma", "d80-bf16-split", "d40-fp32-padded-pointers"],
)
def test_each_segment_attends_as_if_alone(triton_kernels, sample, head_dim, dtype):
    lengths = SAMPLES[sample]
    ids = torch.stack([_segment_ids(n, pad_last=(i == 0)) for i, n in enumerate(lengths)])
    seq = ids.shape[1]
    q, k, v = (torch.randn(2, 3, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(3)
    out = flash_alibi_attention(q, k, v, slopes, segments=segment_bounds(ids))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref, ref_grads = _each_segment_alone(q, k, v, slopes, lengths, grad_out)
    tol = TOLERANCE[dtype]
    assert_close_to_reference(out, ref, tol, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close_to_reference(got, want, tol, name)
    # The torch reference (the CPU path) agrees with the oracle too.
    reference = flash_alibi_attention_reference(
        *(t.detach().double() for t in (q, k, v)), slopes.double(), segments=segment_bounds(ids)
    )
    assert_close_to_reference(reference, ref, 1e-12, "reference")


def test_segments_with_dropout_draw_the_packed_positions_stream(triton_kernels):
    """Dropout inside segments keeps the documented stream (a function of the packed
    positions), so the kernel and the reference drop the same elements."""
    ids = _segment_ids([7, 30, 1, 26], pad_last=True)[None]
    q, k, v = (torch.randn(1, 2, 64, 32, requires_grad=True) for _ in range(3))
    slopes, seed = bloom_alibi_slopes(2), torch.tensor(5, dtype=torch.int64)
    args = dict(segments=segment_bounds(ids), dropout_p=0.2, rng_seed=seed)
    out = flash_alibi_attention(q, k, v, slopes, **args)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = flash_alibi_attention_reference(*leaves, slopes.double(), **args)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    assert_close_to_reference(out, ref, 1e-5, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close_to_reference(got, want, 1e-5, name)


def test_blocks_of_a_packed_sequence_merge_into_the_whole(triton_kernels):
    """Ring attention's view: a packed sequence in two chunks; the query chunk at 48 against
    both key chunks, with the segment bounds of the whole sequence (the keys' travelling with
    them), merged by their lse: the whole attention and its gradients. The first key chunk holds
    keys no query of the second segment sees (out 0, lse -inf where a query sees none)."""
    ids = _segment_ids([20, 30, 9, 37], pad_last=False)[None]
    start, end = segment_bounds(ids)
    q, k, v = (torch.randn(1, 2, 96, 64) for _ in range(3))
    slopes, scale = bloom_alibi_slopes(2), 64**-0.5
    chunks = [slice(0, 48), slice(48, 96)]
    rows = chunks[1]

    def block(keys, **extra):
        return dict(
            causal=True, softmax_scale=scale, q_offset=48, k_offset=keys.start,
            q_segment_start=start[:, rows].contiguous(),
            k_segment_end=end[:, keys].contiguous(), **extra,
        )  # fmt: skip

    results = [
        flash_alibi_attention_block(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], slopes, **block(keys)
        )
        for keys in chunks
    ]
    lse = torch.logsumexp(torch.stack([r[1] for r in results]) * math.log(2), dim=0)
    weights = [torch.exp(r[1] * math.log(2) - lse)[..., None] for r in results]
    out = sum(w * r[0] for w, r in zip(weights, results, strict=True))
    whole = flash_alibi_attention_reference(
        q.double(), k.double(), v.double(), slopes.double(), segments=(start, end)
    )
    assert_close_to_reference(out, whole[:, :, rows], 1e-5, "merged out")
    grad_out = torch.randn_like(out)
    lse2 = lse / math.log(2)
    dq = torch.zeros_like(out)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for keys in chunks:
        gq, gk, gv = flash_alibi_attention_block_backward(
            grad_out, q[:, :, rows], k[:, :, keys], v[:, :, keys], out, lse2, slopes,
            **block(keys),
        )  # fmt: skip
        dq += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = flash_alibi_attention_reference(*leaves, slopes.double(), segments=(start, end))
    ref_grads = torch.autograd.grad(ref[:, :, rows], leaves, grad_out.double())
    assert_close_to_reference(dq, ref_grads[0][:, :, rows], 1e-5, "dq")
    assert_close_to_reference(dk, ref_grads[1], 1e-5, "dk")
    assert_close_to_reference(dv, ref_grads[2], 1e-5, "dv")


def _forward_dots(monkeypatch, **kwargs) -> int:
    """tl.dot calls of one forward (2 per key block the kernel visits at head_dim 16)."""
    from triton.runtime import interpreter

    calls = [0]
    original = interpreter.InterpreterBuilder.create_dot

    def counting(self, *args):
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", counting)
    q, k, v = (torch.randn(1, 1, 1024, 16) for _ in range(3))
    flash_alibi_attention(q, k, v, torch.tensor([0.5]), **kwargs)
    monkeypatch.undo()
    return calls[0]


def test_eight_segments_cost_about_an_eighth_of_causal(triton_kernels, monkeypatch):
    ids = torch.arange(8).repeat_interleave(128)[None]
    causal = _forward_dots(monkeypatch)
    packed = _forward_dots(monkeypatch, segments=segment_bounds(ids))
    # 1024 keys in 16-key blocks under 32-row query blocks: causal visits 1056 key blocks; the
    # 8 segments of 128 visit 160 (the diagonal blocks of each query block are in both).
    assert packed / causal < 1 / 6, (packed, causal)


def test_segment_bounds_are_the_runs_of_equal_ids():
    ids = torch.tensor([[3, 3, 1, 1, 1, 3, 0], [5, 5, 5, 5, 5, 5, 5]])
    start, end = segment_bounds(ids, offset=10)
    assert start.tolist() == [[10, 10, 12, 12, 12, 15, 16], [10] * 7]
    assert end.tolist() == [[12, 12, 15, 15, 15, 16, 17], [17] * 7]
    assert start.dtype == end.dtype == torch.int32


TWO_KERNEL_CASES = [  # (head_dim, dropout_p, segments, causal, q_offset, k_offset)
    (128, 0.3, True, True, 0, 0),
    (96, 0.0, True, True, 0, 0),
    (96, 0.3, False, True, 61, 32),
    (128, 0.2, False, False, 0, 0),
]


@pytest.mark.parametrize(
    "head_dim, dropout_p, segments, causal, q_offset, k_offset",
    TWO_KERNEL_CASES,
    ids=[f"d{c[0]}-p{c[1]}-{'seg' if c[2] else 'noseg'}-{'causal' if c[3] else 'full'}-q{c[4]}"
         for c in TWO_KERNEL_CASES],
)  # fmt: skip
def test_two_kernel_backward_matches_the_reference(
    triton_kernels, head_dim, dropout_p, segments, causal, q_offset, k_offset
):
    """head_dim > 80 with dropout or segments: dK/dV in one kernel, dQ recomputed query-major in
    another, drawing the same dropout stream as the forward."""
    assert fa_module._TWO_KERNEL_BWD >= {(dropout_p > 0, True, segments)}
    seq = 40
    ids = _segment_ids([7, 17, 1, 15], pad_last=False)[None]
    q, k, v = (torch.randn(1, 2, seq, head_dim, requires_grad=True) for _ in range(3))
    slopes, seed = bloom_alibi_slopes(2), torch.tensor(11, dtype=torch.int64)
    args = dict(
        causal=causal, dropout_p=dropout_p, rng_seed=seed if dropout_p else None,
        q_offset=q_offset, k_offset=k_offset, segments=segment_bounds(ids) if segments else None,
    )  # fmt: skip
    out = flash_alibi_attention(q, k, v, slopes, **args)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = flash_alibi_attention_reference(*leaves, slopes.double(), **args)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    assert_close_to_reference(out, ref, 1e-5, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close_to_reference(got, want, 1e-5, name)

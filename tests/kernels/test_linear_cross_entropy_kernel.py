"""linear_cross_entropy (chunked, Triton softmax/grad via the interpreter) against float64."""

import importlib
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bloomnative.kernels import (
    linear_cross_entropy,
    linear_cross_entropy_reference,
    vocab_parallel_linear_cross_entropy,
)
from bloomnative.train.distributed import exit_process
from harness.kernel_checks import TOLERANCE, assert_close_to_reference, float64_leaves

lce_module = importlib.import_module("bloomnative.kernels.linear_cross_entropy")

IGNORE = -100


def _inputs(tokens, hidden, vocab, dtype, ignore_every=5):
    h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    if ignore_every:
        targets[::ignore_every] = IGNORE
    return h, w, targets


def _check_against_float64(h, w, targets, reduction, chunk_size, tol):
    loss = linear_cross_entropy(h, w, targets, IGNORE, reduction, chunk_size)
    grad_scale = 1.7  # the stored gradients must be scaled by the incoming gradient
    dh, dw = torch.autograd.grad(loss * grad_scale, (h, w))

    h64, w64 = float64_leaves(h, w)
    ref = linear_cross_entropy_reference(h64, w64, targets, IGNORE, reduction)
    ref_dh, ref_dw = torch.autograd.grad(ref * grad_scale, (h64, w64))

    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close_to_reference(loss, ref, min(tol, 1e-3), "loss")
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    assert_close_to_reference(dh, ref_dh, tol, "d_hidden")
    assert_close_to_reference(dw, ref_dw, tol, "d_weight")


# chunk_size: several chunks with a ragged last one (16 for 37 tokens), one chunk (None: auto),
# one token per chunk. Vocab 200 spans several 64-wide interpreter vocab blocks, ragged.
CASES = [
    (torch.float32, 16, "mean"),
    (torch.float32, 16, "sum"),
    (torch.float32, None, "mean"),
    (torch.float32, 1, "sum"),
    (torch.bfloat16, 16, "mean"),
    (torch.bfloat16, None, "sum"),
    (torch.float16, 16, "sum"),
    (torch.float16, None, "mean"),
]


@pytest.mark.parametrize("dtype, chunk_size, reduction", CASES, ids=str)
def test_loss_and_gradients_match_float64_reference(triton_kernels, dtype, chunk_size, reduction):
    h, w, targets = _inputs(37, 32, 200, dtype)
    _check_against_float64(h, w, targets, reduction, chunk_size, TOLERANCE[dtype])


def _weighted_float64(h, w, targets, token_weights, reduction):
    """The weighted loss by hand: per-token cross-entropies times the weights of the counted
    tokens, summed (and divided by those weights' sum for "mean")."""
    losses = torch.nn.functional.cross_entropy(
        h @ w.t(), targets, ignore_index=IGNORE, reduction="none"
    )
    weights = token_weights.double() * (targets != IGNORE)
    total = (losses * weights).sum()
    return total if reduction == "sum" else total / weights.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch-path"])
def test_token_weights_weigh_each_tokens_loss_and_gradient(monkeypatch, reduction, triton):
    """Megatron-DeepSpeed's --norm-target-loss: each token's loss times its weight."""
    if not triton:
        monkeypatch.setattr(lce_module, "use_triton", lambda tensor: False)
    elif not lce_module.INTERPRET:
        pytest.skip("the Triton path runs in the interpreter (TRITON_INTERPRET=1) on CPU")
    h, w, targets = _inputs(37, 32, 200, torch.float32)
    token_weights = torch.rand(37) + 0.1
    loss = linear_cross_entropy(h, w, targets, IGNORE, reduction, 16, token_weights)
    dh, dw = torch.autograd.grad(loss * 1.7, (h, w))
    h64, w64 = float64_leaves(h, w)
    ref = _weighted_float64(h64, w64, targets, token_weights, reduction)
    ref_dh, ref_dw = torch.autograd.grad(ref * 1.7, (h64, w64))
    assert_close_to_reference(loss, ref, 1e-5, "loss")
    assert_close_to_reference(dh, ref_dh, 1e-5, "d_hidden")
    assert_close_to_reference(dw, ref_dw, 1e-5, "d_weight")
    reference = linear_cross_entropy_reference(h64, w64, targets, IGNORE, reduction, token_weights)
    assert_close_to_reference(reference, ref, 1e-12, "reference")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_torch_path_on_cpu_without_interpreter_matches_reference(monkeypatch, reduction):
    monkeypatch.setattr(lce_module, "use_triton", lambda tensor: False)
    h, w, targets = _inputs(37, 32, 200, torch.float32)
    _check_against_float64(h, w, targets, reduction, 16, 1e-5)


def test_all_targets_ignored_gives_zero_loss_and_zero_gradients(triton_kernels):
    h, w, targets = _inputs(8, 16, 50, torch.float32, ignore_every=0)
    targets.fill_(IGNORE)
    loss = linear_cross_entropy(h, w, targets)
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0.0
    assert not dh.any() and not dw.any()


def test_custom_ignore_index(triton_kernels):
    h, w, targets = _inputs(20, 16, 50, torch.float32, ignore_every=0)
    targets[::3] = 7  # a valid class id used as the ignore index
    loss = linear_cross_entropy(h, w, targets, ignore_index=7)
    ref = linear_cross_entropy_reference(h.double(), w.double(), targets, ignore_index=7)
    assert_close_to_reference(loss, ref, 1e-5)


def test_no_gradients_are_computed_when_none_are_needed(triton_kernels, monkeypatch):
    seen = []
    original = lce_module._fused_loss_and_grads

    def spy(*args, **kwargs):
        seen.append(args[-2:])  # need_grad_hidden, need_grad_weight
        return original(*args, **kwargs)

    monkeypatch.setattr(lce_module, "_fused_loss_and_grads", spy)
    h, w, targets = _inputs(10, 16, 50, torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, targets)
    ref = linear_cross_entropy_reference(h.double(), w.double(), targets)
    assert_close_to_reference(loss, ref, 1e-5)
    w.requires_grad_(False)  # a frozen head: only d_hidden
    (dh,) = torch.autograd.grad(linear_cross_entropy(h, w, targets), h)
    assert seen == [(False, False), (True, False)]
    assert dh.shape == h.shape


def test_weight_in_another_dtype_is_cast_like_autocast(triton_kernels):
    h, _, targets = _inputs(12, 16, 40, torch.bfloat16)
    w = torch.randn(40, 16, requires_grad=True)  # fp32 master weight
    loss = linear_cross_entropy(h, w, targets)
    (dw,) = torch.autograd.grad(loss, w)
    assert dw.dtype == torch.float32
    h64, w64 = float64_leaves(h, w)
    (ref_dw,) = torch.autograd.grad(linear_cross_entropy_reference(h64, w64, targets), w64)
    assert_close_to_reference(dw, ref_dw, 1e-2)


def test_fake_autograd_and_schema_registrations_pass_opcheck(triton_kernels):
    h, w, targets = _inputs(10, 16, 50, torch.float32)
    args = (h, w, targets, IGNORE, "mean", 4, True, True)
    torch.library.opcheck(lce_module._linear_cross_entropy_op, args)


def test_invalid_arguments_are_reported():
    h, w, targets = _inputs(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        linear_cross_entropy(h, w, targets, reduction="none")
    with pytest.raises(ValueError, match=r"targets must be integer class indices of shape \[4\]"):
        linear_cross_entropy(h, w, targets[:3])
    with pytest.raises(ValueError, match="weight \\[vocab, hidden\\]"):
        linear_cross_entropy(h, w.t(), targets)
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        linear_cross_entropy(h, w, targets, chunk_size=0)


def _vocab_parallel_worker(rank, world_size, init_file):
    # A file store, not a picked free port: another process may take the port before rank 0
    # listens on it (EADDRINUSE on a loaded machine).
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)  # identical hidden, weight and targets on every rank
        tokens, hidden, vocab = 23, 16, 90
        h, w, targets = _inputs(tokens, hidden, vocab, torch.float32)
        shard = vocab // world_size
        w_shard = w.detach()[rank * shard : (rank + 1) * shard].clone().requires_grad_()
        token_weights = torch.rand(tokens) + 0.1
        for reduction, weights in itertools.product(("mean", "sum"), (None, token_weights)):
            name = f"rank {rank} {reduction}{' weighted' if weights is not None else ''}"
            loss = vocab_parallel_linear_cross_entropy(
                h, w_shard, targets, rank * shard, None, IGNORE, reduction, 8, weights
            )
            dh, dw_shard = torch.autograd.grad(loss * 1.7, (h, w_shard))

            h64, w64 = float64_leaves(h, w)
            ref = linear_cross_entropy_reference(h64, w64, targets, IGNORE, reduction, weights)
            ref_dh, ref_dw = torch.autograd.grad(ref * 1.7, (h64, w64))
            assert_close_to_reference(loss, ref, 1e-5, f"{name} loss")
            assert_close_to_reference(dh, ref_dh, 1e-5, f"{name} d_hidden")
            ref_dw_shard = ref_dw[rank * shard : (rank + 1) * shard]
            assert_close_to_reference(dw_shard, ref_dw_shard, 1e-5, f"{name} d_weight")
            with torch.no_grad():
                eval_loss = vocab_parallel_linear_cross_entropy(
                    h, w_shard, targets, rank * shard, None, IGNORE, reduction, 8, weights
                )
            assert_close_to_reference(eval_loss, ref, 1e-5, f"{name} no_grad loss")
    finally:
        dist.destroy_process_group()
    exit_process(0)  # a spawned child would otherwise finalize with gloo threads alive


@pytest.mark.multiprocess
def test_vocab_parallel_on_two_gloo_ranks_matches_unsharded_loss(tmp_path):
    mp.spawn(_vocab_parallel_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)

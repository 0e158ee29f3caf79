"""The lm head and the cross-entropy loss fused, chunked over tokens: no [tokens, vocab] tensor.

For hidden ``h`` [N, H], the (tied) head ``W`` [V, H] and targets ``t`` [N]:

    z_i    = W h_i                           logits of token i (input dtype, fp32 accumulation)
    lse_i  = log sum_v exp(z_iv)             (fp32)
    loss_i = lse_i - z_{i, t_i}              (0 where t_i == ignore_index)
    loss   = sum_i w_i loss_i / sum_i w_i  ("mean", over non-ignored tokens)  or  sum_i w_i loss_i

with per-token weights ``w`` (all 1 unless given: Megatron-DeepSpeed's ``--norm-target-loss``
weighs each target sequence's tokens 1 / its length).

Because the loss is the last op of the graph, its gradient can be computed during the forward:
for a chunk of tokens, ``g = (softmax(z) - onehot(t)) * grad_scale`` (``grad_scale = 1/n_valid``
or 1, times the row's weight; rows with an ignored target are 0) is written in place of the
chunk's logits, then

    d_hidden[chunk] = g W          d_weight += g^T h[chunk]   (fp32 accumulator)

The backward only multiplies the stored gradients by the incoming scalar. Peak extra memory is
one chunk of logits plus d_weight's fp32 accumulator, instead of the N x V logits (8 GB in bf16
for 16k tokens x 250,880 vocab) and their fp32 softmax.

The per-row softmax statistics and the gradient are two Triton kernels (one program per token,
looping over the vocab in blocks with an online max/sum-exp in fp32); the matmuls are cuBLAS.
On the torch path the same chunk loop runs with torch ops, so the memory bound holds on CPU too.

Vocab parallelism (:func:`vocab_parallel_linear_cross_entropy`): each rank holds a contiguous
vocab shard of W; per chunk the ranks all-reduce the row max (MAX), then the sum-exp and the
target logit (SUM, one call), and d_hidden (partial over the shard) is all-reduced once in fp32.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._dispatch import (
    INTERPRET,
    empty,
    tl,
    triton,
    use_triton,
)

# Size of one chunk of logits the automatic chunk size aims for. Each chunk also reads and
# writes the whole fp32 d_weight accumulator (1 GiB for 250,880 x 1024), so chunks must be long
# enough for their three matmuls to dwarf that: 1 GiB of bf16 logits is 2048 tokens there.
_CHUNK_LOGITS_BYTES = 1024 * 1024 * 1024
_MAX_AUTO_CHUNK = 8192
_BLOCK_V = 4096  # vocab block of the row kernels (interpreter: small, to exercise the loop)


# fmt: off
@triton.jit
def _row_stats_kernel(
    LOGITS, TARGETS, ROW_MAX, ROW_SUMEXP, TARGET_LOGIT, V, stride_row, vocab_start, ignore_index,
    BLOCK_V: tl.constexpr,
):
    # Per row: max_v z, sum_v exp(z - max), and z[target] when the target falls in this shard.
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))  # each block has >= 1 valid column
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    target = tl.load(TARGETS + row)
    local = target - vocab_start
    hit = (target != ignore_index) & (local >= 0) & (local < V)
    z_target = tl.load(base + tl.where(hit, local, 0), mask=hit, other=0.0).to(tl.float32)
    tl.store(ROW_MAX + row, m)
    tl.store(ROW_SUMEXP + row, s)
    tl.store(TARGET_LOGIT + row, z_target)


@triton.jit
def _row_grad_kernel(
    LOGITS, GRAD, TARGETS, LSE, ROW_SCALE, V, stride_row, stride_grad, vocab_start, ignore_index,
    BLOCK_V: tl.constexpr,
):
    # g = (exp(z - lse) - onehot(target)) * row_scale (0 on an ignored row); GRAD may be LOGITS.
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    lse = tl.load(LSE + row)
    scale = tl.load(ROW_SCALE + row)
    local = target - vocab_start
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(LOGITS + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(z - lse) - tl.where(cols == local, 1.0, 0.0)
        tl.store(GRAD + row * stride_grad + cols, (g * scale).to(GRAD.dtype.element_ty), mask=mask)


def _block_v(v: int) -> int:
    return min(64 if INTERPRET else _BLOCK_V, triton.next_power_of_2(v))


def _row_stats(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row max, sum of exp(z - max), target logit or 0), fp32 [rows], for a chunk of logits."""
    rows, v = logits.shape
    if use_triton(logits):
        row_max = empty((rows,), torch.float32, logits.device)
        row_sumexp = empty((rows,), torch.float32, logits.device)
        target_logit = empty((rows,), torch.float32, logits.device)
        _row_stats_kernel[(rows,)](
            logits, targets, row_max, row_sumexp, target_logit, v, logits.stride(0),
            vocab_start, ignore_index, BLOCK_V=_block_v(v), num_warps=8,
        )
        return row_max, row_sumexp, target_logit
    z = logits.float()
    row_max = z.amax(dim=1)
    row_sumexp = torch.exp(z - row_max[:, None]).sum(dim=1)
    local = targets - vocab_start
    hit = (targets != ignore_index) & (local >= 0) & (local < v)
    picked = z.gather(1, torch.where(hit, local, 0)[:, None])[:, 0]
    return row_max, row_sumexp, torch.where(hit, picked, 0.0)


def _row_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    row_scale: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
) -> torch.Tensor:
    """Overwrite a chunk of logits with (softmax - onehot) * row_scale (fp32 [rows], 0 on the
    rows of ignored targets)."""
    rows, v = logits.shape
    if use_triton(logits):
        _row_grad_kernel[(rows,)](
            logits, logits, targets, lse, row_scale, v, logits.stride(0), logits.stride(0),
            vocab_start, ignore_index, BLOCK_V=_block_v(v), num_warps=8,
        )
        return logits
    grad = torch.exp(logits.float() - lse[:, None])
    local = targets - vocab_start
    hit = (targets != ignore_index) & (local >= 0) & (local < v)
    rows_hit = torch.nonzero(hit)[:, 0]
    grad[rows_hit, local[rows_hit]] -= 1.0
    grad *= row_scale[:, None]
    return logits.copy_(grad)
# fmt: on


@functools.cache
def _has_fp32_out_addmm(device_type: str) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32)`` accumulates bf16 products straight into
    an fp32 tensor on this device type (cuBLAS does; probed once, with a known answer)."""
    if device_type != "cuda":
        return False
    try:
        a = torch.ones(16, 16, device=device_type, dtype=torch.bfloat16)
        acc = torch.ones(16, 16, device=device_type, dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool((acc == 17).all())
    except (RuntimeError, TypeError):
        return False


@functools.cache
def _warn_rounded_products(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    warnings.warn(
        f"linear_cross_entropy: this torch has no fp32-output addmm for {dtype} on CUDA, so each "
        f"chunk's {list(shape)} weight-gradient product goes through a temporary in {dtype} "
        "(memory, and one rounding per chunk) before the fp32 accumulation",
        stacklevel=3,
    )


def _matmul_fp32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` for an fp32 ``out`` and ``a``, ``b`` in the input dtype.

    With 16-bit inputs cuBLAS writes (or accumulates into) fp32 directly; where that is not
    available each product is rounded to the input dtype once before the fp32 add.
    """
    beta = 1.0 if accumulate else 0.0
    if a.dtype == out.dtype:
        torch.addmm(out, a, b, beta=beta, out=out)
    elif _has_fp32_out_addmm(out.device.type):
        torch.addmm(out, a, b, out_dtype=torch.float32, beta=beta, out=out)
    else:
        if out.is_cuda:
            _warn_rounded_products(tuple(out.shape), a.dtype)
        if accumulate:
            out += a @ b
        else:
            out.copy_(a @ b)


def _auto_chunk_size(vocab: int, dtype: torch.dtype) -> int:
    budget_rows = _CHUNK_LOGITS_BYTES // (vocab * torch.finfo(dtype).bits // 8)
    return max(16, min(_MAX_AUTO_CHUNK, 1 << max(budget_rows, 1).bit_length() - 1))


def _fused_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    group: dist.ProcessGroup | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk loop shared by the single-device op and the vocab-parallel function.

    Returns (loss fp32 scalar, d_hidden like hidden or empty, d_weight like weight or empty).
    """
    n, _ = hidden.shape
    device = hidden.device
    targets = targets.contiguous()
    # Each row's weight in the loss: its token weight (1 without), 0 for an ignored target.
    counted = (targets != ignore_index).to(torch.float32)
    row_weight = counted if token_weights is None else counted * token_weights.float()
    if reduction == "mean":
        # All targets ignored: loss 0 and zero gradients (torch's cross_entropy returns NaN).
        total = row_weight.sum()
        grad_scale = 1.0 / torch.where(total > 0, total, torch.ones_like(total))
    else:
        grad_scale = torch.ones((), dtype=torch.float32, device=device)
    row_scale = row_weight * grad_scale
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    parallel = group is not None
    if need_grad_hidden:
        d_hidden_dtype = torch.float32 if parallel else hidden.dtype
        d_hidden = torch.empty(hidden.shape, device=device, dtype=d_hidden_dtype)
    else:
        d_hidden = hidden.new_empty((0,))
    d_weight_acc = (
        torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_grad_weight else None
    )
    for start in range(0, n, chunk_size):
        h = hidden[start : start + chunk_size]
        t = targets[start : start + chunk_size]
        logits = h @ weight.t()
        row_max, row_sumexp, target_logit = _row_stats(logits, t, vocab_start, ignore_index)
        if parallel:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([row_sumexp * torch.exp(row_max - global_max), target_logit])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            row_max, (row_sumexp, target_logit) = global_max, sums
        lse = row_max + torch.log(row_sumexp)
        rows = slice(start, start + chunk_size)
        loss_sum += (
            row_weight[rows] * torch.where(t != ignore_index, lse - target_logit, 0.0)
        ).sum()
        if not (need_grad_hidden or need_grad_weight):
            continue
        grad = _row_grad_(logits, t, lse, row_scale[rows], vocab_start, ignore_index)
        if need_grad_hidden:
            d_hidden_chunk = d_hidden[start : start + chunk_size]
            if parallel:  # a partial sum over this rank's vocab shard, reduced in fp32 below
                _matmul_fp32_(d_hidden_chunk, grad, weight, accumulate=False)
            else:
                torch.mm(grad, weight, out=d_hidden_chunk)
        if d_weight_acc is not None:
            _matmul_fp32_(d_weight_acc, grad.t(), h, accumulate=True)
    if parallel and need_grad_hidden:
        dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=group)
        d_hidden = d_hidden.to(hidden.dtype)
    d_weight = d_weight_acc.to(weight.dtype) if d_weight_acc is not None else weight.new_empty((0,))
    return loss_sum * grad_scale, d_hidden, d_weight


# fmt: off
@torch.library.custom_op("bloomnative::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, d_hidden, d_weight); the gradients are empty when not requested."""
    return _fused_loss_and_grads(
        hidden, weight, targets, 0, ignore_index, reduction, chunk_size,
        need_grad_hidden, need_grad_weight, token_weights=token_weights,
    )


@_linear_cross_entropy_op.register_fake
def _(
    hidden, weight, targets, ignore_index, reduction, chunk_size, need_grad_hidden,
    need_grad_weight, token_weights=None,
):
    loss = hidden.new_empty((), dtype=torch.float32)
    d_hidden = hidden.new_empty(hidden.shape if need_grad_hidden else (0,))
    d_weight = weight.new_empty(weight.shape if need_grad_weight else (0,))
    return loss, d_hidden, d_weight
# fmt: on


def _setup_context(ctx, inputs, output) -> None:
    need_grad_hidden, need_grad_weight = inputs[6], inputs[7]
    loss, d_hidden, d_weight = output
    ctx.mark_non_differentiable(d_hidden, d_weight)
    ctx.save_for_backward(d_hidden, d_weight)
    ctx.need_grad_hidden, ctx.need_grad_weight = need_grad_hidden, need_grad_weight


def _backward(ctx, grad_loss, _grad_d_hidden, _grad_d_weight):
    d_hidden, d_weight = ctx.saved_tensors
    dh = d_hidden * grad_loss.to(d_hidden.dtype) if ctx.need_grad_hidden else None
    dw = d_weight * grad_loss.to(d_weight.dtype) if ctx.need_grad_weight else None
    return dh, dw, None, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(
    name: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    reduction: str,
    token_weights: torch.Tensor | None = None,
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{name}: expected hidden [tokens, hidden] and weight [vocab, hidden], got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)} (flatten batch and sequence first)"
        )
    if targets.shape != (hidden.shape[0],) or targets.is_floating_point():
        raise ValueError(
            f"{name}: targets must be integer class indices of shape [{hidden.shape[0]}], "
            f"got {targets.dtype} {tuple(targets.shape)}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{name}: reduction must be 'mean' or 'sum', got {reduction!r}")
    if token_weights is not None and token_weights.shape != targets.shape:
        raise ValueError(
            f"{name}: token_weights must have the shape of targets, [{hidden.shape[0]}], got "
            f"{tuple(token_weights.shape)}"
        )


def _resolve_chunk_size(chunk_size: int | None, vocab: int, dtype: torch.dtype) -> int:
    if chunk_size is None:
        return _auto_chunk_size(vocab, dtype)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    return chunk_size


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets)`` without materializing the logits.

    Args:
        hidden: ``[tokens, hidden]`` final hidden states (fp32, bf16 or fp16).
        weight: ``[vocab, hidden]`` lm head (BLOOM ties it to the word embedding); cast to
            hidden's dtype for the matmul if it differs, as autocast would.
        targets: ``[tokens]`` integer class indices; ``ignore_index`` rows add nothing.
        reduction: ``"mean"`` over non-ignored tokens (0 if there are none) or ``"sum"``.
        chunk_size: tokens per chunk; default: a power of two keeping one chunk of logits
            at most 1 GiB (2048 tokens at BLOOM's vocabulary in bf16), at most 8192.
        token_weights: ``[tokens]`` weight of each token's loss (all 1 when None); "mean"
            then divides by the weights of the non-ignored tokens. Not differentiated.

    Returns:
        The fp32 scalar loss; differentiable in hidden and weight (gradients computed eagerly in
        the forward, scaled in the backward).

    The softmax/gradient kernels run in Triton on CUDA tensors (or under
    ``TRITON_INTERPRET=1``), otherwise in torch; the chunked algorithm is the same on both paths.
    The op is opaque to ``torch.compile`` (one custom op, no graph break).
    """
    _check_inputs("linear_cross_entropy", hidden, weight, targets, reduction, token_weights)
    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    grad_on = torch.is_grad_enabled()
    # fmt: off
    loss, _, _ = _linear_cross_entropy_op(
        hidden, weight, targets, ignore_index, reduction,
        _resolve_chunk_size(chunk_size, weight.shape[0], hidden.dtype),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad, token_weights,
    )
    # fmt: on
    return loss


# fmt: off
class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden, weight_shard, targets, vocab_start, group, ignore_index, reduction, chunk_size,
        token_weights,
    ):
        # Grad mode is off inside forward: whether gradients are wanted is decided by the caller
        # (needs_input_grad) and by whether autograd recorded this call at all.
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, d_hidden, d_weight = _fused_loss_and_grads(
            hidden, weight_shard, targets, vocab_start, ignore_index, reduction, chunk_size,
            need_dh, need_dw, group=group, token_weights=token_weights,
        )
        ctx.save_for_backward(d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        d_hidden, d_weight = ctx.saved_tensors
        dh = d_hidden * grad_loss.to(d_hidden.dtype) if ctx.needs_input_grad[0] else None
        dw = d_weight * grad_loss.to(d_weight.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`linear_cross_entropy` with the vocabulary sharded over ``group``.

    Each rank passes the same ``hidden`` and ``targets`` (global class indices) and its own
    contiguous shard ``weight_shard`` = rows ``[vocab_start, vocab_start + shard_size)`` of the
    full head; ``group=None`` means the default (world) group. Returns the same loss on every
    rank; the gradient of ``hidden`` is the full (all-reduced) one, the gradient of
    ``weight_shard`` covers the shard. Uses eager ``torch.distributed`` collectives (call it
    outside ``torch.compile`` regions).
    """
    _check_inputs(
        "vocab_parallel_linear_cross_entropy", hidden, weight_shard, targets, reduction,
        token_weights,
    )
    if not dist.is_initialized():
        raise RuntimeError(
            "vocab_parallel_linear_cross_entropy needs torch.distributed initialized"
        )
    group = group if group is not None else dist.group.WORLD
    if weight_shard.dtype != hidden.dtype:
        weight_shard = weight_shard.to(hidden.dtype)
    chunk = _resolve_chunk_size(chunk_size, weight_shard.shape[0], hidden.dtype)
    if not torch.is_grad_enabled():  # no autograd record: compute the loss only
        loss, _, _ = _fused_loss_and_grads(
            hidden, weight_shard, targets, vocab_start, ignore_index, reduction, chunk,
            False, False, group=group, token_weights=token_weights,
        )
        return loss
    return _VocabParallelLinearCrossEntropy.apply(
        hidden, weight_shard, targets, vocab_start, group, ignore_index, reduction, chunk,
        token_weights,
    )
# fmt: on


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unfused ``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` (weighted per
    token with ``token_weights``): the test oracle and the baseline the benchmark compares
    against (it materializes all the logits)."""
    logits = F.linear(hidden, weight.to(hidden.dtype))
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    losses = F.cross_entropy(
        logits.to(compute), targets, ignore_index=ignore_index, reduction="none"
    )
    weights = (targets != ignore_index).to(compute)
    if token_weights is not None:
        weights = weights * token_weights.to(compute)
    total = (losses * weights).sum()
    if reduction == "sum":
        return total
    count = weights.sum()
    return total / torch.where(count > 0, count, torch.ones_like(count))

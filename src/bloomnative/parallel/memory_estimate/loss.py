"""The loss's memory: what it keeps until its backward, and its buffers at its worst moment."""

from __future__ import annotations

from bloomnative.model.args import BloomArgs
from bloomnative.parallel.memory_estimate.activations import micro_batch_tokens
from bloomnative.parallel.memory_estimate.components import ActivationTerm, Component
from bloomnative.parallel.memory_estimate.inputs import FP32, Layout, Precision, Workload

# The fused loss's automatic chunk (kernels/linear_cross_entropy.py): 256 MiB of logits per chunk,
# a power of two between 16 and 8192 rows.
_FUSED_LOSS_CHUNK_BYTES = 256 * 2**20


def local_vocab(args: BloomArgs, layout: Layout) -> int:
    """Logit columns per rank: sharded over tp with loss parallelism, else all-gathered."""
    return args.vocab_size // layout.tp if layout.loss_parallel else args.vocab_size


def fused_loss_chunk_rows(vocab: int, compute_bytes: int) -> int:
    """Rows of one chunk of the fused loss (kernels.linear_cross_entropy's automatic size)."""
    budget = max(_FUSED_LOSS_CHUNK_BYTES // (vocab * compute_bytes), 1)
    return max(16, min(8192, 1 << (budget.bit_length() - 1)))


def loss_saved_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """What the loss keeps per micro batch until its backward.

    Unfused (`train.loss.cross_entropy_sum`): log_softmax's fp32 output (4*b*s*V/t; its
    backward needs it). The logits themselves (b*s*V/t in the compute dtype) are freed once the
    loss exists, except on a pipeline's last stage, whose schedule keeps each micro batch's
    stage output until that micro batch's backward. Compiled: the logits and two fp32 numbers
    per token (the row max and log-sum-exp), from which its backward recomputes the softmax.
    Fused: the gradients it computes during forward, d_hidden (b*s*h) and d_weight (V/t*h).
    """
    tokens, vocab, c = micro_batch_tokens(layout, workload), local_vocab(args, layout), prec.compute
    if workload.fused_loss:
        return [
            ActivationTerm("fused loss d_hidden", tokens * args.hidden_size, c, "fused loss"),
            ActivationTerm("fused loss d_weight", vocab * args.hidden_size, c, "fused loss"),
        ]
    if workload.compiled_loss:
        row_stats = ActivationTerm("compiled loss row max and logsumexp", 2 * tokens, FP32, "2*b*s")
        logits = "logits (pipeline stage output)" if layout.pp > 1 else "logits (compiled loss)"
        return [ActivationTerm(logits, tokens * vocab, c, "b*s*V/t"), row_stats]
    terms = [
        ActivationTerm("log-probabilities (fp32)", tokens * vocab, FP32, "fp32 upcast in loss")
    ]
    if layout.pp > 1:
        terms.insert(
            0, ActivationTerm("logits (pipeline stage output)", tokens * vocab, c, "b*s*V/t")
        )
    return terms


def loss_transient(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision, device_type: str
) -> Component:
    """The loss's extra buffers at its worst moment, on top of `loss_saved_terms`.

    Unfused: log_softmax's backward holds the fp32 gradient of the log-probabilities and
    produces the fp32 gradient of the logits (2 x 4*b*s*V/t). Under DTensor loss parallelism
    the fused nll/log_softmax backward holds three (zeros, exp(log-probs), their sum). In the
    forward the fp32 upcast of bf16 logits (4*b*s*V/t) is smaller. Fused: the fp32 d_weight
    accumulator (4*V/t*h) and one chunk of logits (plus two fp32 copies of it on the torch
    path, off GPU). Compiled: its backward writes the logits' gradient (b*s*V/t in the compute
    dtype) in one pass, with no fp32 copy.
    """
    tokens, vocab = micro_batch_tokens(layout, workload), local_vocab(args, layout)
    if workload.compiled_loss:
        return Component(
            "compiled loss backward: the logits' gradient",
            prec.compute * tokens * vocab,
            "fwd_bwd",
            "b*s*V/t in the compute dtype",
        )
    if not workload.fused_loss:
        buffers = 3 if layout.tp > 1 and layout.loss_parallel else 2
        return Component(
            "loss backward buffers (fp32 grads of log-probs and logits)",
            buffers * FP32 * tokens * vocab,
            "fwd_bwd",
            f"{buffers} x 4 x b*s*V/t",
        )
    rows = min(tokens, fused_loss_chunk_rows(vocab, prec.compute))
    chunk = rows * vocab * (prec.compute + (2 * FP32 if device_type != "cuda" else 0))
    return Component(
        "fused loss fp32 d_weight accumulator + one chunk of logits",
        FP32 * vocab * args.hidden_size + chunk,
        "fwd_bwd",
        f"4*V/t*h + {rows} rows x V/t",
    )

"""Tensors kept for backward per micro batch: Korthikanti et al. 2022, eq. 1, adjusted term by
term for BLOOM, the attention kernel and sequence parallelism; and the loss's memory, what it
keeps until its backward and its buffers at its worst moment."""

from __future__ import annotations

import dataclasses

from bloomnative.model.args import BloomArgs
from bloomnative.planner.inputs import (
    ATTENTION_MEMORY,
    FP32,
    INT64,
    ActivationTerm,
    Component,
    Layout,
    PlanError,
    Precision,
    Workload,
)


def micro_batch_tokens(layout: Layout, workload: Workload) -> int:
    """Tokens of one micro batch on a rank (b*s; b*s/cp with context parallelism: every
    per-token tensor below shrinks by cp)."""
    return workload.micro_batch * workload.seq_len // layout.dims.cp


def residual_stream_elements(args: BloomArgs, layout: Layout, workload: Workload) -> int:
    """Elements of one micro batch's residual stream on a rank (b*s*h, /t with SP, /cp)."""
    return micro_batch_tokens(layout, workload) * args.hidden_size // layout.sequence_shards


def layernorm_stat_elements(layout: Layout, workload: Workload) -> int:
    """Elements of a LayerNorm's fp32 mean and rstd (2sb, /t with SP, /cp)."""
    return 2 * micro_batch_tokens(layout, workload) // layout.sequence_shards


def attention_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """What the attention keeps per block, by kernel. Korthikanti's 11sbh + 5as^2b becomes:

    - flash: q, k, v (6sbh/t, "QK^T 4sbh + V 2sbh"), the output the kernel keeps (2sbh/t) and
      its contiguous [b, s, h] copy that the output projection saves (2sbh/t: the kernels return
      [b, heads, s, d]), logsumexp (fp32, b*a*s/t). The 5as^2b scores/softmax/dropout terms drop
      out: the scores are never stored.
    - sdpa_efficient: as flash, but the output is laid out [b, s, heads, d], so the projection's
      input is a view of it (no copy); the materialised ALiBi + causal bias [a/t, s, s] is kept,
      [b, a/t, s, s] when samples are cut into segments (`workload.segments`).
    - materialized: q, k, v (6sbh/t: Megatron's views of the QKV output, or the copies CPU's
      math kernel makes), the softmax probabilities (2as^2b/t) and the projection input; with
      `workload.dropout` also the attention-dropout mask and output (3as^2b/t). cpu_math: the
      same, but the kernel computes bf16 inputs in fp32, so q, k, v and the probabilities are
      fp32.

    With context parallelism (cp > 1) every backend keeps what flash keeps, for the rank's s/cp
    tokens: the ring attention saves q, k, v, the merged output and logsumexp, and recomputes
    its blocks' scores in backward (`rank_estimate.ring_attention_buffers` counts those blocks).
    """
    b, s, c = workload.micro_batch, workload.seq_len // layout.dims.cp, prec.compute
    tokens = micro_batch_tokens(layout, workload)
    h_local = args.hidden_size // layout.dims.tp
    heads = args.n_head // layout.dims.tp
    qkv = ActivationTerm("q, k, v", 3 * tokens * h_local, c, "K22: QK^T 4sbh + V 2sbh")
    lse = ActivationTerm("softmax logsumexp (fp32)", b * heads * s, FP32, "replaces 2as^2b")
    proj = ActivationTerm("output projection input", tokens * h_local, c, "K22: 2sbh")
    kind = "flash" if layout.dims.cp > 1 else workload.attention
    if kind == "flash":
        kept_output = ActivationTerm(
            "attention output kept by the kernel",
            tokens * h_local,
            c,
            "added: [b, heads, s, d] output, copied to [b, s, h] for the projection",
        )
        return [qkv, kept_output, lse, proj]
    if kind == "sdpa_efficient":
        per_sample = workload.segments  # the segments' mask makes the bias one per sample
        bias = ActivationTerm(
            "ALiBi + causal + segment bias [b, heads, s, s]"
            if per_sample
            else "ALiBi + causal bias [heads, s, s]",
            (b if per_sample else 1) * heads * s * s,
            c,
            "added: SDPA keeps its attn_mask; one per block"
            + (" and sample" if per_sample else ", independent of the batch"),
        )
        return [
            qkv,
            lse,
            dataclasses.replace(proj, source="K22: 2sbh (a view of the output)"),
            bias,
        ]
    if kind in ("materialized", "cpu_math"):
        inner = FP32 if kind == "cpu_math" else c
        probs = ActivationTerm(
            "softmax probabilities", b * heads * s * s, inner, "K22: 2as^2b softmax output"
        )
        terms = [dataclasses.replace(qkv, bytes_per_element=inner), probs, proj]
        if workload.dropout:
            elements = b * heads * s * s
            terms += [
                ActivationTerm("attention-dropout mask", elements, 1, "K22: as^2b"),
                ActivationTerm("attention-dropout output", elements, inner, "K22: 2as^2b"),
            ]
        return terms
    raise PlanError(f"attention memory {kind!r}; valid: {', '.join(ATTENTION_MEMORY)}")


def block_activation_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """Tensors one BLOOM block keeps for backward, per micro batch (t = tp).

    Korthikanti et al. 2022 count 34sbh + 5as^2b bytes (16-bit): attention 11sbh + 5as^2b, MLP
    19sbh, LayerNorms 4sbh; with TP + SP everything is divided by t. Kept here:

    - LayerNorm inputs (2 x 2sbh, /t with SP), in the compute dtype, plus their fp32 mean and
      rstd (2sb each, not in the paper: tiny);
    - QKV and dense_h_to_4h inputs (2 x 2sbh): NOT divided by t under DTensor SP, because the
      column-parallel linear saves its all-gathered input (Megatron re-gathers it in backward);
    - the attention terms of `attention_terms`;
    - GeLU input and dense_4h_to_h input (2 x 8sbh/t).

    Dropped without dropout: the two hidden-dropout masks (2 x sbh) and the attention-dropout
    mask and output (3as^2b); `workload.dropout` adds them back (flash kernels regenerate their
    dropout mask, so with them only the hidden masks return).
    The softmax output (2as^2b) is dropped for flash kernels (see `attention_terms`).
    With adapters (`workload.adapters`) the input of a block linear without one is dropped
    (`frozen_linear_inputs`).

    FP8 linears (`workload.float8`) change no term: torchao's float8 linear (0.18,
    `matmul_with_hp_or_float8_args`) saves its high-precision input and weight, not their FP8
    casts, and casts both again in backward, so it keeps no FP8 tensor and no scale between
    forward and backward; the casts live during the backward (`float8_backward_casts`).
    Compiled, the partitioner may save an FP8 copy and its scales instead of an input: fewer
    bytes, so these terms bound what a compiled block keeps.
    """
    h, c = args.hidden_size, prec.compute
    tokens = micro_batch_tokens(layout, workload)
    stream = residual_stream_elements(args, layout, workload)
    h4_local = 4 * h // layout.dims.tp
    stats = layernorm_stat_elements(layout, workload)
    masks = []
    if workload.dropout:
        masks = [
            ActivationTerm("attention output dropout mask", stream, 1, "K22: sbh"),
            ActivationTerm("MLP output dropout mask", stream, 1, "K22: sbh"),
        ]
    frozen = frozen_linear_inputs(layout, workload)
    terms = masks + [
        ActivationTerm("input_layernorm input", stream, c, "K22: 2sbh LayerNorm input"),
        ActivationTerm("input_layernorm mean, rstd", stats, FP32, "added: fp32 statistics"),
        ActivationTerm("query_key_value input", tokens * h, c, "K22: 2sbh (gathered under SP)"),
        *attention_terms(args, layout, workload, prec),
        ActivationTerm("post_attention_layernorm input", stream, c, "K22: 2sbh"),
        ActivationTerm("post_attention_layernorm mean, rstd", stats, FP32, "added"),
        ActivationTerm("dense_h_to_4h input", tokens * h, c, "K22: 2sbh (gathered under SP)"),
        ActivationTerm("GeLU input", tokens * h4_local, c, "K22: 8sbh"),
        ActivationTerm("dense_4h_to_h input", tokens * h4_local, c, "K22: 8sbh"),
    ]
    return [term for term in terms if term.name not in frozen]


# The term of `block_activation_terms` that is each block linear's saved input.
LINEAR_INPUT_TERMS = {
    "query_key_value": "query_key_value input",
    "dense": "output projection input",
    "dense_h_to_4h": "dense_h_to_4h input",
    "dense_4h_to_h": "dense_4h_to_h input",
}


def block_linear_shapes(args: BloomArgs, layout: Layout) -> dict[str, tuple[int, int]]:
    """(in, out) features of each block linear on a rank: the column-parallel QKV and
    dense_h_to_4h split their outputs over tp, the row-parallel dense and dense_4h_to_h their
    inputs."""
    h, t = args.hidden_size, layout.dims.tp
    return {
        "query_key_value": (h, 3 * h // t),
        "dense": (h // t, h),
        "dense_h_to_4h": (h, 4 * h // t),
        "dense_4h_to_h": (4 * h // t, h),
    }


def float8_linear_casts(tokens: int, features_in: int, features_out: int, recipe: str) -> int:
    """Bytes of the FP8 operands one FP8 linear's backward holds at once (torchao 0.18's
    `matmul_with_hp_or_float8_args.backward`, whose locals keep each cast until it returns),
    over `tokens` rows of `features_in` inputs and `features_out` outputs: the output gradient
    cast twice (scaled along its rows for grad_input, along its columns for grad_weight), the
    weight and the input, one byte per element (e4m3; e5m2 for the tensorwise recipe's
    gradient: 2*T*O + I*O + T*I), each with its fp32 scales: one per tensor with `recipe`
    "tensorwise", one per row or column along the matmul's inner dimension with "rowwise" (T + O
    for the gradient's two casts, I for the weight and I for the input). The matmuls'
    high-precision results are the plain linear's."""
    e4m3 = 2 * tokens * features_out + features_in * features_out + tokens * features_in
    scales = tokens + features_out + 2 * features_in if recipe == "rowwise" else 4
    return e4m3 + FP32 * scales


def float8_backward_casts(args: BloomArgs, layout: Layout, workload: Workload) -> int:
    """`float8_linear_casts` of the block linear where they are largest (every token of the
    micro batch: a column-parallel linear's input is gathered under SP), or 0 without FP8. Not
    counted: an uncompiled cast's fp32 temporaries (a moment each; compiled, Inductor fuses
    them into the cast) and, with `quantize.emulate`, the emulated matmul's fp32 copies of its
    operands."""
    if workload.float8 == "none":
        return 0
    tokens = micro_batch_tokens(layout, workload)
    return max(
        float8_linear_casts(tokens, features_in, features_out, workload.float8)
        for features_in, features_out in block_linear_shapes(args, layout).values()
    )


def frozen_linear_inputs(layout: Layout, workload: Workload) -> set[str]:
    """The linear-input terms that adapters drop: a frozen linear without an adapter computes
    no weight gradient, so autograd keeps its weight (for the input's gradient) but not its
    input; an adapted one keeps it for its A's gradient. Under SDPA's efficient kernel the
    projection's input is a view of the output the kernel keeps anyway."""
    if workload.adapters is None:
        return set()
    targets = workload.adapters.targets
    frozen = {term for linear, term in LINEAR_INPUT_TERMS.items() if linear not in targets}
    kind = "flash" if layout.dims.cp > 1 else workload.attention
    if kind == "sdpa_efficient":
        frozen.discard(LINEAR_INPUT_TERMS["dense"])
    return frozen


def checkpointed_block_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """A recomputed block keeps only its input (K22 section 4: 2sbh/t with SP)."""
    stream = residual_stream_elements(args, layout, workload)
    return [ActivationTerm("block input (checkpoint)", stream, prec.compute, "K22: 2sbh")]


def embedding_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """First stage: the token ids (the embedding's backward), and the embedding LayerNorm's
    input (the embedding output, sequence-sharded with SP) and statistics."""
    tokens = micro_batch_tokens(layout, workload)
    stream = residual_stream_elements(args, layout, workload)
    mask = [ActivationTerm("embedding dropout mask", stream, 1, "sbh")] if workload.dropout else []
    return mask + [
        ActivationTerm("token ids", tokens, INT64, "embedding backward"),
        ActivationTerm("embedding LayerNorm input", stream, prec.compute, "2sbh"),
        ActivationTerm(
            "embedding LayerNorm mean, rstd",
            layernorm_stat_elements(layout, workload),
            FP32,
            "tiny",
        ),
    ]


def head_terms(
    args: BloomArgs, layout: Layout, workload: Workload, prec: Precision
) -> list[ActivationTerm]:
    """Last stage: the final LayerNorm's input and the head's (gathered) input."""
    tokens = micro_batch_tokens(layout, workload)
    stream = residual_stream_elements(args, layout, workload)
    stats = layernorm_stat_elements(layout, workload)
    return [
        ActivationTerm("ln_f input", stream, prec.compute, "2sbh"),
        ActivationTerm("ln_f mean, rstd", stats, FP32, "tiny"),
        ActivationTerm("lm_head input", tokens * args.hidden_size, prec.compute, "2sbh"),
    ]


# The fused loss's automatic chunk (kernels/linear_cross_entropy.py): 256 MiB of logits per chunk,
# a power of two between 16 and 8192 rows.
_FUSED_LOSS_CHUNK_BYTES = 256 * 2**20


def local_vocab(args: BloomArgs, layout: Layout) -> int:
    """Logit columns per rank: sharded over tp with loss parallelism, else all-gathered."""
    tp = layout.dims.tp if layout.parallelism.loss_parallel else 1
    return args.vocab_size // tp


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
        logits = (
            "logits (pipeline stage output)" if layout.dims.pp > 1 else "logits (compiled loss)"
        )
        return [ActivationTerm(logits, tokens * vocab, c, "b*s*V/t"), row_stats]
    terms = [
        ActivationTerm("log-probabilities (fp32)", tokens * vocab, FP32, "fp32 upcast in loss")
    ]
    if layout.dims.pp > 1:
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
        buffers = 3 if layout.dims.tp > 1 and layout.parallelism.loss_parallel else 2
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

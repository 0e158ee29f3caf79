"""Context parallelism for ALiBi attention: the sequence split over the `cp` ranks, with ring
attention at global positions.

Layout (load-balanced causal sharding). A sequence of S tokens is cut into 2 * cp chunks of
C = S / (2 cp); cp rank r holds chunks r and 2 cp - 1 - r, concatenated. Under the causal mask
the early chunks see few keys and the late ones many, so pairing the i-th earliest with the i-th
latest gives every rank the same attention work. Inputs, labels and every per-token tensor of a
rank follow this layout (`shard_sequence`); everything but attention is per token and needs
nothing else.

Ring attention. Each rank keeps its queries; the keys and values travel around the cp group.
At step s rank r holds the K/V chunks of rank r - s and attends its two query chunks to those
key chunks, one (query chunk, key chunk) block at a time: a block whose keys all come after its
queries is skipped, the two diagonal blocks are causal, every other block is unmasked. Each
block is a flash-ALiBi call at the chunks' global positions (`q_offset`, `k_offset`), so the
ALiBi term, the causal mask and the dropout draws are those of the whole sequence. The blocks
of a query chunk are merged by their log-sum-exp (`merge_partial_attention`). The sends for the
next step are posted before the current step's blocks run (async P2P), so on a GPU the transfer
hides behind the compute.

Backward runs the ring again: each block's share of dQ stays, its dK/dV are added to an fp32
accumulator that travels with the K/V chunks and, after the last step, one more hop brings each
rank the dK/dV of its own chunks. Only the local K/V are kept for backward: the memory of one
ring step is two K/V chunk buffers and two dK/dV accumulators, whatever cp is.

The model does not know about any of this: `apply_context_parallel` replaces each attention
module's `attend` function (the backend it was built with) by the ring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from bloomnative.kernels import (
    alibi_attention_block_backward_reference,
    alibi_attention_block_reference,
    flash_alibi_attention_block,
    flash_alibi_attention_block_backward,
)
from bloomnative.model import Bloom, BloomAttention
from bloomnative.model.attention import Segments

# The block functions of each attention backend with a ring form (those model.attention.TRAITS
# marks context_parallel): the Triton kernels, or torch ops with an explicit bias block for the
# portable "sdpa" backend.
BLOCK_FUNCTIONS: dict[str, tuple[Callable, Callable]] = {
    "triton": (flash_alibi_attention_block, flash_alibi_attention_block_backward),
    "sdpa": (alibi_attention_block_reference, alibi_attention_block_backward_reference),
}


def load_balanced_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp) of every sequence that `cp_rank` holds, in order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of `tensor` along the sequence dimension `dim`: chunks
    `load_balanced_chunks(cp_rank, cp)` of 2 * cp equal chunks, concatenated."""
    if cp == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * cp):
        raise ValueError(
            f"context parallelism over {cp} ranks cuts sequences into 2 * cp = {2 * cp} equal "
            f"chunks; a length of {length} does not divide"
        )
    chunks = tensor.chunk(2 * cp, dim=dim)
    first, second = load_balanced_chunks(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def merge_partial_attention(
    out: torch.Tensor, lse2: torch.Tensor, block_out: torch.Tensor, block_lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the same queries over two disjoint key sets, merged into the attention over
    their union: each output weighted by its share of the total softmax mass. `lse2` are the
    log-sum-exps in log2 units ([batch, heads, seq]); outputs [batch, heads, seq, head_dim].
    Returns (out, lse2) in the dtype of `out` / `lse2`."""
    block_lse2 = block_lse2.to(lse2.dtype)
    top = torch.maximum(lse2, block_lse2)
    merged = top + torch.log2(torch.exp2(lse2 - top) + torch.exp2(block_lse2 - top))
    own = torch.exp2(lse2 - merged).unsqueeze(-1)
    other = torch.exp2(block_lse2 - merged).unsqueeze(-1)
    return out * own + block_out.to(out.dtype) * other, merged


@dataclass(frozen=True)
class Ring:
    """The cp process group seen from one rank."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def exchange(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Posts the send of `tensor` to the next rank and the receive of the previous rank's
        into a new buffer; returns the buffer and the requests to wait on."""
        received = torch.empty_like(tensor)
        following, preceding = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=following),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=preceding),
        ]
        return received, dist.batch_isend_irecv(ops)

    def blocks(self, source: int) -> list[tuple[int, int, bool]]:
        """The (query chunk, key chunk, causal) blocks this rank computes against the K/V of rank
        `source`: local chunk indices 0 or 1, blocks wholly in the future skipped."""
        mine = load_balanced_chunks(self.rank, self.size)
        theirs = load_balanced_chunks(source, self.size)
        return [
            (qi, ki, theirs[ki] == mine[qi])
            for qi in range(2)
            for ki in range(2)
            if theirs[ki] <= mine[qi]
        ]

    def chunk_start(self, source: int, chunk: int, chunk_len: int) -> int:
        """The global position of the first token of local chunk `chunk` of rank `source`."""
        return load_balanced_chunks(source, self.size)[chunk] * chunk_len


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    """Causal ALiBi attention of this rank's queries against the whole sequence (module
    docstring). q, k, v: [batch, heads, 2 C, head_dim] in the load-balanced layout."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, ring, backend, dropout_p, rng_seed, seg_start, seg_end):
        block_forward, _ = BLOCK_FUNCTIONS[backend]
        chunk_len = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        q_chunks = q.split(chunk_len, dim=2)
        segments = _SegmentsOnTheRing(seg_start, seg_end, chunk_len)
        acc = torch.promote_types(q.dtype, torch.float32)
        outs: list[torch.Tensor | None] = [None, None]
        lses: list[torch.Tensor | None] = [None, None]
        kv, k_ends = torch.stack((k, v)), seg_end
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            last = step == ring.size - 1
            if not last:
                next_kv, requests = ring.exchange(kv)
                next_ends, end_requests = segments.exchange(ring, k_ends)
            for qi, ki, causal in ring.blocks(source):
                block_k, block_v = kv[:, :, :, ki * chunk_len : (ki + 1) * chunk_len].unbind(0)
                out, lse2 = block_forward(
                    q_chunks[qi], block_k, block_v, slopes, causal=segments.causal(causal),
                    softmax_scale=scale,
                    q_offset=ring.chunk_start(ring.rank, qi, chunk_len),
                    k_offset=ring.chunk_start(source, ki, chunk_len),
                    dropout_p=dropout_p, rng_seed=rng_seed, **segments.block(qi, k_ends, ki),
                )  # fmt: skip
                if outs[qi] is None:
                    outs[qi], lses[qi] = out.to(acc), lse2.to(acc)
                else:
                    outs[qi], lses[qi] = merge_partial_attention(outs[qi], lses[qi], out, lse2)
            if not last:
                _wait(requests + end_requests)
                kv, k_ends = next_kv, next_ends
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse2 = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, slopes, out, lse2, rng_seed, seg_start, seg_end)
        ctx.ring, ctx.backend, ctx.dropout_p = ring, backend, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, slopes, out, lse2, rng_seed, seg_start, seg_end = ctx.saved_tensors
        ring = ctx.ring
        _, block_backward = BLOCK_FUNCTIONS[ctx.backend]
        chunk_len = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)
        split = lambda t: t.split(chunk_len, dim=2)  # noqa: E731
        q_chunks, out_chunks, grad_chunks = split(q), split(out), split(grad_out)
        lse_chunks = [t.contiguous() for t in split(lse2)]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dq_chunks = split(dq)
        segments = _SegmentsOnTheRing(seg_start, seg_end, chunk_len)
        kv, k_ends = torch.stack((k, v)), seg_end
        travelling, dkv_requests = None, []
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            last = step == ring.size - 1
            if not last:
                next_kv, kv_requests = ring.exchange(kv)
                next_ends, end_requests = segments.exchange(ring, k_ends)
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            for qi, ki, causal in ring.blocks(source):
                keys = slice(ki * chunk_len, (ki + 1) * chunk_len)
                block_k, block_v = kv[:, :, :, keys].unbind(0)
                block_dq, block_dk, block_dv = block_backward(
                    grad_chunks[qi], q_chunks[qi], block_k, block_v, out_chunks[qi],
                    lse_chunks[qi], slopes, causal=segments.causal(causal), softmax_scale=scale,
                    q_offset=ring.chunk_start(ring.rank, qi, chunk_len),
                    k_offset=ring.chunk_start(source, ki, chunk_len),
                    dropout_p=ctx.dropout_p, rng_seed=rng_seed, **segments.block(qi, k_ends, ki),
                )  # fmt: skip
                dq_chunks[qi].add_(block_dq)
                dkv[0, :, :, keys].add_(block_dk)
                dkv[1, :, :, keys].add_(block_dv)
            if travelling is not None:  # what the earlier holders of these K/V chunks added
                _wait(dkv_requests)
                dkv.add_(travelling)
            # To the next holder of these chunks; after the last step, to their owner.
            travelling, dkv_requests = ring.exchange(dkv)
            if not last:
                _wait(kv_requests + end_requests)
                kv, k_ends = next_kv, next_ends
        _wait(dkv_requests)
        dk, dv = travelling.unbind(0)
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None,
            None,
        )  # fmt: skip


@dataclass(frozen=True)
class _SegmentsOnTheRing:
    """Packed sequences on the ring: the local queries' segment starts stay, the segment ends of
    the keys travel with the K/V chunks (the kernels skip what no query of a block can see)."""

    start: torch.Tensor | None
    end: torch.Tensor | None
    chunk_len: int

    def exchange(self, ring: Ring, k_ends: torch.Tensor | None) -> tuple[torch.Tensor | None, list]:
        if k_ends is None:
            return None, []
        return ring.exchange(k_ends)

    def causal(self, causal: bool) -> bool:
        """The causal flag of a block: with segments always set, as the kernels take segments
        with causal attention only; for a block of keys wholly before its queries the causal
        mask of global positions hides nothing, so the result is the same."""
        return causal or self.start is not None

    def block(self, qi: int, k_ends: torch.Tensor | None, ki: int) -> dict:
        """The segment arguments of block (query chunk qi, key chunk ki of `k_ends`)."""
        if self.start is None:
            return {}
        chunk = lambda t, i: t[:, i * self.chunk_len : (i + 1) * self.chunk_len].contiguous()  # noqa: E731
        return {"q_segment_start": chunk(self.start, qi), "k_segment_end": chunk(k_ends, ki)}


@torch.compiler.disable  # point-to-point communication: a graph break under regional compile
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    ring: Ring,
    backend: str,
    dropout_p: float = 0.0,
    rng_seed: torch.Tensor | None = None,
    segments: Segments | None = None,
) -> torch.Tensor:
    """Causal ALiBi attention of this cp rank's queries over the whole sequence (module
    docstring). q, k, v: [batch, heads, 2 C, head_dim] in the load-balanced layout; the output
    likewise. `backend`: "triton" or "sdpa" (`BLOCK_FUNCTIONS`). `segments`: the bounds of this
    rank's tokens' segments (positions in the whole sequence), for packed sequences.

    With dropout every block draws the keep-mask of its global positions from one seed
    (kernels.flash_alibi_attention: a pure function of the seed and the positions), so the
    masks are those of one process attending the whole sequence with that seed. `rng_seed`
    None draws it from the default generator of the first rank of the group and broadcasts it.
    """
    if backend not in BLOCK_FUNCTIONS:
        raise ValueError(
            f"context parallelism has no ring for attention backend {backend!r}; valid: "
            f"{', '.join(BLOCK_FUNCTIONS)}"
        )
    if dropout_p == 0:
        rng_seed = None
    elif rng_seed is None:
        rng_seed = torch.randint(0, 2**62, (), device=q.device, dtype=torch.int64)
        dist.broadcast(rng_seed, group=ring.group, group_src=0)
    start, end = segments if segments is not None else (None, None)
    return _RingAttention.apply(q, k, v, slopes, ring, backend, dropout_p, rng_seed, start, end)


def apply_context_parallel(model: Bloom, cp_mesh: DeviceMesh) -> None:
    """Makes every attention module of `model` (a `Bloom` or a pipeline stage of it) attend
    through the ring over the 1-D `cp_mesh`, in place, with the block functions of the attention
    backend it was built with ("triton" or "sdpa"). Inputs and labels must then be in the layout
    of `shard_sequence`, and the loss's token count summed over the cp ranks as over the
    data-parallel ones.

    Where it goes among the plans, and why: docs/architecture.md (the order of the parallel
    plans)."""
    ring = Ring(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
    backend = model.args.attention
    if backend not in BLOCK_FUNCTIONS:
        raise ValueError(
            f"model.attention = {backend!r} has no context-parallel form; use "
            f"{' or '.join(BLOCK_FUNCTIONS)} with parallelism.cp > 1"
        )
    for module in model.modules():
        if isinstance(module, BloomAttention):
            module.attend = _ring_attend(ring, backend)


def _ring_attend(ring: Ring, backend: str) -> Callable[..., torch.Tensor]:
    def attend(q, k, v, slopes, dropout_p=0.0, segments=None):
        return ring_attention(q, k, v, slopes, ring, backend, dropout_p, segments=segments)

    return attend

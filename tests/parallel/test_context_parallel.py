"""Context parallelism's pieces: the load-balanced layout, the LSE merge, and ring attention on
gloo ranks against one process attending the whole sequence in float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bloomnative.kernels import _dispatch, flash_alibi_attention_reference, segment_bounds
from bloomnative.model import alibi_slopes
from bloomnative.model.attention import backends_with
from bloomnative.parallel.context_parallel import (
    BLOCK_FUNCTIONS,
    Ring,
    load_balanced_chunks,
    merge_partial_attention,
    ring_attention,
    shard_sequence,
)
from bloomnative.train.distributed import exit_process

LOG2E = 1.4426950408889634


def test_the_ring_has_block_functions_for_exactly_the_backends_marked_context_parallel():
    assert set(BLOCK_FUNCTIONS) == set(backends_with("context_parallel"))


def test_each_rank_holds_chunk_i_and_its_mirror_and_the_shards_tile_the_sequence():
    cp, seq = 3, 12
    tokens = torch.arange(2 * seq).view(2, seq)
    shards = [shard_sequence(tokens, r, cp) for r in range(cp)]
    assert [load_balanced_chunks(r, cp) for r in range(cp)] == [(0, 5), (1, 4), (2, 3)]
    assert shards[1].tolist() == [[2, 3, 8, 9], [14, 15, 20, 21]]
    assert sorted(torch.cat(shards, dim=1)[0].tolist()) == list(range(seq))
    with pytest.raises(ValueError, match="2 \\* cp = 6 equal chunks; a length of 10"):
        shard_sequence(torch.zeros(1, 10), 0, cp)


def test_ring_blocks_skip_the_future_and_balance_causal_work_over_ranks():
    # Work in units of an unmasked chunk x chunk block; a causal diagonal block is half of one.
    for cp in (2, 3, 4):
        work = []
        for rank in range(cp):
            ring = Ring(group=None, rank=rank, size=cp)
            total = 0.0
            for source in range(cp):
                mine, theirs = load_balanced_chunks(rank, cp), load_balanced_chunks(source, cp)
                for qi, ki, causal in ring.blocks(source):
                    assert theirs[ki] <= mine[qi]
                    assert causal == (theirs[ki] == mine[qi]) and (not causal or source == rank)
                    total += 0.5 if causal else 1.0
            work.append(total)
        # The whole causal square is (2cp)^2 / 2 chunk blocks; each rank does 1/cp of it.
        assert work == [2 * cp] * cp, (cp, work)


def test_lse_merge_of_two_key_sets_is_the_softmax_over_their_union():
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 11, dtype=torch.float64) * 4
    values = torch.randn(2, 3, 11, 7, dtype=torch.float64)

    def part(keys):
        s = scores[..., keys]
        return torch.softmax(s, -1) @ values[:, :, keys], torch.logsumexp(s, -1) * LOG2E

    out, lse2 = merge_partial_attention(*part(slice(0, 4)), *part(slice(4, 11)))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse2, torch.logsumexp(scores, -1) * LOG2E)


def _packed_segments(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment bounds of packed samples whose segments cross the ranks' chunks: one of
    length 1, the others starting and ending inside chunks, and a last sample of one segment."""
    cuts = [(3, 4, 17, 37, 50), (5, 6, 30)]
    positions = torch.arange(seq)
    ids = [(positions[None, :] >= torch.tensor(c)[:, None]).sum(0) for c in cuts[: batch - 1]]
    ids.append(torch.zeros(seq, dtype=torch.int64))
    return segment_bounds(torch.stack(ids))


def _check_ring(
    ring, backend, dtype, tol, dropout_p=0.0, batch=2, heads=3, drawn_by=None, packed=False,
    chunk=8,
):  # fmt: skip
    """Ring attention of this rank's shard vs the float64 reference over the whole sequence:
    output and the gradients of q, k, v (shards of the full gradients). `drawn_by`: the global
    rank of the group's first member, whose generator draws the dropout seed for the whole group
    (every rank's generator is seeded differently); None passes a fixed seed. `packed`: the
    samples are packed segments (`_packed_segments`), each rank given its tokens' bounds.
    `chunk`: tokens per chunk (2 per rank); the Triton kernels' dropout needs a multiple of 16."""
    torch.manual_seed(1)  # the same full tensors on every rank
    seq, head_dim = 2 * chunk * ring.size, 32
    segments = _packed_segments(batch, seq) if packed else None
    q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64)
    slopes = alibi_slopes(heads)
    seed = torch.tensor(1234, dtype=torch.int64)
    if drawn_by is not None:
        seed = torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(500 + drawn_by))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_alibi_attention_reference(
        *leaves, slopes.double(), causal=True, dropout_p=dropout_p, rng_seed=seed,
        segments=segments,
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, leaves, grad)

    shard = lambda t: shard_sequence(t, ring.rank, ring.size, dim=2)  # noqa: E731
    local = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
    if drawn_by is not None:
        torch.manual_seed(500 + dist.get_rank())
    given = None if drawn_by is not None else seed
    local_segments = None
    if packed:
        local_segments = tuple(shard_sequence(t, ring.rank, ring.size, dim=1) for t in segments)
    out = ring_attention(
        *local, slopes, ring, backend, dropout_p, rng_seed=given, segments=local_segments
    )
    grads = torch.autograd.grad(out, local, shard(grad).to(dtype))
    where = f"cp {ring.size} rank {ring.rank} {backend} {dtype} dropout {dropout_p} {packed=}"
    torch.testing.assert_close(out.double(), shard(ref), rtol=tol, atol=tol, msg=where)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(
            got.double(), shard(want), rtol=tol, atol=tol, msg=f"d{name}: {where}"
        )


def _ring_worker(rank, world_size, init_file):
    # A file store: no port to race other processes on the machine for.
    init_method = f"file://{init_file}"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        rings = [
            Ring(dist.group.WORLD, rank, world_size),
            Ring(pairs[rank // 2], rank % 2, 2),
        ]
        for ring in rings:
            _check_ring(ring, "sdpa", torch.float64, 1e-10)
            _check_ring(ring, "sdpa", torch.float64, 1e-10, dropout_p=0.3)
            _check_ring(ring, "sdpa", torch.float64, 1e-10, dropout_p=0.3, packed=True)
        # Without a given seed the group's first rank draws it and the others take it.
        _check_ring(rings[1], "sdpa", torch.float64, 1e-10, dropout_p=0.3, drawn_by=rank // 2 * 2)
        if _dispatch.INTERPRET:  # the Triton kernels at their offsets, through the interpreter
            _check_ring(
                rings[1], "triton", torch.float32, 2e-5, dropout_p=0.3, batch=1, heads=2, chunk=16
            )
            _check_ring(rings[0], "triton", torch.float32, 2e-5, batch=2, heads=2, packed=True)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # a spawned child would otherwise finalize with gloo threads alive


@pytest.mark.multiprocess
def test_ring_attention_on_gloo_ranks_matches_one_process_over_the_whole_sequence(tmp_path):
    """cp 4 over the world and cp 2 over its halves; sdpa blocks in float64 (exact up to
    rounding), with and without dropout (a given seed, and one drawn by the group's first rank
    and broadcast), and on packed samples (segment bounds travelling with K/V); Triton blocks
    through the interpreter in fp32, plain and packed."""
    mp.spawn(_ring_worker, args=(4, str(tmp_path / "store")), nprocs=4, join=True)

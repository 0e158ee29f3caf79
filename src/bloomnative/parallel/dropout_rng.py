"""Which random stream each rank's dropout draws from, under data, tensor and pipeline
parallelism.

Dropout draws from torch's default generators (the CPU one, and the CUDA one of the rank's
device). The rule, as in Megatron:

- a tensor that every tensor-parallel rank holds whole (replicated) must get the same mask on
  each of them, or the replicas drift apart;
- a tensor split over the tensor-parallel ranks (the attention heads; the residual stream under
  sequence parallelism) must get a different mask on each, or the shards repeat one pattern;
- data-parallel ranks and pipeline stages see different data and layers, context-parallel ranks
  different tokens of the same sequences: different streams.

So each rank seeds its default generators from (job seed, pp rank, its rank among the ranks
holding different tokens: dp x cp) and, with sequence parallelism, its tp rank: under SP every
random op in the model runs on a sharded tensor. Context parallelism's ring attention draws one
seed per attention call on the first rank of its cp group and broadcasts it: every block then
draws the keep-mask of its global positions (parallel/context_parallel.py).
Without SP the hidden dropouts run on replicated tensors (a stream shared by the tp ranks), and
only attention runs in a per-tp-rank stream, forked around each attention call.

The fork keeps no state of its own: it reseeds from one draw of the (replicated) CPU stream, so
everything is determined by the default generators, which activation checkpointing replays
(`preserve_rng_state`) and checkpoints save per rank (checkpoint/checkpointer.py `rng_state`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from bloomnative.model import Bloom
from bloomnative.model.attention import AttentionFn


def stream_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (no two coordinates share a stream)."""
    text = "/".join(str(p) for p in parts)
    digest = hashlib.sha256(f"bloomnative-dropout/{text}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_dropout_rng(
    seed: int, mesh: DeviceMesh, dp_cp_mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    """Seeds this rank's default generators for dropout (see the module docstring).
    `dp_cp_mesh`: the data- and context-parallel ranks flattened (`ParallelDims.loss_mesh`; the
    data-parallel rank alone without context parallelism)."""
    tp_rank = mesh["tp"].get_local_rank() if sequence_parallel else 0
    torch.manual_seed(
        stream_seed(seed, mesh["pp"].get_local_rank(), dp_cp_mesh.get_local_rank(), tp_rank)
    )


@contextlib.contextmanager
def tp_rank_stream(tp_rank: int, device: torch.device) -> Iterator[None]:
    """Runs the body with the default generators of `device` (and the CPU) in a stream of their
    own for this tensor-parallel rank, then puts the shared streams back as they were, advanced
    by the one draw that chose the fork's seed."""
    base = int(torch.randint(2**62, (1,)))  # the CPU stream: the same on every tp rank
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        seed = stream_seed(base, tp_rank)
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def attention_in_tp_rank_stream(attend: AttentionFn, tp_rank: int) -> AttentionFn:
    """`attend` with its dropout drawn from this tensor-parallel rank's stream."""

    def attend_in_rank_stream(q, k, v, slopes, dropout_p=0.0, segments=None):
        if not dropout_p:
            return attend(q, k, v, slopes, dropout_p, segments)
        with tp_rank_stream(tp_rank, q.device):
            return attend(q, k, v, slopes, dropout_p, segments)

    return attend_in_rank_stream


def fork_attention_dropout(model: Bloom, tp_rank: int) -> None:
    """Without sequence parallelism: each block's attention draws its dropout from this
    tensor-parallel rank's stream (its heads are its own), the rest from the shared one."""
    if not model.args.attention_dropout:
        return
    for block in model.blocks():
        attention = block.self_attention
        attention.attend = attention_in_tp_rank_stream(attention.attend, tp_rank)

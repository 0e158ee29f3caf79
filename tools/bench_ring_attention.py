#!/usr/bin/env python
"""Time one context-parallel rank's share of ring attention on one device, against the unsplit
flash-ALiBi kernel: what load-balanced causal sharding costs in compute, communication aside.

    python tools/bench_ring_attention.py --out ring.json        # a CUDA GPU, bf16, BLOOM-7b1 heads
    python tools/bench_ring_attention.py --smoke                # tiny shapes on CPU

For each cp, every rank r of cp runs the ring (parallel/context_parallel.py) with its queries and a
loopback in place of the cp group (each "received" K/V block is a copy of the local one, at the
positions of the rank it would come from), so it computes exactly the blocks, offsets, merges and
dK/dV accumulation of a real rank, without the transfers that a real ring overlaps with them. The
row reports the slowest rank's forward + backward time, the spread between ranks (balance), and
the efficiency: (unsplit causal attention time / cp) / slowest rank time. Peak memory is the
allocator's peak above the inputs during a rank's forward + backward.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("bloomnative") is None:  # a source checkout that is not installed
    sys.path.insert(0, str(_REPO / "src"))
import bloomnative  # noqa: E402

if importlib.util.find_spec("bloomnative.kernels") is None:  # kernels/ installs as .kernels
    bloomnative.__path__.append(str(_REPO))

from bloomnative.kernels import flash_alibi_attention  # noqa: E402
from bloomnative.model import alibi_slopes  # noqa: E402
from bloomnative.parallel.context_parallel import Ring, ring_attention  # noqa: E402


class LoopbackRing(Ring):
    """A ring of one device playing rank `rank` of `size`: sends go nowhere, receives are copies
    of what was sent (same shapes and allocations as the real exchange)."""

    def exchange(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        return tensor.clone(), []


def ring_step(qkv, grad, slopes, ring, backend) -> None:
    """One rank's ring attention forward and backward."""
    out = ring_attention(*qkv, slopes, ring, backend)
    torch.autograd.grad(out, qkv, grad)


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_mib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--seq", type=int, default=16384, help="whole sequence length")
    parser.add_argument("--cps", default="1,2,4,8", help="context-parallel degrees")
    parser.add_argument("--heads", type=int, default=32, help="heads on the rank (7b1: 32)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=None, help="timed runs (default 10)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    if args.smoke:
        device, dtype, backend = torch.device("cpu"), torch.float32, "sdpa"
        args.seq, args.heads, args.head_dim, args.cps = 64, 2, 16, "1,2,4"
        warmup, iters = 1, args.iters or 2
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_ring_attention: no CUDA device (use --smoke on CPU)")
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, "triton"
        warmup, iters = 3, args.iters or 10
    slopes = alibi_slopes(args.heads).to(device)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    full = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    grad = torch.randn(shape, device=device, dtype=dtype)

    def unsplit() -> None:
        out = flash_alibi_attention(*full, slopes, causal=True)
        torch.autograd.grad(out, full, grad)

    unsplit_ms = time_ms(unsplit, device, warmup, iters)
    rows = []
    for cp in (int(c) for c in args.cps.split(",")):
        if args.seq % (2 * cp):
            sys.exit(f"--seq {args.seq} is not a multiple of 2 * cp = {2 * cp}")
        local = (args.batch, args.heads, args.seq // cp, args.head_dim)
        qkv = [torch.randn(local, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"]
        local_grad = torch.randn(local, device=device, dtype=dtype)
        rank_ms, peaks = [], []
        for rank in range(cp):
            ring = LoopbackRing(group=None, rank=rank, size=cp)
            step = partial(ring_step, qkv, local_grad, slopes, ring, backend)
            rank_ms.append(time_ms(step, device, warmup, iters))
            peaks.append(peak_mib(step, device))
        slowest = max(rank_ms)
        rows.append(
            {
                "cp": cp,
                "seq": args.seq,
                "chunk": args.seq // (2 * cp),
                "rank_ms_max": slowest,
                "rank_ms_min": min(rank_ms),
                "unsplit_ms": unsplit_ms,
                "efficiency": unsplit_ms / cp / slowest,
                "peak_mib_max": None if peaks[0] is None else max(peaks),
            }
        )
    env = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "backend": backend,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "batch": args.batch,
        "smoke": args.smoke,
    }
    print(f"ring attention per rank, fwd+bwd ({env})")
    print(f"{'cp':>3} {'chunk':>6} {'slowest ms':>11} {'fastest ms':>11} {'unsplit/cp':>11} "
          f"{'efficiency':>10} {'peak MiB':>9}")  # fmt: skip
    for r in rows:
        peak = "" if r["peak_mib_max"] is None else f"{r['peak_mib_max']:.0f}"
        print(
            f"{r['cp']:>3} {r['chunk']:>6} {r['rank_ms_max']:>11.3f} {r['rank_ms_min']:>11.3f} "
            f"{r['unsplit_ms'] / r['cp']:>11.3f} {r['efficiency']:>10.2f} {peak:>9}"
        )
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

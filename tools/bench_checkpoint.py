#!/usr/bin/env python
"""What checkpoint checksums cost: save time with and without them, and verification speed.

  python tools/bench_checkpoint.py --hidden 512 --layers 8 --reps 9 --dir /tmp/bench_ckpt

Builds the state a training checkpoint holds for a BLOOM of that shape (fp32 weights and the
AdamW moments after one step, under the trainer's canonical names) and saves it with DCP into
--dir, in turn with DCP's plain FileSystemWriter and with bloomnative's ChecksummingWriter
summing with XXH3-64 (the default) and with CRC-32 (the fallback without the xxhash package);
one process, no process group. Reports the median and minimum wall time of each and the
overhead, the CPU time of each save (the checksum's cost where no core is idle to hide it), the
time to read a checkpoint back from the disk (page cache dropped) and check it, and each
checksum's speed on one core. --dir should be on the file system checkpoints go to.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.checkpoint import integrity
from bloomnative.model import Bloom, BloomArgs
from bloomnative.model.state import model_state

ALGORITHMS = ["xxh3_64", "crc32"] if integrity.xxhash is not None else ["crc32"]
WRITERS = {"plain": None, **{a: a for a in ALGORITHMS}}


def training_state(args: BloomArgs) -> dict:
    model = Bloom(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab_size, (1, 16))
    model(ids).float().logsumexp(-1).mean().backward()
    optimizer.step()
    return {
        "model": model_state([model]),
        "optimizer": ckpt.optimizer_state([model], [optimizer]),
        "train": {"step": torch.tensor(1), "consumed_samples": torch.tensor(8)},
    }


def timed_save(state: dict, folder: Path, algorithm: str | None) -> tuple[float, float]:
    """Wall and CPU seconds of one save; `algorithm` None: DCP's plain writer."""
    shutil.rmtree(folder, ignore_errors=True)
    if algorithm is not None:
        integrity.ALGORITHM = algorithm
    start, cpu = time.perf_counter(), time.process_time()
    writer = FileSystemWriter(folder) if algorithm is None else integrity.ChecksummingWriter(folder)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return time.perf_counter() - start, time.process_time() - cpu


def one_core_gbps(algorithm: str) -> float:
    data = os.urandom(64 << 20)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        running = integrity._RunningSum(algorithm)
        running.update(data)
        running.value()
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dir", type=Path, default=Path("outputs/bench_checkpoint"))
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    heads = max(1, options.hidden // 64)
    args = BloomArgs(
        n_layer=options.layers, hidden_size=options.hidden, n_head=heads, vocab_size=options.vocab
    )
    state = training_state(args)
    size = ckpt.local_bytes(state)
    folder = options.dir / "step"
    default = integrity.ALGORITHM
    wall: dict[str, list[float]] = {name: [] for name in WRITERS}
    cpu: dict[str, list[float]] = {name: [] for name in WRITERS}
    try:
        timed_save(state, folder, default)  # warm-up: imports, first allocations
        for _ in range(options.reps):
            for name, algorithm in WRITERS.items():
                seconds, cpu_seconds = timed_save(state, folder, algorithm)
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
    finally:
        integrity.ALGORITHM = default
    writer = integrity.ChecksummingWriter(folder)
    shutil.rmtree(folder, ignore_errors=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    integrity.write_record(folder, writer.sums)
    record = integrity.read_record(folder)
    start = time.perf_counter()
    problems = integrity.verify_files(folder, record, record, from_storage=True)
    verify_s = time.perf_counter() - start
    assert not problems, problems
    shutil.rmtree(options.dir, ignore_errors=True)

    result = {
        "state_bytes": size,
        "files": len(record),
        "save_s": {
            name: {
                "median": statistics.median(v),
                "min": min(v),
                "cpu": statistics.median(cpu[name]),
            }
            for name, v in wall.items()
        },
        "read_back_verify_s": verify_s,
        "one_core_gbps": {a: one_core_gbps(a) for a in ALGORITHMS},
        "algorithm": default,
        "torch": torch.__version__,
    }
    params = args.num_params() / 1e6
    print(f"state: {size / 2**20:.0f} MiB in {len(record)} files ({params:.1f}M parameters)")
    plain = result["save_s"]["plain"]
    for name, figures in result["save_s"].items():
        overhead = (
            ""
            if name == "plain"
            else (
                f" ({figures['median'] / plain['median'] - 1:+.1%} median, "
                f"{figures['min'] / plain['min'] - 1:+.1%} min)"
            )
        )
        print(
            f"save {name:8s} median {figures['median']:.3f} s, min {figures['min']:.3f} s, "
            f"CPU {figures['cpu']:.3f} s{overhead}"
        )
    speeds = ", ".join(f"{a} {g:.2f} GB/s" for a, g in result["one_core_gbps"].items())
    print(
        f"read back from disk and verify ({default}): {verify_s:.3f} s "
        f"({size / verify_s / 1e9:.2f} GB/s); one core: {speeds}"
    )
    if options.json:
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

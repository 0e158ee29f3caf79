#!/usr/bin/env python
"""What checkpoint checksums cost: save time with and without them, and verification speed.

  python tools/bench_checkpoint.py --hidden 512 --layers 8 --reps 7 --dir /tmp/bench_ckpt

Builds the state a training checkpoint holds for a BLOOM of that shape (fp32 weights and the
AdamW moments after one step, under the trainer's canonical names) and saves it with DCP into
--dir, alternating DCP's plain FileSystemWriter and bloomnative's ChecksummingWriter (one
process, no process group). Reports the median and minimum wall time of each, the overhead, the
CPU time each save used (the checksum's CPU cost, which a busy machine cannot hide), the time to
read a checkpoint back from the disk (page cache dropped) and check it, and zlib.crc32's speed on
one core. --dir should be on the file system checkpoints go to.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from bloomnative.checkpoint_integrity import (
    ChecksummingWriter,
    read_record,
    verify_files,
    write_record,
)
from bloomnative.model import Bloom, BloomArgs
from bloomnative.train import checkpoint as ckpt


def training_state(args: BloomArgs) -> dict:
    model = Bloom(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab_size, (1, 16))
    model(ids).float().logsumexp(-1).mean().backward()
    optimizer.step()
    return {
        "model": ckpt.model_state([model]),
        "optimizer": ckpt.optimizer_state([model], [optimizer]),
        "train": {"step": torch.tensor(1), "consumed_samples": torch.tensor(8)},
    }


def timed_save(state: dict, folder: Path, writer_class) -> tuple[float, float]:
    """Wall and CPU seconds of one save."""
    shutil.rmtree(folder, ignore_errors=True)
    start, cpu = time.perf_counter(), time.process_time()
    writer = writer_class(folder)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return time.perf_counter() - start, time.process_time() - cpu


def crc32_gbps() -> float:
    data = bytes(128 << 20)  # CRC-32's speed does not depend on the bytes
    start = time.perf_counter()
    zlib.crc32(data)
    return len(data) / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=7)
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
    times: dict[str, list[float]] = {"plain": [], "checksummed": []}
    cpu: dict[str, list[float]] = {"plain": [], "checksummed": []}
    timed_save(state, folder, ChecksummingWriter)  # warm-up: imports, first allocations
    for _ in range(options.reps):
        for name, writer_class in (
            ("plain", FileSystemWriter),
            ("checksummed", ChecksummingWriter),
        ):
            wall, cpu_s = timed_save(state, folder, writer_class)
            times[name].append(wall)
            cpu[name].append(cpu_s)
    writer = ChecksummingWriter(folder)
    shutil.rmtree(folder, ignore_errors=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    write_record(folder, writer.sums)
    record = read_record(folder)
    start = time.perf_counter()
    problems = verify_files(folder, record, record, from_storage=True)
    verify_s = time.perf_counter() - start
    assert not problems, problems
    result = {
        "state_bytes": size,
        "files": len(record),
        "plain_save_s": {"median": statistics.median(times["plain"]), "min": min(times["plain"])},
        "checksummed_save_s": {
            "median": statistics.median(times["checksummed"]),
            "min": min(times["checksummed"]),
        },
        "plain_save_cpu_s": statistics.median(cpu["plain"]),
        "checksummed_save_cpu_s": statistics.median(cpu["checksummed"]),
        "read_back_verify_s": verify_s,
        "crc32_gbps_one_core": crc32_gbps(),
        "torch": torch.__version__,
    }
    plain, summed = result["plain_save_s"], result["checksummed_save_s"]
    params = args.num_params() / 1e6
    print(f"state: {size / 2**20:.0f} MiB in {len(record)} files ({params:.1f}M parameters)")
    for key in ("median", "min"):
        overhead = summed[key] / plain[key] - 1
        print(
            f"save {key}: plain {plain[key]:.3f} s, checksummed {summed[key]:.3f} s "
            f"({overhead:+.1%})"
        )
    print(
        f"save CPU time (median): plain {result['plain_save_cpu_s']:.3f} s, checksummed "
        f"{result['checksummed_save_cpu_s']:.3f} s"
    )
    print(
        f"read back from disk and verify: {verify_s:.3f} s "
        f"({size / verify_s / 1e9:.2f} GB/s); zlib.crc32 on one core: "
        f"{result['crc32_gbps_one_core']:.2f} GB/s"
    )
    if options.json:
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(options.dir, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()

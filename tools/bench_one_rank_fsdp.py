"""FSDP2's own work in a bf16 step on one rank, with the step's micro batches accumulated
locally (`bloomnative.parallel.fsdp.OneRankAccumulation`, what the trainer does) and with FSDP2's
default path (reduce, and with zero_stage 2 re-gather, after every micro batch), in one process
on the same trainer, the two taking turns step by step.

For each: the step's wall time (median of the timed steps), and from one profiled step the time
inside FSDP's ranges (`FSDP::*`: its casts, copies and gradient accumulation) and the bytes its
tensor ops there move, per micro batch: each op that reads or writes data counts its tensor
operands once (a copy its source and destination, an in-place add its two operands, and the
copy that converts a bf16 gradient for an fp32 add); views, allocations and the composite
conversions whose copy is counted move nothing of their own.

The trainer config comes from --config and --section.key=value as for run_train.sh (default:
configs/debug.toml in bf16, 8 micro batches of 2, zero_stage 2).

    python tools/bench_one_rank_fsdp.py --steps 6 --json outputs/bench/one_rank_fsdp.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from cli_args import ArgumentParser, output_file, whole_number
from torch.profiler import ProfilerActivity, profile

from bloomnative.config import parse_args
from bloomnative.train.trainer import Trainer

DEFAULTS = [
    "--config=configs/debug.toml",
    "--training.dtype=bf16",
    "--training.global_batch_size=16",
    "--training.micro_batch_size=2",
    "--parallelism.zero_stage=2",
    "--checkpoint.enable=false",
    "--metrics.tensorboard=false",
    "--validation.freq=0",
]
DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8}
MOVES_NOTHING = {
    f"aten::{name}"
    for name in (
        "alias as_strided detach empty empty_strided expand narrow reshape _reshape_alias "
        "resize_ select set_ slice split_with_sizes squeeze t to _to_copy transpose "
        "unsqueeze view"
    ).split()
}
PATHS = ("accumulated locally", "FSDP2 default")


def fsdp_work(trainer: Trainer) -> dict:
    """One profiled step: the time spent inside FSDP's ranges and the bytes its tensor ops
    there move (module docstring; None where the profiler records no dtypes: torch < 2.13)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.train_step()
    events = prof.events()
    outermost = [
        e for e in events if e.name.startswith("FSDP::") and not _inside_fsdp(e.cpu_parent)
    ]
    moving = [
        e
        for e in events
        if e.name.startswith("aten::")
        and e.name not in MOVES_NOTHING
        and _inside_fsdp(e.cpu_parent)
    ]
    operand_bytes = None
    if all(hasattr(e, "input_dtypes") for e in moving):
        operand_bytes = sum(
            DTYPE_BYTES[dtype] * math.prod(shape)
            for e in moving
            for shape, dtype in zip(e.input_shapes, e.input_dtypes, strict=False)
            if shape and dtype in DTYPE_BYTES
        )
    return {
        "fsdp_ms": sum(e.cpu_time_total for e in outermost) / 1e3,
        "operand_bytes": operand_bytes,
    }


def _inside_fsdp(event) -> bool:
    while event is not None:
        if event.name.startswith("FSDP::"):
            return True
        event = event.cpu_parent
    return False


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="bench_one_rank_fsdp.py",
        description=__doc__.split("\n\n")[0],
        epilog="Any --section.key=value of the trainer config may follow.",
    )
    parser.add_argument("--warmup", type=whole_number(1), default=1, help="untimed steps each")
    parser.add_argument("--steps", type=whole_number(1), default=4, help="timed steps each")
    parser.add_argument("--json", dest="json_path", type=output_file, help="write results here")
    known, rest = parser.parse_known_args(argv)
    total_steps = 2 * (known.warmup + known.steps + 1)
    with tempfile.TemporaryDirectory() as scratch:
        config = parse_args(
            [*DEFAULTS, f"--training.steps={total_steps}", f"--job.dump_folder={scratch}", *rest]
        )
        if config.training.dtype != "bf16" or torch.distributed.is_initialized():
            parser.error("it measures bf16 on one rank: --training.dtype=bf16, no torchrun")
        trainer = Trainer(config)
        local = trainer.one_rank_accumulation

        def step(path: str) -> float:
            trainer.one_rank_accumulation = local if path == PATHS[0] else None
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.train_step()
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        for _ in range(known.warmup):
            for path in PATHS:
                step(path)
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for index in range(known.steps):  # alternating, so drift hits both alike
            for path in PATHS[index % 2 :] + PATHS[: index % 2]:
                times[path].append(step(path))
        micro_batches = config.training.global_batch_size // config.training.micro_batch_size
        results = {}
        for path in PATHS:
            trainer.one_rank_accumulation = local if path == PATHS[0] else None
            work = fsdp_work(trainer)
            moved = work["operand_bytes"]
            results[path] = {
                "step_ms_median": 1e3 * statistics.median(times[path]),
                "step_ms": [round(1e3 * t, 2) for t in times[path]],
                "fsdp_ms_per_micro_batch": work["fsdp_ms"] / micro_batches,
                "fsdp_bytes_per_micro_batch": None if moved is None else moved / micro_batches,
            }
    params = sum(p.numel() for part in trainer.model_parts for p in part.parameters())
    report = {
        "device": str(trainer.device),
        "torch": torch.__version__,
        "parameters": params,
        "micro_batches": micro_batches,
        "zero_stage": config.parallelism.zero_stage,
        "results": results,
    }
    for path, r in results.items():
        moved = r["fsdp_bytes_per_micro_batch"]
        per_param = (
            "bytes not recorded (this torch's profiler has no dtypes)"
            if moved is None
            else f"{moved / params:.1f} bytes per parameter"
        )
        print(
            f"{path:>20}: step {r['step_ms_median']:.1f} ms (median of {known.steps}); per micro "
            f"batch FSDP {r['fsdp_ms_per_micro_batch']:.2f} ms, {per_param}"
        )
    if known.json_path:
        text = json.dumps(report, indent=1)
        if known.json_path == "-":
            print(text)
        else:
            Path(known.json_path).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

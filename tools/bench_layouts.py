"""Peak memory per rank and throughput of one model under several parallel layouts.

Each layout is a separate `torchrun` of the real trainer for a few steps; the figures are the
last logged row of its metrics.jsonl, except the peak memory: the largest `mem_peak_gib` of its
rows (each row's is the peak since the row before, the largest over ranks: peak allocated CUDA
memory on GPU, peak resident memory of the process on CPU).

    python tools/bench_layouts.py --steps 6 --json outputs/bench_layouts.json [--section.key=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single process": (1, []),
    "fsdp 2 (zero3)": (2, ["--parallelism.dp_shard=2", "--parallelism.zero_stage=3"]),
    "fsdp 2 (zero2)": (2, ["--parallelism.dp_shard=2", "--parallelism.zero_stage=2"]),
    "hsdp 2x2": (4, ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"]),
    "tp 2 (sp + loss parallel)": (2, ["--parallelism.tp=2", "--parallelism.dp_shard=1"]),
    "pp 2 (1F1B)": (2, ["--parallelism.pp=2", "--parallelism.dp_shard=1"]),
    "cp 2 (ring attention)": (2, ["--parallelism.cp=2", "--parallelism.dp_shard=1"]),
    "fsdp 2 + full recompute": (
        2,
        ["--parallelism.dp_shard=2", "--activation_checkpoint.mode=full"],
    ),
    "dp 2 x tp 2 x pp 2": (
        8,
        ["--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.dp_shard=2"],
    ),
}


# Every layout above divides this batch (configs/debug.toml's own, 4, does not fit dp 2 x pp 2).
BATCH = ["--training.global_batch_size=16", "--training.micro_batch_size=4"]


def run_layout(nproc: int, overrides: list[str], steps: int, extra: list[str], dump: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "bloomnative.launch.worker", f"--job.dump_folder={dump}", f"--training.steps={steps}",
        "--checkpoint.enable=false", "--validation.freq=0", "--metrics.tensorboard=false",
        f"--metrics.log_freq={steps}", *BATCH, *extra, *overrides,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    figures = {k: last[k] for k in ("loss", "tokens_per_sec", "tflops")}
    return {**figures, "mem_peak_gib": max(row["mem_peak_gib"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args, extra = parser.parse_known_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (nproc, overrides)) in enumerate(LAYOUTS.items()):
            print(f"[{i + 1}/{len(LAYOUTS)}] {name} on {nproc} processes", file=sys.stderr)
            results[name] = {
                "processes": nproc,
                **run_layout(nproc, overrides, args.steps, extra, Path(tmp) / str(i)),
            }
    print(
        "| layout | processes | peak memory per rank (GiB) | tokens/s per rank | "
        f"loss at step {args.steps} |"
    )
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['processes']} | {r['mem_peak_gib']:.3f} | "
            f"{r['tokens_per_sec']:,.0f} | {r['loss']:.4f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Run by torchrun from test_memory_measured.py: one rank's measured and predicted step peak.

    torchrun --nproc-per-node=2 tests/scenarios/memory_scenario.py OUT_DIR --section.key=value ...

Writes OUT_DIR/rank<R>.json with {"measured": bytes, "predicted": bytes, "pp_rank": r}.

    python tests/scenarios/memory_scenario.py OUT_DIR --process-peak --section.key=value ...

One process that runs steps and measures what the process holds instead, without a profiler:
OUT_DIR/rank0.json gets {"process_peak": its peak resident set after the steps (VmHWM, what
/usr/bin/time -v reports), "runtime": its resident set less its live tensors once malloc has
returned its free memory, "allocated": the planner's allocated peak, "predicted": the planner's
bytes on CPU with `Overhead.cpu()` (allocated + the process's runtime + malloc's free memory)}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from bloomnative import planner
from bloomnative.train.distributed import exit_process
from harness.memory_measurement import (
    build_trainer,
    live_tensor_bytes,
    measured_step_peak,
    predict,
    process_peak_rss,
    runtime_rss,
)

PROCESS_STEPS = 4


def main(out_dir: str, overrides: list[str]) -> None:
    process_peak = "--process-peak" in overrides
    overrides = [o for o in overrides if o != "--process-peak"]
    trainer = build_trainer(Path(out_dir) / "dump", *overrides)
    trainer.train_step()  # warm-up: AdamW state and pipeline buffers exist from now on
    estimate = predict(trainer)
    if process_peak:
        for _ in range(PROCESS_STEPS):
            trainer.train_step()
        result = {
            "process_peak": process_peak_rss(),
            "runtime": runtime_rss(live_tensor_bytes(trainer)),
            "allocated": estimate.allocated_peak,
            "predicted": predict(trainer, planner.Overhead.cpu()).device_bytes,
        }
    else:
        result = {
            "measured": measured_step_peak(trainer),
            "predicted": estimate.allocated_peak,
            "pp_rank": estimate.pp_rank,
        }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_process(0)

"""Run by torchrun from test_memory_measured.py: one rank's measured and predicted step peak.

    torchrun --nproc-per-node=2 tests/scenarios/memory_scenario.py OUT_DIR --section.key=value ...

Writes OUT_DIR/rank<R>.json with {"measured": bytes, "predicted": bytes, "pp_rank": r}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from bloomnative.train.distributed import exit_process
from harness.memory_measurement import build_trainer, measured_step_peak, predict


def main(out_dir: str, overrides: list[str]) -> None:
    trainer = build_trainer(Path(out_dir) / "dump", *overrides)
    trainer.train_step()  # warm-up: AdamW state and pipeline buffers exist from now on
    measured = measured_step_peak(trainer)
    estimate = predict(trainer)
    result = {
        "measured": measured,
        "predicted": estimate.allocated_peak,
        "pp_rank": estimate.pp_rank,
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_process(0)

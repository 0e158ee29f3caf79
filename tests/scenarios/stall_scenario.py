"""The real trainer with one rank stalled, as a rank stuck in a kernel, a data read or a
deadlock is: `python tests/scenarios/stall_scenario.py RANK STEP TRAINER_ARGS...` (under torchrun)
trains normally, except that rank RANK stops in the loss of its micro batch 1 of step STEP and
stays there until the launcher ends it, writing nothing. Its peers wait for it in their next
collective until job.collective_timeout_s. Through the trainer's extension point
`Trainer.loss_sum`."""

from __future__ import annotations

import sys
import time
import traceback

import torch

from bloomnative.config import Config, parse_args
from bloomnative.train.distributed import exit_process
from bloomnative.train.faults import catch_stop_signals, received_stop_signal
from bloomnative.train.trainer import Trainer

STALLED_MICRO_BATCH = 1


class StallingTrainer(Trainer):
    def __init__(self, stall_rank: int, stall_step: int, config: Config):
        self.stall_at = (stall_rank, stall_step, STALLED_MICRO_BATCH)
        super().__init__(config)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        progress = self.progress
        if (self.rank, progress.step, progress.micro_batch) == self.stall_at:
            print(f"rank {self.rank} stalls at step {progress.step}", flush=True)
            while received_stop_signal() is None:  # until torchrun ends the job (SIGTERM)
                time.sleep(0.05)
            exit_process(143)  # as if killed by that SIGTERM, with no record written
        return super().loss_sum(output, target)


def main(argv: list[str]) -> int:
    catch_stop_signals()
    trainer = StallingTrainer(int(argv[0]), int(argv[1]), parse_args(argv[2:]))
    try:
        trainer.run()
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))

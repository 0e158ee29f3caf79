"""The real trainer with one rank stalled, as a rank stuck in a kernel, a data read or a
deadlock is: `python tests/scenarios/stall_scenario.py RANK STEP TRAINER_ARGS...` (under torchrun)
trains normally, except that rank RANK stops in the loss of its micro batch 1 of step STEP and
stays there until the launcher ends it, writing nothing. Its peers wait for it in their next
collective until job.collective_timeout_s."""

from __future__ import annotations

import sys
import time
import traceback

from bloomnative.config import parse_args
from bloomnative.train.distributed import exit_process
from bloomnative.train.faults import _Signals, catch_stop_signals
from bloomnative.train.trainer import Trainer

STALLED_MICRO_BATCH = 1


def main(argv: list[str]) -> int:
    catch_stop_signals()
    stall_rank, stall_step = int(argv[0]), int(argv[1])
    trainer = Trainer(parse_args(argv[2:]))
    real_loss_sum = trainer._loss_sum

    def loss_sum(output, labels):
        progress = trainer.progress
        if (trainer.rank, progress.step, progress.micro_batch) == (
            stall_rank,
            stall_step,
            STALLED_MICRO_BATCH,
        ):
            print(f"rank {trainer.rank} stalls at step {stall_step}", flush=True)
            while _Signals.received is None:  # until torchrun ends the job (SIGTERM)
                time.sleep(0.05)
            exit_process(143)  # as if killed by that SIGTERM, with no record written
        return real_loss_sum(output, labels)

    trainer._loss_sum = loss_sum
    try:
        trainer.run()
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))

"""`python slow_save_scenario.py SECONDS TRAINER_ARGS...` (also as torchrun's script): the trainer's
entry point, running a trainer whose every checkpoint save is held SECONDS between writing its
files and being marked complete (`Checkpointer.before_complete`), so that a test's kill can land
inside a save (the window is milliseconds otherwise)."""

from __future__ import annotations

import sys
import time

from bloomnative.config import Config
from bloomnative.launch.worker import main
from bloomnative.train.distributed import exit_process
from bloomnative.train.trainer import Trainer


class SlowSavingTrainer(Trainer):
    hold_s = 0.0

    def __init__(self, config: Config):
        super().__init__(config)
        self.checkpointer.before_complete = lambda step: time.sleep(self.hold_s)


if __name__ == "__main__":
    SlowSavingTrainer.hold_s = float(sys.argv[1])
    exit_process(main(sys.argv[2:], trainer_class=SlowSavingTrainer))

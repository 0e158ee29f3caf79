"""`python slow_save_scenario.py SECONDS TRAINER_ARGS...` (also as torchrun's script): the trainer,
with every checkpoint save held SECONDS between writing its files and being marked complete, so that
a test's kill can land inside a save (the window is milliseconds otherwise)."""

from __future__ import annotations

import sys
import time

from bloomnative.checkpoint.checkpointer import Checkpointer
from bloomnative.launch.worker import main
from bloomnative.train.distributed import exit_process

delay = float(sys.argv[1])
complete = Checkpointer._complete


def slow_complete(self, *args, **kwargs):
    time.sleep(delay)
    return complete(self, *args, **kwargs)


Checkpointer._complete = slow_complete
exit_process(main(sys.argv[2:]))

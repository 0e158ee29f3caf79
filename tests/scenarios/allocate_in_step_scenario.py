"""`python allocate_in_step_scenario.py RANK STEP MIB TRAINER_ARGS...`: the real trainer, where rank
RANK also holds MIB MiB of host memory (written, so it is resident) during optimizer step STEP, then
frees it: one logging interval of one rank needs much more memory than the others."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from bloomnative.config import parse_args
from bloomnative.train.distributed import exit_process
from bloomnative.train.trainer import Trainer

rank, step, mib = (int(v) for v in sys.argv[1:4])
trainer = Trainer(parse_args(sys.argv[4:]))
train_step = trainer.train_step


def train_step_holding_memory():
    if dist.get_rank() != rank or trainer.step + 1 != step:
        return train_step()
    held = torch.ones(mib * 2**20 // 4)  # float32: every page written
    result = train_step()
    del held
    return result


trainer.train_step = train_step_holding_memory
trainer.run()
exit_process(0)

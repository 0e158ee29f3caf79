"""`python allocate_in_step_scenario.py RANK STEP MIB TRAINER_ARGS...`: the real trainer, where rank
RANK also holds MIB MiB of host memory (written, so it is resident) during optimizer step STEP, then
frees it: one logging interval of one rank needs much more memory than the others. Each rank
writes its process's peak resident set at the end (VmHWM, what /usr/bin/time -v reports) to
<dump_folder>/vmhwm-rank<R>.txt, in bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bloomnative.config import parse_args
from bloomnative.train.distributed import exit_process
from bloomnative.train.metrics import process_peak_rss_bytes
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
me = dist.get_rank()
trainer.run()
Path(trainer.dump, f"vmhwm-rank{me}.txt").write_text(str(process_peak_rss_bytes()))
exit_process(0)

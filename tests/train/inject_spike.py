"""`python inject_spike.py SPEC_JSON TRAINER_ARGS...`: the real trainer, with loss spikes caused
by the data, as a bad stretch of the corpus would cause them.

SPEC_JSON: {"bad_from": P, "bad_to": Q, "factor": F, "exit_after_rollback": bool}. A step whose
first sample sits at a position in [P, Q) of the training order reports F x its loss (the
weights are left alone). Skipping that stretch of data therefore ends the spike, whatever the
step number. With "exit_after_rollback" the process dies (exit 3) as soon as the first rollback
has been made, before any later checkpoint: the crash a restart must recover from exactly.

Both through the trainer's extension points (`Trainer.train_step`, `Trainer.roll_back`).
"""

from __future__ import annotations

import json
import sys

from bloomnative.config import parse_args
from bloomnative.train.distributed import exit_process
from bloomnative.train.spikes import Trigger
from bloomnative.train.trainer import Trainer

spec = json.loads(sys.argv[1])


class SpikingTrainer(Trainer):
    def train_step(self):
        loader = self.train_loader
        first = loader.position(loader.consumed_samples)  # of the step about to run
        loss, grad_norm, lr, gbs = super().train_step()
        if spec["bad_from"] <= first < spec["bad_to"]:
            loss = loss * spec["factor"]
        return loss, grad_norm, lr, gbs

    def roll_back(self, trigger: Trigger) -> None:
        super().roll_back(trigger)
        if spec.get("exit_after_rollback"):
            exit_process(3)


SpikingTrainer(parse_args(sys.argv[2:])).run()
exit_process(0)

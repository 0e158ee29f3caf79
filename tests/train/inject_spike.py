"""`python inject_spike.py SPEC_JSON TRAINER_ARGS...`: the real trainer, with loss spikes caused
by the data, as a bad stretch of the corpus would cause them.

SPEC_JSON: {"bad_from": P, "bad_to": Q, "factor": F, "exit_after_rollback": bool}. A step whose
first sample sits at a position in [P, Q) of the training order reports F x its loss (the
weights are left alone). Skipping that stretch of data therefore ends the spike, whatever the
step number. With "exit_after_rollback" the process dies (exit 3) as soon as the first rollback
has been made, before any later checkpoint: the crash a restart must recover from exactly.
"""

from __future__ import annotations

import json
import sys

from bloomnative.config import parse_args
from bloomnative.train.distributed import exit_process
from bloomnative.train.trainer import Trainer

spec = json.loads(sys.argv[1])
trainer = Trainer(parse_args(sys.argv[2:]))
forward_backward = trainer.forward_backward


def spiking_forward_backward(micro_batches):
    loss = forward_backward(micro_batches)
    first = trainer.train_loader.position(trainer.consumed_samples)
    if spec["bad_from"] <= first < spec["bad_to"]:
        loss = loss * spec["factor"]
    return loss


trainer.forward_backward = spiking_forward_backward
if spec.get("exit_after_rollback"):
    roll_back = trainer.spikes._roll_back

    def roll_back_then_die(trigger):
        roll_back(trigger)
        exit_process(3)

    trainer.spikes._roll_back = roll_back_then_die
trainer.run()
exit_process(0)

"""The real trainer, with loss spikes caused by the data, as a bad stretch of the corpus would
cause them: `train_with_spikes(spec, argv)`, a scenario of a shared world
(tests/shared_world.py), or `python inject_spike.py SPEC_JSON TRAINER_ARGS...`.

SPEC_JSON: {"bad_from": P, "bad_to": Q, "factor": F, "exit_after_rollback": bool}. A step whose
first sample sits at a position in [P, Q) of the training order reports F x its loss (the
weights are left alone). Skipping that stretch of data therefore ends the spike, whatever the
step number. With "exit_after_rollback" the process dies (exit 3) as soon as the first rollback
has been made, before any later checkpoint: the crash a restart must recover from exactly (in a
process of its own: it would end a shared world).

Both through the trainer's extension points (`Trainer.train_step`, `Trainer.roll_back`).
"""

from __future__ import annotations

import json
import sys

from bloomnative.config import Config, parse_args
from bloomnative.train.distributed import exit_process
from bloomnative.train.spikes import Trigger
from bloomnative.train.trainer import Trainer


class SpikingTrainer(Trainer):
    def __init__(self, spec: dict, config: Config):
        self.spec = spec
        super().__init__(config)

    def train_step(self):
        loader = self.train_loader
        first = loader.position(loader.consumed_samples)  # of the step about to run
        loss, grad_norm, lr, gbs = super().train_step()
        if self.spec["bad_from"] <= first < self.spec["bad_to"]:
            loss = loss * self.spec["factor"]
        return loss, grad_norm, lr, gbs

    def roll_back(self, trigger: Trigger) -> None:
        super().roll_back(trigger)
        if self.spec.get("exit_after_rollback"):
            exit_process(3)


def train_with_spikes(spec: dict, argv: list[str]) -> None:
    SpikingTrainer(spec, parse_args(argv)).run()


if __name__ == "__main__":
    train_with_spikes(json.loads(sys.argv[1]), sys.argv[2:])
    exit_process(0)

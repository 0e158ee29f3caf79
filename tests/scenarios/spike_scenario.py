"""The real trainer, with loss spikes caused by the data, as a bad stretch of the corpus would
cause them: `train_with_spikes(spec, argv)`, a scenario of a shared world
(tests/harness/shared_world.py), or `python spike_scenario.py SPEC_JSON TRAINER_ARGS...`.

SPEC_JSON: {"bad_from": P, "bad_to": Q, "factor": F, "exit_after_rollback": bool,
"record_rollback_state": bool}. A step whose
first sample sits at a position in [P, Q) of the training order reports F x its loss (the
weights are left alone). Skipping that stretch of data therefore ends the spike, whatever the
step number. With "exit_after_rollback" the process dies (exit 3) as soon as the first rollback
has been made, before any later checkpoint: the crash a restart must recover from exactly (in a
process of its own: it would end a shared world). With "record_rollback_state" the trained
weights and the optimizer state just after the first rollback are saved to ROLLBACK_STATE in the
dump folder, under the names of the checkpoint's entries.

Both through the trainer's extension points (`Trainer.train_step`, `Trainer.roll_back`), run by
`bloomnative.launch.worker.main` (`trainer_class`): the run ends with the exit code and the words
a user's run ends with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from bloomnative.config import Config
from bloomnative.launch.worker import main
from bloomnative.train.distributed import exit_process
from bloomnative.train.spikes import Trigger
from bloomnative.train.trainer import Trainer
from harness.training import TINY_RUN

# Steps 7, 8 and 9 read positions [48, 72) of the training order: their losses are reported 10x.
BAD = {"bad_from": 48, "bad_to": 72, "factor": 10.0}
SPIKES = [
    "--spikes.enable=true",
    "--spikes.window=3",
    "--spikes.consecutive_steps=3",
    "--spikes.skip_steps=1",
    "--spikes.max_rollbacks=1",
]


ROLLBACK_STATE = "rollback_state.pt"
TRAIN_WITH_SPIKES = f"{Path(__file__).resolve()}:train_with_spikes"
"""This scenario as a shared world runs it."""


def spike_argv(dump: Path, corpus: str, *extra: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        "--training.steps=12",
        "--lr_scheduler.decay_steps=12",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        *SPIKES,
        *extra,
    ]


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
        if self.spec.get("record_rollback_state") and len(self.rollback_log.rollbacks) == 1:
            self.record_trained_state(Path(self.config.job.dump_folder) / ROLLBACK_STATE)
        if self.spec.get("exit_after_rollback"):
            exit_process(3)

    def record_trained_state(self, path: Path) -> None:
        """The model and optimizer entries a checkpoint would hold now, whole tensors."""
        components = self._checkpointed()
        state = {name: components[name].state_dict() for name in ("model", "optimizer")}
        flat, _ = flatten_state_dict(state)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tensors.items()}
        torch.save(whole, path)


def train_with_spikes(spec: dict, argv: list[str]) -> int:
    class Spiking(SpikingTrainer):
        def __init__(self, config: Config):
            super().__init__(spec, config)

    return main(argv, trainer_class=Spiking)


if __name__ == "__main__":
    exit_process(train_with_spikes(json.loads(sys.argv[1]), sys.argv[2:]))

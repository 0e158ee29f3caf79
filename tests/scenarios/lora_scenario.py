"""The real trainer of a LoRA run, which also writes out its frozen base as it is after the last
step: `train_keeping_base(argv)`, a scenario of a shared world (tests/harness/shared_world.py),
trains the run `argv` describes and leaves every frozen parameter, whole and under its canonical
name, in <job.dump_folder>/FROZEN_FILE (written by rank 0). The checkpoints do not hold the base,
so this is how a test sees that training left it bit for bit as it was loaded. Through the
trainer's extension point `Trainer.train_step`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from bloomnative.adapters.lora import is_adapter_parameter
from bloomnative.launch import worker
from bloomnative.model.state import model_state
from bloomnative.train.trainer import Trainer

FROZEN_FILE = "frozen_after_training.pt"


class BaseKeepingTrainer(Trainer):
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        last = self.step + 1 == self.config.training.steps
        result = super().train_step()
        if last:
            self.write_frozen(Path(self.config.job.dump_folder) / FROZEN_FILE)
        return result

    def write_frozen(self, path: Path) -> None:
        """Every rank gathers each frozen parameter (a collective under FSDP2); rank 0 saves."""
        frozen = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for name, p in model_state(self.model_parts).items()
            if not is_adapter_parameter(name)
        }
        if self.rank == 0:
            torch.save(frozen, path)


def train_keeping_base(argv: list[str]) -> int:
    return worker.main(argv, trainer_class=BaseKeepingTrainer)

"""The real trainer with NaN gradients at chosen steps: `train_with_nan_gradients(nan_steps,
argv)`, a scenario of a shared world (tests/harness/shared_world.py), or `python nan_scenario.py
NAN_STEPS_JSON TRAINER_ARGS...` (torchrun's script, as run_train.sh's worker). After each
poisoned step it prints "step N skipped, state unchanged: True/False": whether the weights,
AdamW's moments and step counts (this rank's shards) are what they were before it. The trainer
runs through `bloomnative.launch.worker.main` (its extension point `trainer_class`), so the run
ends with the exit code and the words a user's run ends with."""

from __future__ import annotations

import json
import sys

import torch

from bloomnative.launch.worker import main
from bloomnative.train.distributed import exit_process
from bloomnative.train.trainer import Trainer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_with_nan_gradients(nan_steps: list[int], argv: list[str]) -> int:
    class NanTrainer(Trainer):
        def forward_backward(self, micro_batches):
            loss = super().forward_backward(micro_batches)
            if self.step + 1 in nan_steps:
                for p in self.params:
                    p.grad.fill_(float("nan"))
            return loss

        def state_copy(self) -> list[torch.Tensor]:
            tensors = [_local(p).detach().clone() for p in self.params]
            for opt in self.optimizers:
                for state in opt.state.values():
                    tensors += [_local(t).detach().clone() for t in state.values()]
            return tensors

        def train_step(self):
            skipped = self.step + 1 in nan_steps
            before = self.state_copy() if skipped else None
            result = super().train_step()
            if skipped:
                after = self.state_copy()
                same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                print(f"step {self.step} skipped, state unchanged: {same}", flush=True)
            return result

    return main(argv, trainer_class=NanTrainer)


if __name__ == "__main__":
    exit_process(train_with_nan_gradients(json.loads(sys.argv[1]), sys.argv[2:]))

"""The real trainer with NaN gradients at chosen steps: `train_with_nan_gradients(nan_steps,
argv)`, a scenario of a shared world (tests/harness/shared_world.py). After each poisoned step it
prints "step N skipped, state unchanged: True/False": whether the weights, AdamW's moments and step
counts (this rank's shards) are what they were before it."""

from __future__ import annotations

import torch

from bloomnative.config import parse_args
from bloomnative.train.trainer import Trainer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_with_nan_gradients(nan_steps: list[int], argv: list[str]) -> None:
    trainer = Trainer(parse_args(argv))
    real_forward_backward, real_train_step = trainer.forward_backward, trainer.train_step

    def forward_backward(micro_batches):
        loss = real_forward_backward(micro_batches)
        if trainer.step + 1 in nan_steps:
            for p in trainer.params:
                p.grad.fill_(float("nan"))
        return loss

    def optimizer_state() -> list[torch.Tensor]:
        tensors = [_local(p).detach().clone() for p in trainer.params]
        for opt in trainer.optimizers:
            for state in opt.state.values():
                tensors += [_local(t).detach().clone() for t in state.values()]
        return tensors

    def train_step():
        skipped = trainer.step + 1 in nan_steps
        before = optimizer_state() if skipped else None
        result = real_train_step()
        if skipped:
            same = all(torch.equal(a, b) for a, b in zip(before, optimizer_state(), strict=True))
            print(f"step {trainer.step} skipped, state unchanged: {same}", flush=True)
        return result

    trainer.forward_backward = forward_backward
    trainer.train_step = train_step
    trainer.run()

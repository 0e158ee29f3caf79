"""One AdamW step from a Megatron-DeepSpeed import under a parallel layout, as a scenario of
test_layouts.py's shared world: the trainer resumes the import (its dump folder) under the
layout, every parameter gets `step_gradient` of its canonical name (the last pipeline stage's
head copy the embedding's, as the tied gradients' all-reduce leaves it), the trainer's
optimizers step once at `STEP_LR`, and the gathered parameters are saved as train_layout saves
them."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from bloomnative.config import parse_args
from bloomnative.model.state import EMBEDDING, TIED_HEAD, owns_head_copy
from bloomnative.train.trainer import Trainer
from harness.mds_layout import STEP_LR, step_gradient
from scenarios.layout_scenario import save_params


def step_import(argv: list[str]) -> None:
    trainer = Trainer(parse_args(argv))
    out = Path(trainer.config.job.dump_folder)
    for part in trainer.trained_parts:
        head_copy = owns_head_copy(part)
        for name, p in part.named_parameters():
            grad = step_gradient(EMBEDDING if head_copy and name == TIED_HEAD else name, p.shape)
            p.grad = (
                distribute_tensor(grad, p.device_mesh, p.placements)
                if isinstance(p, DTensor)
                else grad
            )
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = STEP_LR
        optimizer.step()
    save_params(trainer, out)
    if dist.get_rank() == 0:
        (out / "resumed.json").write_text(json.dumps({"step": trainer.step}))
    del trainer
    dist.barrier()

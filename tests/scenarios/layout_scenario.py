"""One parallel layout of a small training job, as a scenario of a shared world
(tests/harness/shared_world.py): test_layouts.py runs every layout of a world size in one torchrun
world. Saves, per layout, metrics.jsonl, the final (gathered) parameters and, under pipeline
parallelism, what the pipeline stages hold.

A layout named `*-resumed` trains to its `checkpoint.interval` and stops, then a second trainer
resumes from that checkpoint (which must verify) to the end; resumed.json records where it
resumed and which checkpoints it verified. `resume_layout` trains a layout from a copy of
another run's checkpoint (saved under another layout earlier in the same world);
`loaded_state` saves what a layout resumed from a checkpoint holds before its first step.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase, _RecvInfo
from torch.distributed.tensor import DTensor

from bloomnative.checkpoint.checkpointer import optimizer_state
from bloomnative.config import parse_args
from bloomnative.model.state import model_state
from bloomnative.train.trainer import Trainer

RESUMED = "-resumed"


def gathered_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parts as whole tensors under canonical names (collective over each mesh)."""
    state = model_state(trainer.model_parts)
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
        for name, t in state.items()
    }


def writes_for_its_stage(trainer: Trainer) -> bool:
    """Whether this rank is its pipeline stage's first in every other dimension."""
    mesh = trainer.mesh
    return trainer.dp_mesh.get_local_rank() == 0 and all(
        mesh[dim].get_local_rank() == 0 for dim in ("cp", "tp")
    )


def save_params(trainer: Trainer, out: Path) -> None:
    """The gathered parameters (collective), saved once per pipeline stage: by the rank of the
    stage that is first in every other dimension, as `out`/params_pp<stage>.pt."""
    params = gathered_params(trainer)
    if writes_for_its_stage(trainer):
        torch.save(params, out / f"params_pp{trainer.pp_rank}.pt")


def live_stage_buffers() -> dict:
    """Every pipeline stage object still alive in this process and the receive buffers it
    holds (activations and gradients, per micro batch): count, bytes and dtypes."""
    gc.collect()
    stages = [o for o in gc.get_objects() if isinstance(o, _PipelineStageBase)]
    buffers = {}
    for stage in stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            for info in infos:
                # Model inputs have no buffer: torch 2.11 holds a _RootArgPlaceholder for them,
                # 2.13 a _RecvInfo whose buffer is None.
                if isinstance(info, _RecvInfo) and info.buffer is not None:
                    buffers[info.buffer.untyped_storage().data_ptr()] = info.buffer
    return {
        "stages": len(stages),
        "buffers": len(buffers),
        "bytes": sum(b.untyped_storage().nbytes() for b in buffers.values()),
        "dtypes": sorted({str(b.dtype) for b in buffers.values()}),
    }


def train_layout(argv: list[str]) -> None:
    """Trains the layout `argv` describes (its dump folder included) and saves what the tests
    compare; the process group stays for the next layout."""
    config = parse_args(argv)
    out = Path(config.job.dump_folder)
    if out.name.endswith(RESUMED):
        first = Trainer(parse_args([*argv, f"--training.steps={config.checkpoint.interval}"]))
        first.train()
        del first
    trainer = Trainer(config)
    if out.name.endswith(RESUMED):
        resumed = {"step": trainer.step, "verified": sorted(trainer.checkpointer.verified)}
        (out / f"resumed_rank{dist.get_rank()}.json").write_text(json.dumps(resumed))
    trainer.train()
    save_params(trainer, out)
    if config.parallelism.pp > 1:  # the scan of every object costs a third of a layout's CPU
        stages = live_stage_buffers()
        (out / f"stages_rank{dist.get_rank()}.json").write_text(json.dumps(stages))
    del trainer
    dist.barrier()


def resume_layout(checkpoint: str, argv: list[str]) -> None:
    """`train_layout(argv)` from a copy of `checkpoint` (another run's checkpoints/step-<N>),
    which rank 0 puts into the run's dump folder first."""
    source = Path(checkpoint)
    config = parse_args(argv)
    target = Path(config.job.dump_folder) / config.checkpoint.folder / source.name
    if dist.get_rank() == 0:
        shutil.copytree(source, target)
    dist.barrier()
    train_layout(argv)


def loaded_state(argv: list[str]) -> None:
    """The trainer of `argv` resumed from the checkpoint in its dump folder, before any step:
    its model and optimizer tensors, whole and under the checkpoint's keys (`model.<name>`,
    `optimizer.state.<name>.<moment>`), saved once per pipeline stage as
    <dump folder>/loaded_pp<stage>.pt."""
    trainer = Trainer(parse_args(argv))
    state = {f"model.{k}": v for k, v in model_state(trainer.model_parts).items()}
    optimizer = optimizer_state(trainer.trained_parts, trainer.optimizers)
    state |= {f"optimizer.{k}": v for k, v in optimizer.items() if isinstance(v, torch.Tensor)}
    whole = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in state.items()
    }
    if writes_for_its_stage(trainer):
        torch.save(whole, Path(trainer.config.job.dump_folder) / f"loaded_pp{trainer.pp_rank}.pt")
    del trainer
    dist.barrier()

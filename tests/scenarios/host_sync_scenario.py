"""Runs the real trainer and records every operation that makes the host wait for the device
(a readback such as `.item()` or `bool(t)`, or an op whose output shape depends on the data),
with the step it happened in, whether a log step was reading its metrics at the time, and the
line in bloomnative that asked for it. `record_syncs(argv)`, a scenario of a shared world
(tests/harness/shared_world.py), prints the records on rank 0 as one line: `SYNCS:` and a JSON list.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bloomnative.config import parse_args
from bloomnative.train.trainer import Trainer

ATEN = torch.ops.aten
# Every op here blocks the host until the device has caught up, on CUDA.
SYNCING_OPS = {
    ATEN._local_scalar_dense.default,  # .item(), float(t), bool(t), `if t:`
    ATEN.is_nonzero.default,
    ATEN.equal.default,
    ATEN.nonzero.default,  # data-dependent output shapes
    ATEN.masked_select.default,
    ATEN._unique2.default,
    ATEN.unique_consecutive.default,
    ATEN.repeat_interleave.Tensor,
}
SOURCE = Path(__file__).resolve().parents[2] / "src" / "bloomnative"


def asking_line() -> str:
    """The innermost bloomnative source line on the stack: the code that asked for the sync."""
    for frame in reversed(traceback.extract_stack()):
        if Path(frame.filename).resolve().is_relative_to(SOURCE):
            where = Path(frame.filename).resolve().relative_to(SOURCE)
            return f"{where}:{frame.name}"
    return "outside bloomnative"


class SyncRecorder(TorchDispatchMode):
    def __init__(self, trainer: Trainer):
        super().__init__()
        self.trainer = trainer
        self.reading_metrics = False
        self.records: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS:
            self.records.append(
                {
                    "op": str(func),
                    "step": self.trainer.step,
                    "reading_metrics": self.reading_metrics,
                    "where": asking_line(),
                }
            )
        return func(*args, **(kwargs or {}))


def record_syncs(argv: list[str]) -> None:
    trainer = Trainer(parse_args(argv))
    recorder = SyncRecorder(trainer)

    def while_reading_metrics(method):
        def wrapped(*args, **kwargs):
            outer = recorder.reading_metrics  # these calls nest: a checkpoint checks the guard
            recorder.reading_metrics = True
            try:
                return method(*args, **kwargs)
            finally:
                recorder.reading_metrics = outer

        return wrapped

    # What the loop runs at log steps only: metrics are read back there, by design.
    trainer.log_step = while_reading_metrics(trainer.log_step)
    trainer.nonfinite.check = while_reading_metrics(trainer.nonfinite.check)
    if trainer.spike_detector is not None:  # read at log steps and checkpoints only
        detector = trainer.spike_detector
        detector.fired = while_reading_metrics(detector.fired)
    # A checkpoint copies the state to the host by nature (only at checkpoint steps).
    trainer.save_checkpoint = while_reading_metrics(trainer.save_checkpoint)
    with recorder:
        trainer.run()
    if trainer.rank == 0:
        print("SYNCS:" + json.dumps(recorder.records), flush=True)

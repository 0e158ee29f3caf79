"""Stopping cleanly: scheduler pre-emption signals and BLOOM's kill-switch file.

SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before pre-empting a job) and a file named STOP
in the dump folder all ask the run to save a checkpoint at the next step boundary and exit 0.
Ranks agree on stopping through one small all-reduce per step, so they stop at the same step;
it runs on the CPU over gloo, so it never makes the host wait for the GPU.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Catches the stop signals (from installation on) and checks for the STOP file."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        # Collective when distributed: every rank constructs its StopRequest at the same point.
        self._group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")
        self.reason: str | None = None
        self._signalled: str | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum: int, frame) -> None:
        self._signalled = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank got a signal or sees the STOP file."""
        local = self._signalled or (f"{self.stop_file} exists" if self.stop_file.exists() else None)
        flag = torch.tensor(1.0 if local else 0.0)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() > 0:
            self.reason = local or "another rank was asked to stop"
            return True
        return False

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

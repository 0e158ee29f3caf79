"""Stopping cleanly: scheduler pre-emption signals, Ctrl-C and BLOOM's kill-switch file.

SIGTERM, SIGINT and SIGUSR1 (what Kubernetes, SLURM and a terminal send) and a file named STOP in
the dump folder all ask the run to save a checkpoint at the next step boundary and exit 0.
Ranks agree on stopping through one small all-reduce per step, so they stop at the same step;
it runs on the CPU over gloo, so it never makes the host wait for the GPU. Repeated requests
change nothing, except a SIGINT after the first request (Ctrl-C twice): it aborts at once
(KeyboardInterrupt). That cannot corrupt a checkpoint: one is marked complete only once all of
it is written.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class _Signals:
    """The stop signal received first in this process (caught from `catch_stop_signals` on)."""

    received: str | None = None

    @classmethod
    def on_signal(cls, signum: int, frame) -> None:
        if signum == signal.SIGINT and cls.received is not None:
            raise KeyboardInterrupt  # Ctrl-C after a stop request: do not wait for the save
        cls.received = cls.received or signal.Signals(signum).name


def catch_stop_signals() -> dict[int, Any]:
    """Turns the stop signals into a stop request from now on (main() calls this first, so a
    signal that arrives while the model is being built still leads to a clean stop). Returns
    the handlers it replaced."""
    return {sig: signal.signal(sig, _Signals.on_signal) for sig in STOP_SIGNALS}


def received_stop_signal() -> str | None:
    """The name of the stop signal this process received first, since `catch_stop_signals`, or
    None."""
    return _Signals.received


class StopRequest:
    """Catches the stop signals (from installation on) and checks for the STOP file."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        # Collective when distributed: every rank constructs its StopRequest at the same point.
        self._group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")
        self.reason: str | None = None
        self._previous = catch_stop_signals()

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank got a signal or sees the STOP file."""
        local = received_stop_signal() or (
            f"{self.stop_file} exists" if self.stop_file.exists() else None
        )
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

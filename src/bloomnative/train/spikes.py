"""Loss-spike recovery: what PaLM's authors did by hand, automated.

`SpikeDetector` watches every step on the device (no host sync): a step is a spike step when its
loss exceeds `loss_factor` x the mean loss of the last `window` healthy steps, when its gradient
norm exceeds `grad_norm_factor` x their median gradient norm, or when either is not finite. After
`consecutive_steps` spike steps in a row the detector fires. The trainer reads it at log steps
and before checkpoints and rolls back (`Trainer.roll_back`): it restores the newest verified
checkpoint from before the first spike step, skips the data trained on since that checkpoint
plus `skip_steps` more batches, and training continues. `RollbackLog` records each rollback in
<checkpoint folder>/rollbacks.json as soon as it is made, so a restart before the next
checkpoint skips the same data.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bloomnative.checkpoint.integrity import write_json_durably
from bloomnative.config import CheckpointConfig, SpikesConfig


class SpikeError(RuntimeError):
    """A spike that cannot be rolled back: no checkpoint to go to, or spikes.max_rollbacks
    rollbacks made already."""


@dataclass(frozen=True)
class Trigger:
    """What fired the detector."""

    step: int  # the step that completed the run of spike steps
    first_step: int  # the first spike step of that run
    loss: float
    mean_loss: float
    grad_norm: float
    median_grad_norm: float

    def describe(self, cfg: SpikesConfig) -> str:
        if not (math.isfinite(self.loss) and math.isfinite(self.grad_norm)):
            what = f"loss {self.loss:.4g}, gradient norm {self.grad_norm:.4g}"
        elif cfg.loss_factor and self.loss > cfg.loss_factor * self.mean_loss:
            what = f"loss {self.loss:.4g} > {cfg.loss_factor:g} x running mean {self.mean_loss:.4g}"
        else:
            what = (
                f"gradient norm {self.grad_norm:.4g} > {cfg.grad_norm_factor:g} x running "
                f"median {self.median_grad_norm:.4g}"
            )
        return f"{what}; {self.step - self.first_step + 1} spike steps from step {self.first_step}"


@dataclass(frozen=True)
class Rollback:
    """One rollback, as rollbacks.json and metrics.jsonl record it."""

    step: int  # the step at which the spike was detected
    spike_step: int  # the first spike step
    restored_step: int  # the checkpoint it went back to
    trigger: str
    skipped: tuple[int, int]  # positions [start, end) of the global sample order never trained on


class SpikeDetector:
    """Running loss mean and gradient-norm median over the last `window` healthy steps, and the
    run of spike steps, all kept on the device."""

    _STATE = ("loss_history", "grad_norm_history", "healthy_steps", "run", "run_start")

    def __init__(self, cfg: SpikesConfig, device: torch.device):
        self.cfg = cfg
        nan = torch.full((cfg.window,), float("nan"), device=device)
        self.loss_history = nan.clone()
        self.grad_norm_history = nan.clone()
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.healthy_steps = zero.clone()
        self.run = zero.clone()  # spike steps in a row, ending at the last step seen
        self.run_start = zero.clone()  # the first step of that run
        self._fired = torch.full((6,), -1.0, dtype=torch.float64, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Takes step `step`'s global loss and gradient norm (0-d device tensors)."""
        cfg = self.cfg
        loss, grad_norm = loss.float(), grad_norm.float()
        mean = torch.nanmean(self.loss_history)
        median = torch.nanmedian(self.grad_norm_history)
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        high = ~finite
        if cfg.loss_factor:
            high = high | (loss > cfg.loss_factor * mean)
        if cfg.grad_norm_factor:
            high = high | (grad_norm > cfg.grad_norm_factor * median)
        spike = high & (self.healthy_steps >= cfg.window)
        self.run = (self.run + 1) * spike
        self.run_start = torch.where(self.run == 1, step, self.run_start)
        fires = (self.run >= cfg.consecutive_steps) & (self._fired[0] < 0)
        values = torch.stack([loss, mean, grad_norm, median]).double()
        now = torch.cat(
            [torch.stack([torch.full_like(self.run, step), self.run_start]).double(), values]
        )
        self._fired = torch.where(fires, now, self._fired)
        healthy = finite & ~spike
        slot = (self.healthy_steps % cfg.window).view(1)
        for history, value in ((self.loss_history, loss), (self.grad_norm_history, grad_norm)):
            history.scatter_(0, slot, torch.where(healthy, value, history[slot]))
        self.healthy_steps += healthy

    def fired(self) -> Trigger | None:
        """Collective (reads the device): what fired the detector, as rank 0 saw it, or None."""
        fired = self._fired.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(fired, src=0)
        step, first, *values = fired.tolist()
        if step < 0:
            return None
        return Trigger(int(step), int(first), *values)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._STATE}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continues from a checkpoint's detector state. A state without every entry in this
        detector's shapes (a checkpoint saved without spike detection, or with another
        `window`) starts afresh. Either way nothing has fired."""
        mine = self.state_dict()
        if all(name in state and state[name].shape == t.shape for name, t in mine.items()):
            for name in self._STATE:
                getattr(self, name).copy_(state[name])
        else:
            self.loss_history.fill_(float("nan"))
            self.grad_norm_history.fill_(float("nan"))
            for name in ("healthy_steps", "run", "run_start"):
                getattr(self, name).zero_()
        self._fired.fill_(-1.0)


class RollbackLog:
    """The rollbacks of a run, kept in `path` (rollbacks.json beside the checkpoints)."""

    def __init__(self, path: Path, writer: bool):
        self.path = path
        self.writer = writer
        self.rollbacks: list[Rollback] = []
        if path.exists():
            try:
                entries = json.loads(path.read_text())["rollbacks"]
                self.rollbacks = [
                    Rollback(**{**e, "skipped": tuple(e["skipped"])}) for e in entries
                ]
            except (ValueError, KeyError, TypeError) as e:
                raise SpikeError(
                    f"{path} is unreadable ({type(e).__name__}: {e}); it lists the data windows "
                    "earlier rollbacks skipped: restore it, or delete it to train on them"
                ) from None

    def windows(self) -> list[tuple[int, int]]:
        return [r.skipped for r in self.rollbacks]

    def add(self, rollback: Rollback) -> None:
        """Records a rollback durably (`write_json_durably`) before training goes on."""
        self.rollbacks.append(rollback)
        if self.writer:
            write_json_durably(self.path, {"rollbacks": [asdict(r) for r in self.rollbacks]})


def recovers_spikes(cfg: SpikesConfig, checkpoint: CheckpointConfig) -> bool:
    """Spike recovery is on: asked for, and there are checkpoints to roll back to."""
    return cfg.enable and checkpoint.enable


def data_reserve(cfg: SpikesConfig, checkpoint: CheckpointConfig, log_freq: int) -> int:
    """Global batches beyond training.steps that the training data must cover for the windows
    skipped by `max_rollbacks` rollbacks. A rollback is detected at most `log_freq` steps after
    the spike completes, and the checkpoint it restores is normally at most `interval` steps
    before the spike: each window covers at most the sum of those and `skip_steps`."""
    if not recovers_spikes(cfg, checkpoint):
        return 0
    per_rollback = checkpoint.interval + cfg.consecutive_steps + log_freq + cfg.skip_steps
    return cfg.max_rollbacks * per_rollback

"""Loss-spike recovery: what PaLM's authors did by hand, automated.

`SpikeDetector` watches every step on the device (no host sync): a step is a spike step when its
loss exceeds `loss_factor` x the mean loss of the last `window` healthy steps, when its gradient
norm exceeds `grad_norm_factor` x their median gradient norm, or when either is not finite. After
`consecutive_steps` spike steps in a row the detector fires. `SpikeRecovery` reads it at log
steps and before checkpoints, restores the trainer to the newest verified checkpoint from before
the first spike step, skips the data trained on since that checkpoint plus `skip_steps` more
batches, and training continues. `RollbackLog` records each rollback in <checkpoint
folder>/rollbacks.json as soon as it is made, so a restart before the next checkpoint skips the
same data.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from bloomnative.checkpoint.integrity import write_json_durably
from bloomnative.config import CheckpointConfig, SpikesConfig

if TYPE_CHECKING:
    from bloomnative.train.trainer import Trainer


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

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Continues from a checkpoint's detector state; None (a checkpoint saved without
        spike detection) starts afresh. Either way nothing has fired."""
        if state is None:
            self.loss_history.fill_(float("nan"))
            self.grad_norm_history.fill_(float("nan"))
            for name in ("healthy_steps", "run", "run_start"):
                getattr(self, name).zero_()
        else:
            for name in self._STATE:
                getattr(self, name).copy_(state[name])
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


class SpikeRecovery:
    """The trainer's loss-spike recovery: its detector (None while it is off), its rollback log
    (kept whether it is on or not: earlier rollbacks' windows apply to every resume) and the
    rollback itself."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        config = trainer.config
        self.cfg = config.spikes
        self.log = RollbackLog(trainer.ckpt_folder / "rollbacks.json", trainer.rank == 0)
        self.detector = None
        if recovers_spikes(config.spikes, config.checkpoint):
            self.detector = SpikeDetector(config.spikes, trainer.device)
        elif config.spikes.enable and trainer.rank == 0:
            print("[bloomnative] spikes.enable is ignored: checkpoint.enable = false", flush=True)

    def state_dict(self) -> dict:
        """The detector's part of a checkpoint."""
        return {"spikes": self.detector.state_dict()} if self.detector else {}

    def load_state_dict(self, state: dict) -> None:
        """From a checkpoint's state as loaded (its "spikes" entry is absent when the checkpoint
        has none of the detector's shape)."""
        if self.detector:
            self.detector.load_state_dict(state.get("spikes"))

    def rolled_back(self, loss: torch.Tensor, grad_norm: torch.Tensor, read_now: bool) -> bool:
        """Feeds the step's global loss and gradient norm to the detector; when `read_now` (log
        and checkpoint steps, where the host reads the device anyway) rolls back if it fired."""
        self.detector.observe(self.trainer.step, loss, grad_norm)
        if not read_now:
            return False
        trigger = self.detector.fired()
        if trigger is None:
            return False
        self._roll_back(trigger)
        return True

    def _roll_back(self, trigger: Trigger) -> None:
        """Restores the newest verified checkpoint from before the spike and skips the data
        trained on since it, plus skip_steps batches; records the rollback."""
        t, cfg = self.trainer, self.cfg
        what = f"loss spike detected at step {t.step} ({trigger.describe(cfg)})"
        done = self.log.rollbacks
        if len(done) >= cfg.max_rollbacks:
            raise SpikeError(
                f"{what}, but spikes.max_rollbacks = {cfg.max_rollbacks} rollbacks have been "
                f"made already (at steps {[r.step for r in done]}); giving up: lower the "
                "learning rate, inspect the data, or raise spikes.max_rollbacks"
            )
        t.checkpointer.wait()
        restored = t.checkpointer.newest_verified(before=trigger.first_step)
        if restored is None:
            raise SpikeError(
                f"{what}, but no checkpoint from before step {trigger.first_step} verifies in "
                f"{t.ckpt_folder}, so there is nothing to roll back to"
            )
        t.checkpointer.set_aside_after(restored, "rolled-back")
        detected_step = t.step
        spike_end = t.train_loader.position(t.consumed_samples)
        skip = cfg.skip_steps * t.global_batch_size()
        t.load_training_state(t.checkpointer.path(restored))
        window = (t.train_loader.position(t.consumed_samples), spike_end + skip)
        t.train_loader.skip(*window)
        self._check_data_left(what)
        rollback = Rollback(detected_step, trigger.first_step, restored, what, window)
        self.log.add(rollback)
        t.metrics.log(
            {
                "step": detected_step,
                "rollback": len(self.log.rollbacks),
                "rollback_to_step": restored,
                "rollback_trigger": what,
                "skipped_samples": list(window),
                "skipped_sample_count": window[1] - window[0],
            }
        )
        if t.rank == 0:
            print(
                f"[bloomnative] {what}: rolled back to step {restored}, skipping samples "
                f"[{window[0]}, {window[1]}) of the training order",
                flush=True,
            )

    def _check_data_left(self, what: str) -> None:
        """After a skip: the training split must still hold the data of every remaining step."""
        t = self.trainer
        steps, gbs = t.config.training.steps, t.config.training.global_batch_size
        last = t.train_loader.position(t.consumed_samples + (steps - t.step) * gbs - 1)
        if last >= len(t.train_loader.dataset):
            raise SpikeError(
                f"{what}: after skipping {t.train_loader.skipped} the remaining "
                f"{steps - t.step} steps need the training order up to position {last}, but it "
                f"has {len(t.train_loader.dataset)} samples; lower spikes.skip_steps or restart "
                "(the index is sized for spikes.max_rollbacks windows)"
            )


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

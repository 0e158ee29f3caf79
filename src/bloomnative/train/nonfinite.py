"""Skipping the optimizer step when the loss or the gradient norm is not finite, without making
the host wait for the device on every step; and keeping such a state out of checkpoints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from bloomnative.train.optimizer import reads_tensor_lr

# Elements of one tensor tested at a time: bounds the boolean temporary of a checkpoint's check.
_CHUNK = 1 << 26


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    """Steps the optimizers unless this step's loss or gradient norm is NaN or infinite, and
    counts the skipped steps.

    With fused AdamW (the default on CUDA) the decision stays on the device: the kernel reads a
    `found_inf` flag and leaves weights, moments and step counts untouched when it is set, so the
    step loop never waits for the GPU. The foreach and for-loop kernels have no such flag; there
    the flag is read on the host (free on CPU, one synchronisation per step on a GPU).

    The learning rate arrives as a device tensor as well (train/lr_schedule.py computes it on
    the device from the samples of applied steps): the fused kernel reads it there; the host
    path reads it together with the flag. The counters live on the device too and are read only
    by `skipped` and `check`, which the trainer calls at log steps and checkpoints.
    """

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], device: torch.device, limit: int
    ):
        self.optimizers = optimizers
        self.limit = limit
        self.on_device = all(opt.defaults.get("fused") for opt in optimizers)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._run = torch.zeros_like(self._skipped)  # consecutive skipped steps, now
        self._longest_run = torch.zeros_like(self._skipped)

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        """Steps the optimizers at learning rate `lr` (a 0-d tensor on the device) unless the
        loss or the gradient norm is not finite; returns 1 if the step was applied, else 0 (an
        int64 0-d tensor on the device)."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.on_device:
            found_inf = (~finite).float()
            lr = lr.float()  # the fused kernel reads a float32 learning-rate tensor on the device
            for opt in self.optimizers:
                # read by torch.optim.AdamW(fused=True).step; not an attribute torch declares
                opt.found_inf = found_inf  # type: ignore[attr-defined]
                _step_at(opt, lr)
        elif finite:
            lr_value = lr.item()  # this path already waits for the device (`finite`)
            for opt in self.optimizers:
                _step_at(opt, torch.tensor(lr_value) if reads_tensor_lr(opt) else lr_value)
        skipped = (~finite).long()
        self._skipped += skipped
        self._run = (self._run + 1) * skipped
        torch.maximum(self._longest_run, self._run, out=self._longest_run)
        return 1 - skipped

    @property
    def skipped(self) -> int:
        """Steps skipped since the start of the run (resumes included)."""
        return int(self._skipped.item())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The count of skipped steps, which a resumed run continues."""
        return {"skipped": self._skipped}

    def load_state_dict(self, state: dict) -> None:
        self._skipped.fill_(int(state["skipped"]))

    def reason_not_to_save(self, state: Mapping[str, torch.Tensor]) -> str | None:
        """Collective: why the training state must not be checkpointed now, or None. It must
        not when this step ends a run of skipped steps (the weights are those of the last
        applied step, but the run is diverging from them) or when a floating-point tensor of
        `state` (this rank's shards of weights and optimizer state, by name) holds a NaN or an
        infinity. Tested on the device; read back once (called at checkpoint steps only)."""
        device = self._run.device
        names = [k for k, t in state.items() if _is_float_tensor(t)]
        bad = torch.stack(
            [~_all_finite(state[k]).to(device) for k in names]
            or [torch.zeros((), dtype=torch.bool, device=device)]
        )
        summary = torch.stack([self._run, bad.any().long()])
        if dist.is_initialized():
            dist.all_reduce(summary, op=dist.ReduceOp.MAX)
        streak, nonfinite = summary.tolist()
        if streak:
            return f"it ends a run of {streak} skipped steps (non-finite loss or gradient norm)"
        if nonfinite:
            mine = [k for k, flag in zip(names, bad.tolist(), strict=False) if flag]
            where = f" ({', '.join(mine[:3])}{', ...' if len(mine) > 3 else ''})" if mine else ""
            return f"weights or optimizer state hold NaN or infinite values{where}"
        return None

    def check(self, step: int) -> None:
        """Raises NonFiniteError if `limit` or more consecutive steps have been skipped."""
        if self._longest_run.item() >= self.limit:
            raise NonFiniteError(
                f"step {step}: loss or gradient norm has been non-finite for {self.limit} "
                f"consecutive steps (training.max_nonfinite_steps); lower the learning rate or "
                f"resume from an earlier checkpoint"
            )


def _is_float_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on the device: every element of this rank's part of `tensor` is finite."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if is_traceable_wrapper_subclass(local):  # quantized optimizer state: its float parts
        finite = torch.ones((), dtype=torch.bool, device=local.device)
        for name in local.__tensor_flatten__()[0]:
            inner = getattr(local, name)
            if inner.is_floating_point():
                finite &= _all_finite(inner)
        return finite
    flat = local.detach().reshape(-1)
    finite = torch.ones((), dtype=torch.bool, device=flat.device)
    for chunk in flat.split(_CHUNK):
        finite &= torch.isfinite(chunk).all()
    return finite


def _step_at(optimizer: torch.optim.Optimizer, lr: torch.Tensor | float) -> None:
    """`optimizer.step()` at learning rate `lr`. Between steps the groups hold the configured
    learning rate again: a checkpoint can reload only a number there, not a tensor, and the
    schedule gives every step its own."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    for group in optimizer.param_groups:
        group["lr"] = optimizer.defaults["lr"]

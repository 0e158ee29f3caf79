"""Experiment tracking with Weights & Biases (`[metrics] wandb = true`): a scalar sink that gets
what TensorBoard gets (train/metrics.py feeds both), plus the resolved config.

One dump folder is one W&B run: its id is kept in <dump_folder>/wandb_run_id, and a restarted or
resumed job continues that run. With WANDB_MODE=offline nothing leaves the machine: the run is
written under <dump_folder>/wandb/ and uploaded later with `wandb sync`. `wandb` is an optional
extra (`pip install 'bloomnative[wandb]'`); `check_wandb_installed` says so before a run starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bloomnative.config import ConfigError, MetricsConfig

RUN_ID_FILE = "wandb_run_id"
STEP_METRIC = "step"
"""The x axis of every series: the training step, logged with each scalar. W&B's own step
counts log calls, which only grow, while a loss-spike rollback or a resume from a checkpoint
logs earlier training steps again: with `step=` they would be dropped."""


def check_wandb_installed(metrics: MetricsConfig) -> None:
    """Raises ConfigError (one line) when metrics.wandb asks for W&B and `wandb` cannot be
    imported."""
    if not metrics.wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"metrics.wandb = true needs the wandb package, which {sys.executable} cannot "
            f"import ({e}): pip install 'bloomnative[wandb]', or set metrics.wandb = false"
        ) from None


class WandbSink:
    """The run of this dump folder (created on first use, continued afterwards), which
    receives the scalars at their training step; `config` is logged as the run's config."""

    def __init__(
        self, metrics: MetricsConfig, job_name: str, dump_folder: Path, config: dict[str, Any]
    ):
        import wandb

        id_file = dump_folder / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self._run = wandb.init(
            project=metrics.wandb_project,
            entity=metrics.wandb_entity or None,
            name=metrics.wandb_run_name or job_name,
            tags=list(metrics.wandb_tags),
            config=config,
            id=run_id,
            resume="allow",
            dir=str(dump_folder),
            allow_val_change=True,  # a resumed run may change keys (steps, load_step, ...)
        )
        if run_id is None:
            id_file.write_text(self._run.id + "\n")
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log({STEP_METRIC: step, **scalars})

    def close(self) -> None:
        self._run.finish()

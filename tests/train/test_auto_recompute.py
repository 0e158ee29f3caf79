"""activation_checkpoint.mode = "auto": the trainer runs the least recomputation that the memory
planner predicts fits the budget, and a budget nothing fits is refused before training."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from bloomnative import planner
from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.train.run import resolve_run
from training_helpers import TINY_RUN, run_training, train_env


def tiny_args(corpus: str, dump, *extra: str) -> list[str]:
    return [*TINY_RUN, f"--data.blend={corpus}", f"--job.dump_folder={dump}", *extra]


def resolved_config(dump) -> Config:
    """The configuration the trainer ran, as it wrote it to the dump folder."""
    return parse_args(["--config", str(dump / "config.toml")])


def predicted_bytes(argv: list[str], mode: str, every: int = 1) -> int:
    """The planner's device bytes for this run on one CPU process with the given recompute."""
    run = resolve_run(parse_args(argv), 1, "cpu")
    layout = run.planner_layout()
    workload = dataclasses.replace(
        planner.workload_from_config(run.config, layout, "cpu"),
        recompute=mode,
        recompute_every=every,
    )
    return planner.estimate(
        run.model_args, layout, workload, planner.Overhead.none(), "cpu"
    ).worst.device_bytes


def test_auto_runs_the_least_recompute_that_fits_the_budget(tmp_path, synthetic_corpus):
    argv = tiny_args(synthetic_corpus, tmp_path / "run", "--training.steps=2")
    none, full = predicted_bytes(argv, "none"), predicted_bytes(argv, "full")
    assert full < none  # the tiny model's activations are worth recomputing
    budget = (none + full) / 2 / planner.GiB  # "none" does not fit, "full" does

    proc = run_training(
        [
            *argv,
            "--activation_checkpoint.mode=auto",
            f"--activation_checkpoint.memory_budget_gib={budget!r}",
        ]
    )
    ac = resolved_config(tmp_path / "run").activation_checkpoint
    assert ac.mode in ("selective", "full")
    every = ac.every if ac.mode == "selective" else 1
    assert predicted_bytes(argv, ac.mode, every) <= budget * planner.GiB
    assert "chosen by the planner" in proc.stdout
    # Minimal: the option with one checkpointed block fewer does not fit.
    if ac.mode == "full":
        cheaper = ("selective", 2)
    elif every < 4:
        cheaper = ("selective", every + 1)
    else:
        cheaper = ("none", 1)
    assert predicted_bytes(argv, *cheaper) > budget * planner.GiB


def test_auto_on_cpu_without_a_budget_recomputes_nothing(tmp_path, synthetic_corpus):
    argv = tiny_args(synthetic_corpus, tmp_path / "run", "--training.steps=1")
    run_training([*argv, "--activation_checkpoint.mode=auto"])
    assert resolved_config(tmp_path / "run").activation_checkpoint.mode == "none"


@pytest.mark.parametrize("module", ["bloomnative.train.preflight", "bloomnative.train.main"])
def test_a_budget_nothing_fits_is_a_config_error(tmp_path, synthetic_corpus, module):
    argv = tiny_args(
        synthetic_corpus,
        tmp_path / "run",
        "--activation_checkpoint.mode=auto",
        "--activation_checkpoint.memory_budget_gib=1e-6",
    )
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv],
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert 'activation_checkpoint.mode = "auto"' in proc.stderr
    assert "training.micro_batch_size" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_negative_budget_is_rejected():
    with pytest.raises(ConfigError, match="memory_budget_gib"):
        parse_args(["--activation_checkpoint.memory_budget_gib=-1"])

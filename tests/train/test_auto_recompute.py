"""activation_checkpoint.mode = "auto": the trainer runs the least recomputation that the memory
planner predicts fits the budget, and a budget nothing fits is refused before training."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bloomnative import planner
from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.train.resolved import resolve_run
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN


def tiny_args(corpus: str, dump, *extra: str) -> list[str]:
    return [*TINY_RUN, f"--data.blend={corpus}", f"--job.dump_folder={dump}", *extra]


def resolved_config(dump) -> Config:
    """The configuration the trainer ran, as it wrote it to the dump folder."""
    return parse_args(["--config", str(dump / "config.toml")])


def predicted_bytes(argv: list[str], mode: str, every: int = 1) -> int:
    """The planner's device bytes for this run on one CPU process with the given recompute, with
    the overhead the trainer plans "auto" with on CPU (the process's runtime and malloc's free
    memory: `planner.Overhead.cpu`)."""
    run = resolve_run(parse_args(argv), 1, "cpu")
    layout = run.planner_layout()
    workload = dataclasses.replace(run.planner_workload(), recompute=mode, recompute_every=every)
    return planner.estimate(
        run.model_args, layout, workload, planner.Overhead.for_device("cpu"), "cpu"
    ).worst.device_bytes


AUTO = "--activation_checkpoint.mode=auto"
NOTHING_FITS = "--activation_checkpoint.memory_budget_gib=1e-6"


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> SharedWorld:
    """The module's runs, scenarios of one shared world, each with a dump folder of its name
    beside the world's: "budget" (the argv of `budget_argv` with auto recompute and
    `budget_gib`), "no_budget" (auto, no budget), and a budget nothing fits given to the
    preflight's and the worker's entry points ("nothing_fits_preflight", "nothing_fits_worker":
    exit code 2)."""
    out = tmp_path_factory.mktemp("auto_recompute")
    world = SharedWorld(out / "world")
    argv = budget_argv(synthetic_corpus, out)
    world.train(
        "budget", [*argv, AUTO, f"--activation_checkpoint.memory_budget_gib={budget_gib(argv)!r}"]
    )
    world.train(
        "no_budget", tiny_args(synthetic_corpus, out / "no_budget", "--training.steps=1", AUTO)
    )
    for module in ("preflight", "worker"):
        name = f"nothing_fits_{module}"
        argv = tiny_args(synthetic_corpus, out / name, AUTO, NOTHING_FITS)
        world.add(name, f"bloomnative.launch.{module}:main", argv, expect=2)
    return world.run()


def budget_argv(corpus: str, out: Path) -> list[str]:
    return tiny_args(corpus, out / "budget", "--training.steps=2")


def budget_gib(argv: list[str]) -> float:
    """Between what the run of `argv` needs without recompute (so that does not fit) and with
    full recompute (which does)."""
    none, full = predicted_bytes(argv, "none"), predicted_bytes(argv, "full")
    assert full < none  # the tiny model's activations are worth recomputing
    return (none + full) / 2 / planner.GiB


@pytest.mark.multiprocess
def test_auto_runs_the_least_recompute_that_fits_the_budget(runs, synthetic_corpus):
    proc = runs.result("budget")
    argv = budget_argv(synthetic_corpus, runs.out.parent)
    limit = budget_gib(argv) * planner.GiB
    ac = resolved_config(runs.out.parent / "budget").activation_checkpoint
    assert ac.mode in ("selective", "full")
    every = ac.every if ac.mode == "selective" else 1
    assert predicted_bytes(argv, ac.mode, every) <= limit
    assert "chosen by the planner" in proc.stdout
    # Minimal: the option with one checkpointed block fewer does not fit.
    if ac.mode == "full":
        cheaper = ("selective", 2)
    elif every < 4:
        cheaper = ("selective", every + 1)
    else:
        cheaper = ("none", 1)
    assert predicted_bytes(argv, *cheaper) > limit


@pytest.mark.multiprocess
def test_auto_on_cpu_without_a_budget_recomputes_nothing(runs):
    runs.result("no_budget")
    assert resolved_config(runs.out.parent / "no_budget").activation_checkpoint.mode == "none"


@pytest.mark.multiprocess
@pytest.mark.parametrize("module", ["preflight", "worker"])
def test_a_budget_nothing_fits_is_a_config_error(runs, module):
    name = f"nothing_fits_{module}"
    proc = runs.result(name)  # exit code 2
    assert 'activation_checkpoint.mode = "auto"' in proc.stderr
    assert "training.micro_batch_size" in proc.stderr
    assert not (runs.out.parent / name / "checkpoints").exists()


def test_negative_budget_is_rejected():
    with pytest.raises(ConfigError, match="memory_budget_gib"):
        parse_args(["--activation_checkpoint.memory_budget_gib=-1"])

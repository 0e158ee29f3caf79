"""Experiment tracking with Weights & Biases (train/tracking.py), with the real `wandb` package
offline: a run's W&B records hold exactly the scalars its TensorBoard events hold and the
resolved config; a resumed run continues the same W&B run; asking for W&B without the package
is one line at preflight."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bloomnative.config import Config, load_toml
from bloomnative.launch import preflight
from bloomnative.train.tracking import RUN_ID_FILE
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN
from harness.wandb_records import OfflineRun, read_offline_run

TAGS = ["cluster", "tiny"]


@pytest.fixture(scope="module")
def dump(synthetic_corpus, tmp_path_factory) -> Path:
    """A 3-step run with TensorBoard, validation and W&B (offline), then the same run resumed
    from its step-3 checkpoint to step 5, in one process."""
    out = tmp_path_factory.mktemp("wandb")
    dump = out / "run"
    args = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--job.dump_folder={dump}",
        "--job.name=tracked",
        "--data.split=900,100,0",
        "--validation.freq=2",
        "--validation.steps=1",
        "--metrics.tensorboard=true",
        "--metrics.wandb=true",
        f"--metrics.wandb_tags={','.join(TAGS)}",
        "--checkpoint.interval=3",
    ]
    world = SharedWorld(out / "world")
    world.train("first", [*args, "--training.steps=3"])
    world.train("resumed", [*args, "--training.steps=5"])
    # Offline, and nothing written outside the test's folder (W&B's settings and caches).
    env = {"WANDB_MODE": "offline"}
    env |= {f"WANDB_{d}_DIR": str(out / f"wandb_{d.lower()}") for d in ("CONFIG", "CACHE", "DATA")}
    world.run(env=env).results()
    return dump


def offline_runs(dump: Path) -> list[OfflineRun]:
    """The dump folder's offline W&B runs, oldest first."""
    folders = sorted((dump / "wandb").glob("offline-run-*"))
    return [read_offline_run(folder) for folder in folders]


def scalars(run: OfflineRun) -> Counter:
    """(name, training step, value as float32) of every scalar the run logged."""
    found = Counter()
    for row in run.history:
        for key, value in row.items():
            if key != "step" and not key.startswith("_"):
                found[key, row["step"], float(np.float32(value))] += 1
    return found


@pytest.mark.multiprocess
def test_wandb_gets_the_tensorboard_scalars_and_the_resolved_config(dump):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dump / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tensorboard = Counter(
        (tag, e.step, float(np.float32(e.value)))
        for tag in events.Tags()["scalars"]
        for e in events.Scalars(tag)
    )
    first, resumed = offline_runs(dump)
    assert scalars(first) + scalars(resumed) == tensorboard
    keys = {key for key, _, _ in tensorboard}
    assert {"loss", "loss_step", "lr", "grad_norm", "eval_loss", "tokens_per_sec"} <= keys
    # The resolved config (config.toml, written by the resumed run) is the W&B run's config.
    written = Config()
    load_toml(written, dump / "config.toml")
    logged = {k: v for k, v in resumed.config.items() if not k.startswith("_")}
    assert logged == written.to_dict()
    assert first.config["training"]["steps"] == 3 and logged["training"]["steps"] == 5


@pytest.mark.multiprocess
def test_a_resumed_run_continues_the_same_wandb_run(dump):
    run_id = (dump / RUN_ID_FILE).read_text().strip()
    first, resumed = offline_runs(dump)
    for run in (first, resumed):
        assert (run.run_id, run.project, run.display_name) == (run_id, "bloomnative", "tracked")
        assert run.tags == TAGS
    assert sorted({row["step"] for row in first.history}) == [1, 2, 3]
    assert sorted({row["step"] for row in resumed.history}) == [4, 5]


def test_asking_for_wandb_without_the_package_is_one_line_at_preflight(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert preflight.main(["--metrics.wandb=true"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("config error: metrics.wandb = true needs the wandb package")
    assert "pip install 'bloomnative[wandb]'" in line and "metrics.wandb = false" in line

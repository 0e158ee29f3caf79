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


WANDB_VARIABLES = (
    "WANDB_API_KEY",
    "WANDB_IDENTITY_TOKEN_FILE",
    "WANDB_MODE",
    "WANDB_DISABLED",
    "WANDB_BASE_URL",
    "WANDB_CONFIG_DIR",
    "WANDB_DIR",
    "NETRC",
)


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path) -> Path:
    """A home without W&B credentials or settings (returned), and none in the environment."""
    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return tmp_path


def test_asking_for_wandb_online_without_an_api_key_is_one_line_at_preflight(
    no_wandb_login, capsys
):
    """Before, preflight passed and every worker stopped at its first step with W&B's
    traceback, restarted three times (exit 1)."""
    assert preflight.main(["--metrics.wandb=true"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("config error: metrics.wandb = true, but W&B has no API key for ")
    assert f"no entry for api.wandb.ai in {no_wandb_login / '.netrc'}" in line
    assert "`wandb login`" in line and "WANDB_MODE=offline" in line


def write_netrc(path: Path, host: str) -> None:
    path.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    path.chmod(0o600)


SOURCES = {  # how W&B gets a key, or needs none -> (variables, files under home)
    "offline": ({"WANDB_MODE": "offline"}, {}),
    "disabled": ({"WANDB_MODE": "disabled"}, {}),
    "WANDB_API_KEY": ({"WANDB_API_KEY": "k" * 40}, {}),
    "netrc": ({}, {".netrc": "api.wandb.ai"}),
    "netrc of WANDB_BASE_URL": (
        {"WANDB_BASE_URL": "https://wandb.example.com"},
        {".netrc": "wandb.example.com"},
    ),
    "`wandb offline`": ({}, {".config/wandb/settings": "[default]\nmode = offline\n"}),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_key_where_wandb_looks_or_an_offline_mode_passes(no_wandb_login, monkeypatch, source):
    from bloomnative.config import ConfigError, MetricsConfig
    from bloomnative.train.tracking import check_wandb_credentials

    variables, files = SOURCES[source]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    for name, content in files.items():
        path = no_wandb_login / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name == ".netrc":
            write_netrc(path, content)
        else:
            path.write_text(content)
    check_wandb_credentials(MetricsConfig(wandb=True))
    # The same home with another server's entry only, online: no key for api.wandb.ai.
    if source == "netrc":
        write_netrc(no_wandb_login / ".netrc", "wandb.example.com")
        with pytest.raises(ConfigError, match="no API key for api.wandb.ai"):
            check_wandb_credentials(MetricsConfig(wandb=True))

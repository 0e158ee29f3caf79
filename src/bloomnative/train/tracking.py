"""Experiment tracking with Weights & Biases (`[metrics] wandb = true`): a scalar sink that gets
what TensorBoard gets (train/metrics.py feeds both), plus the resolved config.

One dump folder is one W&B run: its id is kept in <dump_folder>/wandb_run_id, and a restarted or
resumed job continues that run. With WANDB_MODE=offline nothing leaves the machine: the run is
written under <dump_folder>/wandb/ and uploaded later with `wandb sync`. `wandb` is an optional
extra (`pip install 'bloomnative[wandb]'`); `check_wandb_installed` says so before a run starts,
and `check_wandb_credentials` that W&B will find an API key (without one, `wandb.init` stops
every worker at its first step, in non-interactive runs).
"""

from __future__ import annotations

import configparser
import netrc
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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


_LOCAL_MODES = ("offline", "dryrun", "disabled")
"""WANDB_MODE values under which nothing is sent, so no API key is needed."""
_DEFAULT_HOST = "https://api.wandb.ai"


def check_wandb_credentials(
    metrics: MetricsConfig, environ: Mapping[str, str] | None = None
) -> None:
    """Raises ConfigError (one line) when metrics.wandb asks for W&B online and W&B would find no
    API key. Where wandb looks (read here without importing it or reaching the network):
    WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE, the netrc file (NETRC, else ~/.netrc or
    ~/_netrc) entry for its host (WANDB_BASE_URL, default api.wandb.ai: what `wandb login`
    writes), or an api_key in its settings files (WANDB_CONFIG_DIR/settings, else
    ~/.config/wandb/settings, and wandb/settings under WANDB_DIR or the current folder). A mode
    (WANDB_MODE or a settings file's, as `wandb offline` writes it) of offline, dryrun or
    disabled, or WANDB_DISABLED=true, needs no key. Whether the key is valid only W&B's server
    can say."""
    if not metrics.wandb:
        return
    env = os.environ if environ is None else environ
    settings = _wandb_settings(env)
    mode = (env.get("WANDB_MODE") or settings.get("mode", "")).strip().lower()
    disabled = env.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes")
    if mode in _LOCAL_MODES or disabled:
        return
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE") or settings.get("api_key"):
        return
    base_url = env.get("WANDB_BASE_URL") or settings.get("base_url") or _DEFAULT_HOST
    host = urlsplit(base_url).netloc or base_url
    netrc_path = _netrc_path(env)
    try:
        entry = netrc.netrc(netrc_path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        entry = None
    if entry is not None and entry[2]:
        return
    raise ConfigError(
        f"metrics.wandb = true, but W&B has no API key for {host} here: no WANDB_API_KEY, and "
        f"no entry for {host} in {netrc_path} (what `wandb login` writes); every worker would "
        "stop at its first step. Run `wandb login` (or set WANDB_API_KEY) where the job runs, "
        "set WANDB_MODE=offline to log locally and `wandb sync` later, or set metrics.wandb = "
        "false"
    )


def _netrc_path(env: Mapping[str, str]) -> Path:
    """The netrc file wandb reads: NETRC, else ~/.netrc (or ~/_netrc where only that exists)."""
    if env.get("NETRC"):
        return Path(env["NETRC"]).expanduser()
    unix, windows = Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()
    return windows if windows.exists() and not unix.exists() else unix


def _wandb_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The [default] section of wandb's settings files, the workspace's over the global one."""
    config_dir = env.get("WANDB_CONFIG_DIR")
    global_file = Path(config_dir or "~/.config/wandb").expanduser() / "settings"
    workspace = Path(env.get("WANDB_DIR") or ".").expanduser() / "wandb" / "settings"
    found: dict[str, str] = {}
    for path in (global_file, workspace):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        if parser.has_section("default"):
            found.update(parser["default"])
    return found


def check_wandb(metrics: MetricsConfig) -> None:
    """`check_wandb_installed`, then `check_wandb_credentials`."""
    check_wandb_installed(metrics)
    check_wandb_credentials(metrics)


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

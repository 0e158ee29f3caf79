"""Downstream evaluation during training (`[downstream]`): rank 0 scores the checkpoints it saves
every `freq` steps on lm-evaluation-harness tasks in a separate process
(`python -m bloomnative.evaluation.score_checkpoint`), and the step loop never waits for it.

One evaluation runs at a time. A checkpoint that falls due while one runs is queued (only the
newest: an older queued one is dropped, with a line); the step loop asks `poll` after every step,
which starts the queued one once its folder is complete (an async save completes at the next
save) and turns a finished evaluation's results JSON into one metrics row at the checkpoint's
step: `downstream/<task>/<metric>` (the harness's metric key, its default filter `,none`
left out; no standard errors). A failed evaluation (an exit code other than 0, or results that do
not parse) is one warning naming its log file (<dump>/eval/step-N.log); training goes on. At the
end, `finish` waits up to `wait_s` for what is running or queued, with a progress line.

The worker imports nothing of the harness: only `check_tasks` (preflight) does."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bloomnative.config import Config, ConfigError, DownstreamConfig
from bloomnative.log import get_logger
from bloomnative.train.metrics import MetricsLogger

_log = get_logger(__name__)

EVAL_FOLDER = "eval"
PROGRESS_EVERY_S = 30.0
"""How often `finish` says that it is still waiting."""


def check_tasks(config: Config) -> None:
    """Preflight's check of [downstream] when it is on: the harness is installed, the run has a
    tokenizer for it, the task folder parses and every task resolves (`task_names.task_manager`).
    Raises ConfigError (one line)."""
    d = config.downstream
    if not d.freq:
        return
    if not config.data.tokenizer:
        raise ConfigError(
            "downstream.freq is set but data.tokenizer is empty: the evaluation reads text with "
            "the run's tokenizer"
        )
    try:
        from bloomnative.evaluation.task_names import TaskError, task_manager
    except ImportError as e:
        raise ConfigError(
            f"downstream.freq = {d.freq} needs lm-evaluation-harness, which {sys.executable} "
            f"cannot import ({e}): pip install 'bloomnative[eval]', or set downstream.freq = 0"
        ) from None
    try:
        task_manager(d.tasks, d.include_path or None)
    except TaskError as e:
        raise ConfigError(f"downstream.tasks: {e}") from None


def metric_rows(results: dict[str, Any]) -> dict[str, float]:
    """`downstream/<task>/<metric>` -> value for every metric of a results JSON's "results" that
    is a finite number: the harness's keys ("metric,filter", the default filter's `,none` left
    out), standard errors aside."""
    rows = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, comma, _ = key.partition(",")  # "metric,filter"; "alias", "sample_len" aside
            if not comma or metric.endswith("_stderr") or not _is_number(value):
                continue
            rows[f"downstream/{task}/{key.removesuffix(',none')}"] = float(value)
    return rows


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass
class _Running:
    step: int
    process: subprocess.Popen
    output: Path
    log: Path
    started: float


class DownstreamEvaluator:
    """Rank 0's evaluations of its checkpoints (see the module docstring). Disabled (`enabled`
    false: the other ranks; or `cfg.freq` 0) its methods do nothing."""

    def __init__(
        self,
        cfg: DownstreamConfig,
        checkpoints: Path,
        dump: Path,
        metrics: MetricsLogger,
        enabled: bool = True,
    ):
        self.enabled = enabled and cfg.freq > 0
        self.cfg = cfg
        self.checkpoints = checkpoints
        self.folder = dump / EVAL_FOLDER
        self.metrics = metrics
        self.running: _Running | None = None
        self.queued: int | None = None

    def checkpoint_saved(self, step: int) -> None:
        """Training saved (or, async, started saving) checkpoint `step`: scores it if it is due."""
        if not self.enabled or step % self.cfg.freq:
            return
        self.poll()  # an async save completes the previous one: that one starts first
        if self.queued is not None:
            _log.info(f"downstream: step-{self.queued} is not scored: step-{step} replaces it")
        elif self.running is not None:
            _log.info(
                f"downstream: step-{step} waits: step-{self.running.step} is still being scored"
            )
        self.queued = step
        self.poll()

    def poll(self) -> None:
        """Collects a finished evaluation, starts the queued one when its checkpoint is complete;
        never waits."""
        if not self.enabled:
            return
        if self.running is not None and self.running.process.poll() is not None:
            self._collect(self.running)
            self.running = None
        if self.running is None and self.queued is not None:
            if (self.checkpoints / f"step-{self.queued}").is_dir():
                self._start(self.queued)
                self.queued = None

    def finish(self) -> None:
        """At the end of training (every checkpoint complete): waits up to `wait_s` for the
        running and queued evaluations; one left then is stopped, with a line."""
        if not self.enabled:
            return
        if self.queued is not None and not (self.checkpoints / f"step-{self.queued}").is_dir():
            _log.warning(f"downstream: step-{self.queued} was not saved, so it is not scored")
            self.queued = None
        deadline = time.monotonic() + self.cfg.wait_s
        said = -math.inf
        while True:
            self.poll()
            if self.running is None:
                return
            now = time.monotonic()
            if now >= deadline:
                break
            if now - said >= PROGRESS_EVERY_S:
                _log.info(
                    f"downstream: waiting for the score of step-{self.running.step} "
                    f"({now - self.running.started:.0f} s so far, at most "
                    f"{deadline - now:.0f} s more: downstream.wait_s)"
                )
                said = now
            time.sleep(0.2)
        _log.warning(
            f"downstream: abandoned the score of step-{self.running.step} after downstream.wait_s "
            f"= {self.cfg.wait_s} s{self._queued_note()}; score it with tools/evaluate.py"
        )
        self.close()

    def close(self) -> None:
        """Stops a running evaluation (training ends, or failed)."""
        if self.running is not None:
            self.running.process.kill()
            self.running.process.wait()
            self.running = None

    def _queued_note(self) -> str:
        return "" if self.queued is None else f" (step-{self.queued} was not started)"

    def _start(self, step: int) -> None:
        """Starts the evaluation of checkpoint `step`; one that cannot start (its folder or log
        cannot be written, no process can be made) is one warning, as a failed one is."""
        output, log = self.folder / f"step-{step}.json", self.folder / f"step-{step}.log"
        settings = json.dumps(dataclasses.asdict(self.cfg))
        command = [sys.executable, "-m", "bloomnative.evaluation.score_checkpoint"]
        command += [str(self.checkpoints / f"step-{step}"), str(output), settings]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            output.unlink(missing_ok=True)  # a results file of an earlier run is not this one's
            with log.open("w") as out:
                process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=_evaluation_env()
                )
        except OSError as e:
            _log.warning(f"downstream: scoring step-{step} could not start: {e}")
            return
        self.running = _Running(step, process, output, log, time.monotonic())
        _log.info(f"downstream: scoring step-{step} in process {process.pid} (log: {log})")

    def _collect(self, run: _Running) -> None:
        seconds = time.monotonic() - run.started
        code = run.process.returncode
        if code != 0:
            _log.warning(
                f"downstream: scoring step-{run.step} failed (exit code {code}) after "
                f"{seconds:.0f} s: {_last_line(run.log)} (log: {run.log})"
            )
            return
        try:
            rows = metric_rows(json.loads(run.output.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            _log.warning(
                f"downstream: the results of step-{run.step} ({run.output}) do not parse: "
                f"{type(e).__name__}: {e}"
            )
            return
        self.metrics.log({"step": run.step, **rows, "downstream_seconds": seconds})


_WORLD_VARIABLES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
}  # fmt: skip


def _evaluation_env() -> dict[str, str]:
    """This worker's environment without torchrun's description of its world: the evaluation is
    a process of its own, and the harness (through accelerate) would take those variables for a
    distributed evaluation."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in _WORLD_VARIABLES and not key.startswith("TORCHELASTIC_")
    }


def _last_line(path: Path) -> str:
    """The last non-blank line of a log file (an error's one line), or what stands instead."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError as e:
        return f"its log cannot be read ({e})"
    return lines[-1].strip() if lines else "its log is empty"

"""Stopping from the outside: SIGTERM to run_train.sh (as Kubernetes and schedulers send it) or
Ctrl-C to its process group makes every worker finish its step and save, and the command exits 0
without a traceback; a second signal during the save, or the end of the grace period, never
leaves a checkpoint marked complete that is not."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bloomnative.checkpoint import checkpointer as ckpt
from harness.launching import (
    SCENARIO_DIR,
    logged_rows,
    python_command,
    run,
    start,
    train_env,
    wait_for,
)
from harness.training import REPO, TINY_RUN, metric_rows

SLOW_SAVES = SCENARIO_DIR / "slow_save_scenario.py"
pytestmark = pytest.mark.multiprocess


def args(dump: Path, corpus: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        "--training.steps=100000",
        "--lr_scheduler.decay_steps=10",
        "--checkpoint.interval=100000",
    ]


def wait_for_steps(dump: Path, proc: subprocess.Popen, steps: int = 2) -> None:
    wait_for(lambda: logged_rows(dump) >= steps, proc, 180, f"{steps} logged steps")


def start_session(command: list[str], **env: str) -> subprocess.Popen:
    return start(
        command,
        env=train_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal or a scheduler gives it
    )


@pytest.mark.parametrize(
    "sig, to_group, nproc",
    [(signal.SIGTERM, False, 2), (signal.SIGINT, True, 1)],
    ids=["SIGTERM to the launcher, 2 workers", "Ctrl-C to the process group"],
)
def test_a_signal_to_run_train_sh_saves_and_exits_zero(
    synthetic_corpus, tmp_path, sig, to_group, nproc
):
    run_train_sh = [str(REPO / "run_train.sh"), *args(tmp_path, synthetic_corpus)]
    proc = start_session(run_train_sh, NPROC=str(nproc))
    wait_for_steps(tmp_path, proc)
    if to_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err
    assert f"stopped cleanly on {sig.name}" in err
    last = metric_rows(tmp_path)[-1]["step"]
    assert ckpt.complete_steps(tmp_path / "checkpoints") == [last]
    checker = ckpt.Checkpointer(tmp_path / "checkpoints", 0, async_mode=False, min_free_gib=0)
    assert checker.verify(last) is None


def test_ctrl_c_during_the_stop_save_leaves_no_complete_checkpoint(synthetic_corpus, tmp_path):
    # Every save is held 60 s before it is marked complete: the second signal lands inside it.
    proc = start_session(python_command([str(SLOW_SAVES), "60", *args(tmp_path, synthetic_corpus)]))
    wait_for_steps(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: any((tmp_path / "checkpoints").glob("*.partial")), proc, what="a save")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert ckpt.complete_steps(tmp_path / "checkpoints") == []


def test_workers_still_saving_at_the_end_of_the_grace_period_are_killed(synthetic_corpus, tmp_path):
    launcher = ["-m", "bloomnative.launch.torchrun", "--stop-grace-s=2"]
    torchrun = ["--standalone", "--nproc-per-node=1", "--max-restarts=0"]
    slow_saves = [str(SLOW_SAVES), "60", *args(tmp_path, synthetic_corpus)]
    proc = start_session(python_command([*launcher, *torchrun, *slow_saves]))
    wait_for_steps(tmp_path, proc)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 30
    assert "workers killed after the grace period of 2 s" in err
    assert ckpt.complete_steps(tmp_path / "checkpoints") == []
    survivors = run(["pgrep", "-f", str(tmp_path)], check=False)
    assert survivors.stdout == ""

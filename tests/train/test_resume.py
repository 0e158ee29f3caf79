"""Checkpoints make interruptions a non-event: resuming gives the losses of the run that never
stopped, after a clean stop, a SIGKILL (also in the middle of a save), SIGTERM or a STOP file,
under another parallel layout, and when the newest checkpoint was damaged on disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from harness.launching import SCENARIO_DIR, logged_rows, python_command, run, start, wait_for
from harness.training import (
    TINY_RUN,
    flip_bytes,
    losses_by_step,
    metric_rows,
    run_training,
    train_command,
)

STEPS = 6
SLOW_SAVES = SCENARIO_DIR / "slow_save_scenario.py"
pytestmark = pytest.mark.multiprocess


def args(dump: Path, corpus: str, *extra: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        f"--lr_scheduler.decay_steps={STEPS}",  # the schedule must not depend on where we stop
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        *extra,
    ]


@pytest.fixture(scope="module")
def uninterrupted(synthetic_corpus, tmp_path_factory) -> dict[str, dict[int, float]]:
    """The reference runs, fp32 and bf16, in one process each."""
    out = {}
    for dtype in ("fp32", "bf16"):
        dump = tmp_path_factory.mktemp(f"uninterrupted_{dtype}")
        run_training(args(dump, synthetic_corpus, f"--training.dtype={dtype}"))
        out[dtype] = losses_by_step(dump)
    return out


@pytest.mark.parametrize(
    "dtype,save_mode", [("fp32", "disabled"), ("bf16", "disabled"), ("fp32", "async")]
)
def test_resume_after_a_clean_stop_is_bit_identical(
    uninterrupted, synthetic_corpus, tmp_path, dtype, save_mode
):
    options = [f"--training.dtype={dtype}", f"--checkpoint.async_mode={save_mode}"]
    run_training(args(tmp_path, synthetic_corpus, *options, "--training.steps=3"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]
    run_training(args(tmp_path, synthetic_corpus, *options))
    assert losses_by_step(tmp_path) == uninterrupted[dtype]


def _start(run_args: list[str], save_delay_s: float = 0) -> subprocess.Popen:
    """The trainer in a process of its own; `save_delay_s` holds every save that long before it
    is marked complete (tests/scenarios/slow_save_scenario.py)."""
    command = train_command(run_args)
    if save_delay_s:
        command = python_command([str(SLOW_SAVES), str(save_delay_s), *run_args])
    return start(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_resume_after_sigkill_matches_uninterrupted_run(uninterrupted, synthetic_corpus, tmp_path):
    # Each save waits 1 s before it is marked complete, so once step-4 is complete the run is
    # still busy (steps 5-6 and the final save) when the kill lands.
    proc = _start(args(tmp_path, synthetic_corpus), save_delay_s=1)
    wait_for(lambda: (tmp_path / "checkpoints" / "step-4").is_dir(), proc, what="step-4")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "checkpoints" / "step-6").exists()
    run_training(args(tmp_path, synthetic_corpus))
    assert losses_by_step(tmp_path) == uninterrupted["fp32"]


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(
    uninterrupted, synthetic_corpus, tmp_path
):
    # Every save is held between writing its files and marking the checkpoint complete, so the
    # kill lands inside the save of step 4.
    proc = _start(args(tmp_path, synthetic_corpus), save_delay_s=30)
    ckpts = tmp_path / "checkpoints"
    wait_for(
        lambda: (ckpts / "step-4.partial").is_dir() and (ckpts / "step-2").is_dir(),
        proc,
        180,
        "the save of step 4",
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (ckpts / "step-4").exists()
    run_training(args(tmp_path, synthetic_corpus))
    assert not (ckpts / "step-4.partial").exists()  # cleaned up by the next save
    assert losses_by_step(tmp_path) == uninterrupted["fp32"]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGUSR1", "STOP file"])
def test_stop_request_saves_the_current_step_and_exits_zero(synthetic_corpus, tmp_path, how):
    proc = _start(
        args(
            tmp_path,
            synthetic_corpus,
            "--training.steps=1000000",
            "--checkpoint.interval=1000",
            f"--lr_scheduler.decay_steps={STEPS}",
        )
    )
    wait_for(lambda: logged_rows(tmp_path) >= 2, proc, what="2 logged steps")
    if how == "STOP file":
        (tmp_path / "STOP").touch()
    else:
        proc.send_signal(getattr(signal, how))
    assert proc.wait(timeout=120) == 0
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").glob("step-*"))
    stopped_at = max(losses_by_step(tmp_path))
    assert steps == [stopped_at]
    if how == "STOP file":
        (tmp_path / "STOP").unlink()
    proc = run_training(args(tmp_path, synthetic_corpus, f"--training.steps={stopped_at + 2}"))
    assert f"resumed from {tmp_path / 'checkpoints' / f'step-{stopped_at}'}" in proc.stdout
    logged_after = [row["step"] for row in metric_rows(tmp_path)][-2:]
    assert logged_after == [stopped_at + 1, stopped_at + 2]


def test_disk_check_refuses_to_save_and_deletes_nothing(synthetic_corpus, tmp_path):
    run_training(args(tmp_path, synthetic_corpus, "--training.steps=2"))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    proc = run_training(
        args(tmp_path, synthetic_corpus, "--checkpoint.min_free_gib=1e9"), timeout=300, check=False
    )
    assert proc.returncode != 0
    assert "not enough disk space to save a checkpoint" in proc.stderr
    assert "checkpoint.min_free_gib" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_torchrun_restarts_a_crashed_worker_which_resumes_from_the_checkpoint(
    uninterrupted, synthetic_corpus, tmp_path
):
    """What run_train.sh's --max-restarts buys: the worker dies, torchrun starts it again and
    the run finishes with the losses of one that never crashed."""
    # Each save is held 1 s: the run is still busy when the kill lands.
    slow_saves = [str(SLOW_SAVES), "1", *args(tmp_path, synthetic_corpus)]
    proc = start(
        python_command(slow_saves, nproc=1, max_restarts=1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: (tmp_path / "checkpoints" / "step-4").is_dir(), proc, what="step-4")
    worker = run(["pgrep", "-P", str(proc.pid), "-f", SLOW_SAVES.name], check=False).stdout.split()
    assert len(worker) == 1, worker
    os.kill(int(worker[0]), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert losses_by_step(tmp_path) == uninterrupted["fp32"]


@pytest.fixture(scope="module")
def stopped_at_step_4(synthetic_corpus, tmp_path_factory) -> Path:
    """A dump folder of a run that stopped at step 4, with checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("stopped_at_step_4")
    run_training(args(dump, synthetic_corpus, "--training.steps=4"))
    return dump


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [flip_bytes, truncate], ids=["flipped bytes", "truncated"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(
    uninterrupted, stopped_at_step_4, synthetic_corpus, tmp_path, damage
):
    shutil.copytree(stopped_at_step_4, tmp_path, dirs_exist_ok=True)
    shard = tmp_path / "checkpoints" / "step-4" / "__0_0.distcp"
    damage(shard)
    damaged = shard.read_bytes()
    proc = run_training(args(tmp_path, synthetic_corpus))
    assert f"checkpoint step-4 is corrupt: {shard}: " in proc.stderr
    assert "; skipped, left as step-4.corrupt" in proc.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-2'} at step 2" in proc.stdout
    assert losses_by_step(tmp_path) == uninterrupted["fp32"]
    # Left for a person to inspect, byte for byte; the run saved a new step-4 beside it.
    assert (tmp_path / "checkpoints" / "step-4.corrupt" / "__0_0.distcp").read_bytes() == damaged


def test_an_explicit_load_step_that_fails_verification_exits_2(
    stopped_at_step_4, synthetic_corpus, tmp_path
):
    shutil.copytree(stopped_at_step_4, tmp_path, dirs_exist_ok=True)
    shard = tmp_path / "checkpoints" / "step-4" / "__0_0.distcp"
    flip_bytes(shard)
    proc = run_training(
        args(tmp_path, synthetic_corpus, "--checkpoint.load_step=4"), timeout=300, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"checkpoint error: checkpoint.load_step = 4: checkpoint step-4 is corrupt: {shard}: "
        "checksum"
    ) in proc.stderr
    assert "the newest checkpoint that can be loaded is step 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4"]

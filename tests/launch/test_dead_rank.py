"""A rank that dies ends its job in seconds and torchrun's restart resumes the run: the peers
fail instead of waiting for it in a collective until job.collective_timeout_s, and the restarted
workers form their process group (they used to read the dead workers' addresses from
torchrun's store and wait for them until the timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from bloomnative.launch.torchrun import children
from harness.launching import start, wait_for
from harness.training import TINY_RUN, losses_by_step, train_command

STEPS = 4
# Far above what a dead rank may cost: waiting for the collective timeout, or for torchrun's
# 30 s SIGTERM-to-SIGKILL grace on a worker stuck in a collective, fails the test.
COLLECTIVE_TIMEOUT_S = 300
TEARDOWN_WITHIN_S = 25
# The restart also starts 4 fresh processes (torch import, model build) on a loaded machine.
RESUMED_WITHIN_S = 120


@pytest.mark.multiprocess
def test_a_killed_rank_ends_the_attempt_in_seconds_and_torchrun_resumes(tmp_path, synthetic_corpus):
    args = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--job.dump_folder={tmp_path}",
        f"--job.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        f"--training.steps={STEPS}",
        f"--lr_scheduler.decay_steps={STEPS}",
        "--checkpoint.interval=2",
        "--parallelism.dp_shard=2",
        "--parallelism.pp=2",
    ]
    launcher = start(
        train_command(args, nproc=4, max_restarts=1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[tuple[float, str]] = []  # (arrival time, line) of the launcher's output
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line) for line in launcher.stdout)
    )
    output = lambda: "".join(line for _, line in lines[-60:])
    wait = lambda predicate, what: wait_for(predicate, launcher, RESUMED_WITHIN_S, what, output)
    reader.start()
    try:
        wait(lambda: (tmp_path / "checkpoints" / "step-2").is_dir(), "the step-2 checkpoint")
        workers = children(launcher.pid)
        killed_at = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)  # a middle rank, mid-step
        wait(lambda: not set(workers) & set(children(launcher.pid)), "the workers' end")
        teardown = time.monotonic() - killed_at
        wait(lambda: any("resumed from" in line for _, line in lines), "the resume")
        resumed = time.monotonic() - killed_at
        launcher.wait(timeout=COLLECTIVE_TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reader.join()
    output = "".join(line for _, line in lines)
    assert launcher.returncode == 0, output[-4000:]
    assert teardown < TEARDOWN_WITHIN_S, f"the other ranks took {teardown:.1f}s to end"
    assert resumed < RESUMED_WITHIN_S
    assert sorted(losses_by_step(tmp_path)) == list(range(1, STEPS + 1))

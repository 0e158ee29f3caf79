"""examples/slurm/train.sbatch on a real (one-host) Slurm cluster: two tasks, each a
run_train.sh acting as a node, rendezvous through the first; a SIGUSR1 to the batch script (what
`--signal=B:USR1@300` sends before the time limit) makes the run save and stop, the script
requeues the job, and the requeued job resumes, ending with the losses of an uninterrupted run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bloomnative.config import Config, load_toml
from harness.launching import REPO, logged_rows, run, start
from harness.slurm_cluster import ENDED, SlurmUnavailable, free_port, slurm_cluster
from harness.training import TINY_RUN, losses_by_step, train_command

SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
STEPS = 40  # the stop lands at step 3 to 7 here (requested after step 2): room for a faster machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    except SlurmUnavailable as e:
        pytest.skip(f"needs Slurm: {e}")


@pytest.mark.multiprocess
@pytest.mark.slurm
def test_a_requeued_slurm_job_resumes_with_the_losses_of_an_uninterrupted_run(
    cluster, synthetic_corpus, tmp_path
):
    args = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--training.steps={STEPS}",
        "--checkpoint.interval=1000",  # the only checkpoint: the one the stop saves
    ]
    dump = tmp_path / "slurm"
    log = tmp_path / "job.out"
    env = {
        **cluster.env,
        "BLOOMNATIVE_PYTHON": sys.executable,
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
        "RDZV_PORT": str(free_port()),
    }
    # Two tasks on the one node: two launchers, each acting as a node of one process.
    sbatch = ["sbatch", "--ntasks-per-node=2", f"--output={log}", "--job-name=tiny", str(SCRIPT)]
    submitted = run([*sbatch, *args, f"--job.dump_folder={dump}"], env=env, cwd=REPO).stdout
    job = submitted.strip().split()[-1]  # "Submitted batch job <id>"
    reference, reference_out = tmp_path / "uninterrupted", tmp_path / "uninterrupted.out"
    with reported_on_failure(cluster, job, log):
        wait_until(lambda: logged_rows(dump) >= 2, 300, f"job {job}'s first steps")
        cluster.command("scancel", "--signal=USR1", "--batch", job)
        # The uninterrupted run trains meanwhile: the requeued job waits out Slurm's hold
        # (CREDENTIAL_LIFETIME_S) and then starts by itself.
        uninterrupted = train_command([*args, f"--job.dump_folder={reference}"], nproc=2)
        with background(uninterrupted, reference_out) as ref:
            finished = cluster.wait_for_job(job, lambda f: f["JobState"] in ENDED, 600, "its end")
            assert finished["JobState"] == "COMPLETED" and finished["Restarts"] == "1", finished
            output = log.read_text()
            assert "NNODES=2 NPROC=1" in output
            assert "requeueing job" in output
            stopped = [
                int(s)
                for s in re.findall(r"^\[bloomnative\] stopping at step (\d+):", output, re.M)
            ]
            assert len(stopped) == 1 and 1 <= stopped[0] < STEPS
            assert f"resumed from {dump / 'checkpoints' / f'step-{stopped[0]}'}" in output
            written = Config()
            load_toml(written, dump / "config.toml")
            assert written.job.name == "tiny"  # from the Slurm job's name
            ref.wait(timeout=600)
        assert ref.returncode == 0, reference_out.read_text()[-4000:]
        assert losses_by_step(dump) == losses_by_step(reference)


@contextmanager
def background(command: list[str], output: Path) -> Iterator[subprocess.Popen]:
    """`command` running, its stdout and stderr in `output`; stopped (SIGTERM: torchrun stops
    its workers) if still running when the block ends."""
    with output.open("w") as out:
        proc = start(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


@contextmanager
def reported_on_failure(cluster, job: str, log: Path) -> Iterator[None]:
    """Adds the job's record, its output and the Slurm daemons' logs to a failure inside (an
    assertion, a timeout, a command that failed)."""
    try:
        yield
    except Exception as e:
        raise AssertionError(f"{e}\n{cluster.report(job, log)}") from e


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({timeout} s) waiting for {what}")
        time.sleep(0.2)

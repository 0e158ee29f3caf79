"""run_train.sh's launcher (bloomnative.train.job and .launch): its environment variables are
parsed, never evaluated; relative paths are the user's; an error restarting cannot fix ends the
job at once with its one line, while crashes are restarted; and no worker outlives its
launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bloomnative.train.job import LaunchSettingError, LaunchSettings
from training_helpers import (
    REPO,
    TINY_RUN,
    build_synthetic_corpus,
    flip_bytes,
    metric_rows,
    run_training,
    train_env,
)

RUN_TRAIN = str(REPO / "run_train.sh")
LAUNCHED_WORKER = str(Path(__file__).with_name("launched_worker.py"))


def run_train_sh(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RUN_TRAIN, *args],
        cwd=cwd,
        env={**train_env(), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "name, payload",
    # Bash arithmetic runs the command in an array subscript: `$(( NPROC * NNODES ))` did.
    [("NPROC", "x[$(touch {marker})]"), ("NNODES", "x[$(touch {marker})]"), ("NPROC", "abc")],
)
def test_a_launcher_variable_is_parsed_never_run_by_the_shell(tmp_path, name, payload):
    marker = tmp_path / "pwned"
    value = payload.format(marker=marker)
    proc = run_train_sh([], tmp_path, **{name: value})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"run_train.sh: {name}={value!r}: expected a whole "
        + (
            "number of processes per node, at least 1"
            if name == "NPROC"
            else "number of nodes, at least 1, or an elastic range min:max with 1 <= min <= max"
        )
    ]
    assert not marker.exists()


@pytest.mark.parametrize(
    "env, named",
    [
        ({"NPROC": "0"}, "NPROC='0'"),  # not parallelism.dp_shard's fault
        ({"NPROC": " 2"}, "NPROC=' 2'"),
        ({"NPROC": "２"}, "NPROC='２'"),  # a digit to int(), not a plain one
        ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS='-1'"),
        ({"STOP_GRACE_S": "1.5"}, "STOP_GRACE_S='1.5'"),
        ({"STOP_GRACE_S": "0"}, "STOP_GRACE_S='0'"),
        ({"OMP_NUM_THREADS": "all"}, "OMP_NUM_THREADS='all'"),
        ({"NNODES": "0"}, "NNODES='0'"),
        ({"NNODES": "4:2"}, "NNODES='4:2'"),
        ({"NNODES": "2:x"}, "NNODES='2:x'"),
        ({"NNODES": "2"}, "RDZV_ENDPOINT=''"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node0;reboot:29500"}, "RDZV_ENDPOINT='node0;reboot"),
    ],
)
def test_a_malformed_launcher_variable_is_named(env, named):
    with pytest.raises(LaunchSettingError) as error:
        LaunchSettings.from_env(env)
    assert str(error.value).startswith(named) and "\n" not in str(error.value)


def test_launcher_variables_become_torchrun_arguments_and_world_sizes():
    settings = LaunchSettings.from_env(
        {"NPROC": "4", "NNODES": "2:3", "RDZV_ENDPOINT": "node0:29500", "MAX_RESTARTS": "0"},
        cores=16,
    )
    assert settings.world_sizes() == [8, 12]
    assert settings.torchrun_args() == [
        "--nnodes=2:3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500",
        "--nproc-per-node=4",
        "--max-restarts=0",
    ]
    assert (settings.omp_threads, settings.stop_grace_s) == (4, 120)
    single = LaunchSettings.from_env({}, cores=2)
    assert single.torchrun_args() == ["--standalone", "--nproc-per-node=1", "--max-restarts=3"]
    assert single.world_sizes() == [1] and single.omp_threads == 2


def test_relative_paths_are_relative_to_the_users_directory(tmp_path):
    """--config, the data and the dump folder, all relative, found from where the command ran
    (preflight then stops at the load_step the test asks for, which names what it found)."""
    build_synthetic_corpus(str(tmp_path / "data" / "c_text_document"))
    (tmp_path / "my.toml").write_text(
        '[job]\ndump_folder = "run"\n[data]\nblend = ["data/c_text_document"]\n'
    )
    (tmp_path / "run" / "checkpoints" / "step-3").mkdir(parents=True)
    proc = run_train_sh(
        ["--config", "my.toml", *TINY_RUN, "--checkpoint.load_step=4"], tmp_path, NPROC="1"
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "config error: checkpoint.load_step = 4: no complete checkpoint at "
        "run/checkpoints/step-4; the complete checkpoints there are steps 3 (set "
        "checkpoint.load_step to one of them, or -1 for the newest that verifies)"
    ]


def launch(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """bloomnative.train.launch as run_train.sh runs it (torchrun's arguments, then the
    worker's), on 2 workers allowed 3 restarts."""
    launcher = [sys.executable, "-m", "bloomnative.train.launch", "--standalone"]
    torchrun = ["--nproc-per-node=2", "--max-restarts=3", "--monitor-interval=0.05"]
    return subprocess.run(
        [*launcher, *torchrun, *args],
        env={**train_env(), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.multiprocess
def test_a_final_error_ends_the_job_with_its_line_once_and_a_crash_is_restarted(tmp_path):
    starts = tmp_path / "starts"
    proc = launch([LAUNCHED_WORKER, str(starts), "final"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "checkpoint error: checkpoint.load_step = 7: planted by the test"
    ]
    ranks = starts.read_text().split()
    assert sorted(set(ranks)) == sorted(ranks) and set(ranks) <= {"0", "1"}  # started once
    starts.unlink()
    proc = launch([LAUNCHED_WORKER, str(starts), "crash"])
    assert proc.returncode == 1
    assert sorted(starts.read_text().split()) == ["0"] * 4 + ["1"] * 4  # 1 start + 3 restarts


@pytest.mark.multiprocess
def test_run_train_sh_reports_a_checkpoint_that_fails_verification_once(tmp_path, synthetic_corpus):
    """The worker meets it (preflight only sees that the folder exists): exit 2, the one line
    once, no restart, no traceback."""
    args = [*TINY_RUN, f"--data.blend={synthetic_corpus}", f"--job.dump_folder={tmp_path}"]
    run_training([*args, "--training.steps=1"])
    flip_bytes(next((tmp_path / "checkpoints" / "step-1").glob("*.distcp")))
    started = time.monotonic()
    proc = run_train_sh([*args, "--training.steps=2", "--checkpoint.load_step=1"], REPO, NPROC="2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        "checkpoint error: checkpoint.load_step = 1: "
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 120


def processes_naming(text: str) -> list[str]:
    """Command lines of the live processes that mention `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = cmdline.with_name("stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if text in line and state != "Z":
            found.append(line)
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "to_group, nproc", [(False, 2), (True, 1)], ids=["the launcher's pid", "its process group"]
)
def test_no_worker_outlives_a_killed_launcher(tmp_path, synthetic_corpus, to_group, nproc):
    args = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--job.dump_folder={tmp_path}",
        "--training.steps=100000",
        "--lr_scheduler.decay_steps=10",
        "--checkpoint.interval=2",
    ]
    proc = subprocess.Popen(
        [RUN_TRAIN, *args],
        env={**train_env(), "NPROC": str(nproc)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives it
    )
    deadline = time.monotonic() + 180
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.05)
    if to_group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while processes_naming(str(tmp_path)):
        assert time.monotonic() < deadline, processes_naming(str(tmp_path))
        time.sleep(0.1)
    rows, checkpoints = len(metric_rows(tmp_path)), sorted((tmp_path / "checkpoints").iterdir())
    time.sleep(3)
    assert len(metric_rows(tmp_path)) == rows
    assert sorted((tmp_path / "checkpoints").iterdir()) == checkpoints

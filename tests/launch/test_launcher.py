"""run_train.sh's launcher (bloomnative.launch.cli and .launch): its environment variables are
parsed, never evaluated; relative paths are the user's; an error restarting cannot fix ends the
job at once with its one line, while crashes are restarted; and no worker outlives its
launcher."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bloomnative.launch.cli import LaunchSettingError, LaunchSettings
from harness.launching import (
    SCENARIO_DIR,
    logged_rows,
    python_command,
    run,
    start,
    train_env,
    wait_for,
)
from harness.training import REPO, TINY_RUN, build_synthetic_corpus, flip_bytes, metric_rows

RUN_TRAIN = str(REPO / "run_train.sh")
LAUNCHED_WORKER = str(SCENARIO_DIR / "launched_worker_scenario.py")


def run_train_sh(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return run([RUN_TRAIN, *args], env=train_env(env), cwd=cwd, timeout=300, check=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["NPROC", "NNODES"])
def test_a_launcher_variable_is_parsed_never_run_by_the_shell(tmp_path, name):
    # Bash arithmetic runs the command in an array subscript: `$(( NPROC * NNODES ))` did.
    marker = tmp_path / "pwned"
    value = f"x[$(touch {marker})]"
    proc = run_train_sh([], tmp_path, **{name: value})
    expected = {
        "NPROC": "a whole number of processes per node, at least 1",
        "NNODES": "a whole number of nodes, at least 1, or an elastic range min:max with "
        "1 <= min <= max",
    }
    assert (proc.returncode, proc.stdout) == (2, "")
    line = f"run_train.sh: {name}={value!r}: expected {expected[name]}"
    assert proc.stderr.splitlines() == [line]
    assert not marker.exists()


@pytest.mark.parametrize(
    "env, named",
    [
        ({"NPROC": "abc"}, "NPROC='abc'"),  # was bash's "abc: unbound variable"
        ({"NPROC": "0"}, "NPROC='0'"),  # not parallelism.dp_shard's fault
        ({"NPROC": " 2"}, "NPROC=' 2'"),
        ({"NPROC": "２"}, "NPROC='２'"),  # a digit to int(), not a plain one
        ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS='-1'"),
        ({"MAX_RESTARTS": "3 "}, "MAX_RESTARTS='3 '"),
        ({"STOP_GRACE_S": "1.5"}, "STOP_GRACE_S='1.5'"),
        ({"STOP_GRACE_S": "0"}, "STOP_GRACE_S='0'"),
        ({"OMP_NUM_THREADS": "all"}, "OMP_NUM_THREADS='all'"),
        ({"NNODES": "0"}, "NNODES='0'"),
        ({"NNODES": "4:2"}, "NNODES='4:2'"),
        ({"NNODES": "2:x"}, "NNODES='2:x'"),
        ({"NNODES": "1:2:3"}, "NNODES='1:2:3'"),
        ({"NNODES": "2"}, "RDZV_ENDPOINT=''"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node0;reboot:29500"}, "RDZV_ENDPOINT='node0;reboot"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node0:65536"}, "RDZV_ENDPOINT='node0:65536': the port"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node0:0"}, "RDZV_ENDPOINT='node0:0': the port"),
        ({"RDZV_LAST_CALL_S": "0"}, "RDZV_LAST_CALL_S='0'"),
        ({"RDZV_LAST_CALL_S": "$(reboot)"}, "RDZV_LAST_CALL_S='$(reboot)'"),
        ({"RDZV_ID": "job 7"}, "RDZV_ID='job 7'"),
        ({"RDZV_ID": "x" * 129}, "RDZV_ID='xxx"),
        ({"SLURM_JOB_ID": "4;2"}, "SLURM_JOB_ID='4;2'"),
    ],
)
def test_a_malformed_launcher_variable_is_named(env, named):
    with pytest.raises(LaunchSettingError) as error:
        LaunchSettings.from_env(env)
    assert str(error.value).startswith(named) and "\n" not in str(error.value)


def test_a_rendezvous_host_that_does_not_resolve_is_one_line_before_anything_starts(
    monkeypatch, capsys
):
    """A mistyped RDZV_ENDPOINT host: exit 2 within seconds, before preflight or torchrun (the
    .invalid domain never resolves, RFC 2606)."""
    from bloomnative.launch import cli, preflight

    def preflight_must_not_run(*args, **kwargs):
        raise AssertionError("preflight ran")

    monkeypatch.setattr(preflight, "preflight", preflight_must_not_run)
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("RDZV_ENDPOINT", "node0.no-such-host.invalid:29500")
    started = time.monotonic()
    assert cli.main(["--config=configs/debug.toml"]) == 2
    assert time.monotonic() - started < cli.RESOLVE_TIMEOUT_S + 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "run_train.sh: RDZV_ENDPOINT='node0.no-such-host.invalid:29500': the host" in err[0]
    assert "does not resolve" in err[0] or "did not resolve" in err[0]


def test_a_rendezvous_host_that_resolves_passes():
    from bloomnative.launch.cli import check_rendezvous_host

    check_rendezvous_host("localhost:29500")
    check_rendezvous_host("127.0.0.1:29500")
    check_rendezvous_host("[::1]:29500")


def test_launcher_variables_become_torchrun_arguments_and_world_sizes():
    settings = LaunchSettings.from_env(
        {"NPROC": "4", "NNODES": "2:3", "RDZV_ENDPOINT": "node0:29500", "MAX_RESTARTS": "0"},
        cores=16,
    )
    assert settings.world_sizes() == [8, 12]
    assert settings.torchrun_args(node_wait_s=900) == [
        "--nnodes=2:3",
        "--rdzv-backend=bloomnative",
        "--rdzv-endpoint=node0:29500",
        "--rdzv-id=none",
        "--rdzv-conf=join_timeout=900,last_call_timeout=30",
        "--nproc-per-node=4",
        "--max-restarts=0",
    ]
    quick = LaunchSettings.from_env(
        {"NNODES": "1:2", "RDZV_ENDPOINT": "node0:29500", "RDZV_LAST_CALL_S": "5"}
    )
    assert "--rdzv-conf=join_timeout=600,last_call_timeout=5" in quick.torchrun_args(600)
    assert (settings.omp_threads, settings.stop_grace_s) == (4, 120)
    single = LaunchSettings.from_env({}, cores=2)
    assert single.torchrun_args(600) == ["--standalone", "--nproc-per-node=1", "--max-restarts=3"]
    assert single.world_sizes() == [1] and single.omp_threads == 2
    fixed = LaunchSettings.from_env({"NNODES": "2", "RDZV_ENDPOINT": "[fe80::1]:29500"})
    assert fixed.torchrun_args(600)[0] == "--nnodes=2" and fixed.world_sizes() == [2]
    assert "--rdzv-conf=join_timeout=600" in fixed.torchrun_args(600)  # no last call
    # The job's id: RDZV_ID, else Slurm's job id, else torchrun's default.
    assert fixed.job == "none@[fe80::1]:29500"
    slurm = {"NNODES": "2", "RDZV_ENDPOINT": "n0:29500", "SLURM_JOB_ID": "4242"}
    assert "--rdzv-id=4242" in LaunchSettings.from_env(slurm).torchrun_args(600)
    named = LaunchSettings.from_env(slurm | {"RDZV_ID": "bloom-7b1.run-2"})
    assert named.job == "bloom-7b1.run-2@n0:29500"


@pytest.mark.multiprocess
def test_relative_paths_are_relative_to_the_users_directory(tmp_path):
    """--config, the data and the dump folder, all relative, found from where the command ran,
    not from the repository (preflight then stops at the load_step the test asks for, which
    names what it found: a missing load_step is exit 2, as docs/checkpointing.md says)."""
    build_synthetic_corpus(str(tmp_path / "data" / "c_text_document"))
    (tmp_path / "my.toml").write_text(
        '[job]\ndump_folder = "run"\n[data]\nblend = ["data/c_text_document"]\n'
    )
    (tmp_path / "run" / "checkpoints" / "step-3").mkdir(parents=True)
    proc = run_train_sh(["--config", "my.toml", *TINY_RUN, "--checkpoint.load_step=4"], tmp_path)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.splitlines() == [
        "config error: checkpoint.load_step = 4: no complete checkpoint at "
        "run/checkpoints/step-4; the complete checkpoints there are steps 3 (set "
        "checkpoint.load_step to one of them, or -1 for the newest that verifies)"
    ]


def launch(args: list[str], max_restarts: int) -> subprocess.CompletedProcess:
    """bloomnative.launch.torchrun as run_train.sh runs it (torchrun's arguments, then the
    worker's), on 2 workers."""
    torchrun = [
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.05",
    ]
    command = python_command(["-m", "bloomnative.launch.torchrun", *torchrun, *args])
    return run(command, timeout=300, check=False)


@pytest.mark.multiprocess
def test_a_final_error_ends_the_job_with_its_line_once_and_a_crash_is_restarted(tmp_path):
    starts = tmp_path / "starts"
    proc = launch([LAUNCHED_WORKER, str(starts), "final"], max_restarts=3)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "checkpoint error: checkpoint.load_step = 7: planted by the test"
    ]
    ranks = starts.read_text().split()
    assert sorted(set(ranks)) == sorted(ranks) and set(ranks) <= {"0", "1"}  # started once
    starts.unlink()
    proc = launch([LAUNCHED_WORKER, str(starts), "crash"], max_restarts=1)
    assert proc.returncode == 1
    assert sorted(starts.read_text().split()) == ["0", "0", "1", "1"]  # 1 start + 1 restart


@pytest.mark.multiprocess  # the conftest's 2-process run, and 2 workers of run_train.sh
def test_run_train_sh_reports_a_checkpoint_that_fails_verification_once(fsdp_run, tmp_path):
    """The workers meet it (preflight only sees that the checkpoint is complete): exit 2, the
    one line once, no restart, no traceback. The run is resumed as a user would, from the
    config.toml it wrote."""
    dump = tmp_path / "run"
    shutil.copytree(fsdp_run[0], dump)
    flip_bytes(next((dump / "checkpoints" / "step-3").glob("*.distcp")))
    args = ["--config", "run/config.toml", "--job.dump_folder=run", "--training.steps=4"]
    started = time.monotonic()
    proc = run_train_sh([*args, "--checkpoint.load_step=3"], tmp_path, NPROC="2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("checkpoint error: checkpoint.load_step = 3: ")
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
def test_no_worker_outlives_its_launcher_killed_with_its_process_group(tmp_path, synthetic_corpus):
    """kill -9 of the launcher's process group (a closed terminal, a scheduler's hard kill):
    torchrun starts each worker in a session of its own, which the kill does not reach; the
    workers end with their launcher instead of training and saving on their own."""
    dump = tmp_path / "run"
    args = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--job.dump_folder={dump}",
        "--training.steps=100000",
        "--lr_scheduler.decay_steps=10",
        "--checkpoint.interval=2",
    ]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = start(
            [RUN_TRAIN, *args],
            env=train_env({"NPROC": "2"}),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,  # its own process group, as a terminal gives it
        )
    wait_for(lambda: logged_rows(dump) >= 3, proc, 180, "3 logged steps", log.read_text)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while processes_naming(str(dump)):
        assert time.monotonic() < deadline, processes_naming(str(dump))
        time.sleep(0.1)
    rows, checkpoints = len(metric_rows(dump)), sorted((dump / "checkpoints").iterdir())
    time.sleep(3)
    assert len(metric_rows(dump)) == rows
    assert sorted((dump / "checkpoints").iterdir()) == checkpoints

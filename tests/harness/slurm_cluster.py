"""A one-host Slurm cluster for the tests: Debian's Slurm (slurmctld, slurmd, the client
commands) and munge, installed with apt where missing, started as daemons of their own in a
folder of the test's, with their own ports and munge socket, and stopped afterwards (by the
process ids they wrote, nothing else)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.launching import run

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
PROGRAMS = ["slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel", "sinfo"]
CREDENTIAL_LIFETIME_S = 10
"""Slurm's cred_expire here: also about how long a requeued job is held (see `_config`)."""
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
"""The states of a job that has ended (a requeued one passes through none of them)."""


class SlurmUnavailable(Exception):
    """Slurm is missing and cannot be installed here (the reason is the message)."""


def ensure_installed() -> None:
    """Installs Debian's Slurm and munge with apt-get where one of their programs is missing."""
    if all(shutil.which(p) for p in PROGRAMS):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed, and installing it needs root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    if run(install, env=env, timeout=600, check=False).returncode != 0:
        run(["apt-get", "update", "-qq"], env=env, timeout=300, check=False)
        proc = run(install, env=env, timeout=600, check=False)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"apt-get could not install {PACKAGES}: {proc.stderr[-300:]}")
    missing = [p for p in PROGRAMS if not shutil.which(p)]
    if missing:
        raise SlurmUnavailable(f"{PACKAGES} installed, but {missing} are not on PATH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    folder: Path
    env: dict[str, str]
    """The environment the client commands (sbatch, scontrol, ...) need: SLURM_CONF."""

    def command(self, *args: str, timeout: float = 60) -> str:
        """Runs a Slurm client command to its end; its stdout."""
        return run(list(args), env=self.env, timeout=timeout).stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ...)."""
        text = self.command("scontrol", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def report(self, job_id: str, output: Path) -> str:
        """What a failed test needs to tell why: `scontrol show job`, the end of the job's
        output file and of slurmctld's and slurmd's logs."""
        job = run(["scontrol", "show", "job", job_id], env=self.env, timeout=60, check=False)
        parts = [f"scontrol show job {job_id}:\n{job.stdout}{job.stderr}"]
        for path in (output, self.folder / "slurmctld.log", self.folder / "slurmd.log"):
            text = path.read_text(errors="replace") if path.is_file() else "(missing)\n"
            parts.append(f"--- the end of {path}:\n{text[-6000:]}")
        return "\n".join(parts)

    def wait_for_job(self, job_id: str, done, timeout: float, what: str) -> dict[str, str]:
        """Polls the job until `done(fields)`; fails with its state on a timeout."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if done(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out ({timeout} s) waiting for {what}: {fields}")
            time.sleep(0.5)


def _config(folder: Path, host: str, ports: tuple[int, int]) -> str:
    return "\n".join(
        [
            "ClusterName=bloomnative-test",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire (default 120 s, at least 5) also sets how long Slurm holds a requeued
            # job (Reason BeginTime) before it may start again: slurmd refuses a launch whose
            # credential is not newer, in whole seconds, than the revocation of the job's
            # previous run ("Job credential revoked": the job ends FAILED). A shorter hold here,
            # which the test lets run out as a user's requeued job does.
            f"AuthInfo=socket={folder / 'munge.sock'},cred_expire={CREDENTIAL_LIFETIME_S}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            # No cgroups in a container: processes are tracked by parentage.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # Look at pending jobs every second (default: every 30 s for the backfill pass, 60 s
            # for the main one), so a requeued job starts as its hold ends.
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=30",
            "JobRequeue=1",
            f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
            "",
        ]
    )


@contextmanager
def slurm_cluster(folder: Path) -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd for this host, configured under `folder`, until the end of
    the `with` block."""
    ensure_installed()
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, host, (free_port(), free_port())))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pid_files = [folder / "munged.pid", folder / "slurmctld.pid", folder / "slurmd.pid"]
    try:
        munge = [
            "munged",
            "--force",  # as root, with a key of this test's
            f"--socket={folder / 'munge.sock'}",
            f"--key-file={key}",
            f"--pid-file={pid_files[0]}",
            f"--log-file={folder / 'munged.log'}",
            f"--seed-file={folder / 'munge.seed'}",
        ]
        run(munge, env=env, timeout=60)
        run(["slurmctld", "-i"], env=env, timeout=60)  # -i: no state from an earlier start
        run(["slurmd"], env=env, timeout=60)
        cluster = SlurmCluster(folder, env)
        deadline = time.monotonic() + 60
        while "idle" not in cluster.command("sinfo", "-h", "-o", "%t"):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the Slurm node did not come up: {(folder / 'slurmd.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        yield cluster
    finally:
        for pid_file in reversed(pid_files):
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass

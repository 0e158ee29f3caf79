"""One run per dump folder: `<dump_folder>/run.lock` names the process that trains there.

Two runs writing one dump folder overwrite each other's checkpoints and interleave their
metrics, so rank 0 takes the lock before anything is written, and a second run is refused with
one line naming the holder. The lock records the holder's host, pid, the time it started and,
to tell a live holder from a pid the system has since given to another process, the holder's
start time in the kernel's clock ticks since boot and the boot's id.

A lock left by a run that died without removing it (SIGKILL, a crashed node, torchrun's restart
after a failure) is stale and is taken over, with a line saying so: on the same host when its
pid is gone, or belongs to a process that started at another time, or the host has rebooted
since. A lock held from another host cannot be checked from here (its pid means nothing on
this one) and is not taken over, the message saying to delete it once that run is known to be
gone, unless it was taken by rank 0 of an earlier world of this same multi-node job (the lock
records the job's rendezvous id and endpoint, which the launcher passes on): torchrun stops a
world's workers before it gathers the next one, so that holder is gone, or cut off with a lost
node, and the job, shrunk to the nodes it has left, goes on. Checking and taking the lock happen
under an exclusive `flock` of the lock file, so two runs starting together cannot both take it
(where the file system supports flock; NFS maps it to its own locks).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from bloomnative.log import get_logger

_log = get_logger(__name__)

LOCK_FILE = "run.lock"
JOB_VAR = "BLOOMNATIVE_JOB"
"""Set by the launcher (launch/cli.py) for the workers of a multi-node job: `<rdzv id>@<rdzv
endpoint>`, which names the job among those that ever used the dump folder as long as its id
is unique (RDZV_ID, Slurm's job id by default)."""


class DumpFolderInUseError(RuntimeError):
    """Another live run holds the dump folder's lock."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """Process `pid`'s start time in clock ticks since boot (/proc/<pid>/stat), None if there
    is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (command) state ppid ...": the command may contain spaces and parentheses; the start
    # time is field 22, the 20th after the command.
    return int(stat.rpartition(")")[2].split()[19])


def this_process() -> dict:
    """The lock's content for this process (and, in a multi-node job, the job)."""
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "start_ticks": _start_ticks(os.getpid()),
        "boot_id": _boot_id(),
    }
    if job := os.environ.get(JOB_VAR, ""):
        holder["job"] = job
    return holder


def is_stale(holder: dict) -> bool:
    """Whether the run named by a lock on this host is gone: its pid is free, belongs to a process
    started at another time, or the host rebooted since. Never for another host's lock."""
    if holder.get("host") != socket.gethostname():
        return False
    if holder.get("boot_id") != _boot_id():
        return True
    ticks = _start_ticks(int(holder.get("pid", -1)))
    return ticks is None or ticks != holder.get("start_ticks")


def is_earlier_world_of_this_job(holder: dict) -> bool:
    """Whether a lock from another host was taken by rank 0 of an earlier world of this
    multi-node job: the same rendezvous id and endpoint."""
    job = os.environ.get(JOB_VAR, "")
    return bool(job) and holder.get("job") == job and holder.get("host") != socket.gethostname()


def describe(holder: dict) -> str:
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')} "
        f"(started {holder.get('started', 'at an unknown time')})"
    )


class RunLock:
    """The lock of one dump folder, taken by this process."""

    def __init__(self, dump_folder: Path):
        self.path = dump_folder / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        """Takes the lock, or raises DumpFolderInUseError naming its live holder. A stale lock is
        taken over with an info line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._exclusive() as f:
            holder = _read(f)
            if holder and holder.get("pid") != os.getpid():
                if is_stale(holder):
                    _log.info(
                        f"{self.path}: taking over the lock of {describe(holder)}, which is gone"
                    )
                elif is_earlier_world_of_this_job(holder):
                    _log.info(
                        f"{self.path}: taking over the lock of {describe(holder)}, rank 0 of an "
                        f"earlier world of this job ({holder['job']}), which "
                        "torchrun has stopped or lost"
                    )
                else:
                    raise DumpFolderInUseError(self._in_use(holder))
            f.seek(0)
            f.truncate()
            f.write(json.dumps(this_process()) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.held = True

    def release(self) -> None:
        """Removes the lock if this process holds it."""
        if not self.held:
            return
        self.held = False
        with self._exclusive() as f:
            holder = _read(f)
            if holder and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator:
        """The lock file, open and flock-ed. A holder that releases unlinks the file while
        another process may be waiting for its flock: that one then opens the path again."""
        while True:
            f = open(self.path, "a+")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        try:
            yield f
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()

    def _in_use(self, holder: dict) -> str:
        folder = self.path.parent
        if holder.get("host") == socket.gethostname():
            return (
                f"job.dump_folder {folder} is in use by another run, {describe(holder)}: two runs "
                f"in one dump folder overwrite each other's checkpoints; stop that run or choose "
                f"another job.dump_folder"
            )
        return (
            f"job.dump_folder {folder} is in use by a run on another host, {describe(holder)}, "
            f"which cannot be checked from here; if that run has ended (its host crashed), "
            f"delete {self.path}, else choose another job.dump_folder"
        )


def _read(f) -> dict | None:
    f.seek(0)
    text = f.read()
    if not text.strip():
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return None  # torn by a crash while it was written: nobody holds it
    return holder if isinstance(holder, dict) else None


def lock_dump_folder(dump_folder: Path) -> RunLock:
    """Collective: rank 0 takes the dump folder's lock and every rank learns the outcome, so a
    refusal raises DumpFolderInUseError on every rank with the same line."""
    lock = RunLock(dump_folder)
    outcome: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            lock.acquire()
        except DumpFolderInUseError as e:
            outcome[0] = str(e)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise DumpFolderInUseError(outcome[0])
    return lock

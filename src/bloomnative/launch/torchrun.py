"""`python -m bloomnative.launch.torchrun [--stop-grace-s S] TORCHRUN_ARGS`: torchrun, stoppable.

What run_train.sh runs. Left to itself, torchrun's agent turns SIGTERM and SIGINT into an
exception: it signals the workers, kills them 30 s later (by default) and exits 1 with a
traceback, even when the workers stopped cleanly (and SIGUSR1, which SLURM sends
before pre-empting, kills it outright). Here the agent leaves those signals alone
(`--signals-to-handle`) and this process takes them instead:

- the first SIGTERM, SIGINT or SIGUSR1 is passed on to the workers as SIGTERM: each finishes its
  step, saves a checkpoint and exits 0, so the agent ends normally and the command exits 0;
- further SIGTERMs change nothing; a second SIGINT (Ctrl-C twice) kills the workers at once;
- workers still running `--stop-grace-s` seconds (default 120) after the first signal are killed.
  A killed worker leaves no complete checkpoint behind (the newest complete one stays the
  newest), and the launcher exits 1.

The workers are this process's children (torchrun starts each in its own session, so a signal
sent to the launcher's process group reaches them only through here). Two more contracts bind
them to this process, through the environment it gives them:

- workers die with their launcher: each watches its parent (`exit_with_launcher`) and exits at
  once when this process is gone (`kill -9` of it, or of its process group), so no orphan keeps
  training and writing checkpoints into a dump folder that a restarted run then shares;
- an error restarting cannot fix (a configuration, data or checkpoint mistake, a disk without
  room for the next checkpoint, steps that stay non-finite, loss spikes that cannot be rolled
  back: `bloomnative.launch.worker.final_errors`; not a crash) is final: the worker hands its
  one-line message to this process (`report_final_error`), which stops every worker, prints
  the line once and exits 2 instead of letting torchrun restart the job `--max-restarts` times
  into the same error. Crashes and lost ranks are restarted as before.

A lost node (`bloomnative.launch.rendezvous`, the rendezvous backend `bloomnative`) is said in
words: the loss of the rendezvous store, or a node that does not rejoin in time, ends this
process with exit 3 and one line instead of torchrun's traceback. A first rendezvous that never
formed (its store not reached, or not every node joined) is no lost node: one line, exit 2.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bloomnative.log import LogSettingError, LogSettings, get_logger, setup_logging

_log = get_logger(__name__)

DEFAULT_GRACE_S = 120.0
_RESEND_S = 1.0

LAUNCHER_PID_VAR = "BLOOMNATIVE_LAUNCHER_PID"
"""Set for the workers: the launcher's pid, their parent while it lives."""
FINAL_ERRORS_VAR = "BLOOMNATIVE_FINAL_ERRORS"
"""Set for the workers: the folder where a worker leaves its final error's message."""
FINAL_ERROR_SIGNAL = signal.SIGUSR2
"""What a worker sends the launcher once its final error's message is written."""
NODE_LOST_EXIT = 3
"""The exit code after a lost node ended the job on this node (one line says which and what to
do)."""
_WATCH_S = 0.5
_KILL_WAIT_S = 5.0


def children(pid: int, zombies: bool = False) -> list[int]:
    """The live (and with `zombies`, the ended but not yet reaped) processes whose parent is
    `pid`, by ascending pid (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (command) state ppid ...": the command may contain spaces and parentheses.
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
        except OSError:
            continue  # exited meanwhile
        if int(ppid) == pid and (zombies or state != "Z"):
            found.append(int(stat.parent.name))
    return sorted(found)


def _running(pid: int) -> bool:
    """Whether child `pid` has not ended yet: not waitable, asked without reaping it (its
    Popen does that). A killed process with threads shows as a zombie before all of them end."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _signal_workers(sig: signal.Signals) -> None:
    for pid in children(os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class CleanStop:
    """Signal handling of the launcher process (see the module docstring)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.first: str | None = None
        self.done = threading.Event()  # set once the agent has returned
        self._deadline = 0.0

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.first is None:
            self.first = name
            self._deadline = time.monotonic() + self.grace_s
            _log.info(
                f"{name}: the workers finish their step, save a checkpoint and exit "
                f"(grace period {self.grace_s:g} s)"
            )
            threading.Thread(target=self._escort, daemon=True).start()
        elif signum == signal.SIGINT:
            self._kill("a second SIGINT")

    def _escort(self) -> None:
        """Keeps asking the workers to stop (a worker restarted meanwhile gets it too) until the
        grace period is over, then kills whatever is left."""
        while time.monotonic() < self._deadline:
            _signal_workers(signal.SIGTERM)
            if self.done.wait(_RESEND_S):
                return
        self._kill(f"the grace period of {self.grace_s:g} s")

    def _kill(self, why: str) -> None:
        if self.done.is_set():
            return
        _signal_workers(signal.SIGKILL)
        _log.info(f"workers killed after {why}; the newest complete checkpoint is intact")
        sys.stdout.flush()
        os._exit(1)


# ---------------------------------------------------------------- the workers' side


def _launcher_pid() -> int | None:
    """The launcher's pid when this process is one of its workers (its child), else None."""
    pid = os.environ.get(LAUNCHER_PID_VAR, "")
    return int(pid) if pid.isdigit() and int(pid) == os.getppid() else None


_watched_launcher: int | None = None


def launcher_gone() -> bool:
    """In a worker that `exit_with_launcher` watches: whether its launcher has ended."""
    return _watched_launcher is not None and os.getppid() != _watched_launcher


def exit_with_launcher() -> None:
    """In a worker: exits this process as soon as its launcher is gone (checked every 0.5 s by
    a daemon thread; orphaned, the worker's parent becomes another process). Does nothing
    outside the launcher (a plain `python -m bloomnative.launch.worker`, or bare torchrun): there
    nothing says the parent's death should end the run."""
    global _watched_launcher
    pid = _watched_launcher = _launcher_pid()
    if pid is None:
        return

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(_WATCH_S)
        print(
            f"[bloomnative] the launcher (pid {pid}) is gone: this worker (pid {os.getpid()}) "
            "stops now, without saving",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="bloomnative-launcher-watch", daemon=True).start()


def report_final_error(line: str) -> bool:
    """In a worker: hands `line`, the one-line message of an error restarting cannot fix, to the
    launcher, which prints it once and ends the job with exit code 2. Returns False outside the
    launcher (the caller prints the line itself)."""
    pid, folder = _launcher_pid(), os.environ.get(FINAL_ERRORS_VAR, "")
    if pid is None or not Path(folder).is_dir():
        return False
    path = Path(folder) / f"rank-{os.environ.get('RANK', '0')}"
    partial = path.with_suffix(".partial")
    partial.write_text(line)
    partial.rename(path)  # the launcher reads whole messages only
    os.kill(pid, FINAL_ERROR_SIGNAL)
    return True


# ---------------------------------------------------------------- the launcher's side


class FinalWorkerError(Exception):
    """Raised in the launcher's main thread, inside torchrun's agent, when a worker reports a
    final error: the agent then stops the workers and returns without a restart."""


class FinalErrors:
    """The launcher's end of `report_final_error`: a folder for the messages and the handler of
    FINAL_ERROR_SIGNAL."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="bloomnative-final-errors-"))
        self._raised = False

    def install(self) -> None:
        """Gives the workers to be started the folder and this process's pid, and catches the
        signal."""
        os.environ[LAUNCHER_PID_VAR] = str(os.getpid())
        os.environ[FINAL_ERRORS_VAR] = str(self.folder)
        signal.signal(FINAL_ERROR_SIGNAL, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self._raised:  # another worker's report: the first one already ends the job
            return
        self._raised = True
        # The others would meet the same error or wait for the reporter in a collective:
        # killed now, they are not restarted, and the agent has nothing left to stop.
        workers = children(os.getpid(), zombies=True)
        _signal_workers(signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise FinalWorkerError

    def messages(self) -> list[str]:
        """The distinct messages the workers left, by rank."""
        files = sorted(self.folder.glob("rank-*[0-9]"), key=lambda p: int(p.name[5:]))
        return list(dict.fromkeys(p.read_text() for p in files))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _run_torchrun(torchrun, argv: list[str]) -> int:
    """torchrun with final errors and lost nodes taken care of: 2 after a final error (its lines
    printed) or a first rendezvous that never formed (its line printed), NODE_LOST_EXIT after a
    lost node that ends the job here (its line printed), else 0."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from bloomnative.launch import rendezvous

    final = FinalErrors()
    final.install()
    rendezvous.register(
        workers_running=lambda: bool(children(os.getpid())), before_exit=final.remove
    )
    try:
        torchrun(argv)
    except FinalWorkerError:
        for line in final.messages():
            print(line, file=sys.stderr, flush=True)
        return 2
    except rendezvous.NodeLost as e:
        print(e, file=sys.stderr, flush=True)
        return NODE_LOST_EXIT
    except rendezvous.NoRendezvous as e:  # the job never formed: nothing to restart or resume
        print(e, file=sys.stderr, flush=True)
        return 2
    except (RendezvousConnectionError, DistNetworkError):
        endpoint = _watched_rendezvous_endpoint(argv)
        if endpoint is None:  # a single node's store, in this process: not a lost node
            raise
        print(rendezvous.store_lost_line(endpoint), file=sys.stderr, flush=True)
        return NODE_LOST_EXIT
    finally:
        final.remove()
    return 0


def _watched_rendezvous_endpoint(argv: list[str]) -> str | None:
    """RDZV_ENDPOINT when torchrun's arguments `argv` name the rendezvous backend `bloomnative`."""
    from torch.distributed.run import get_args_parser

    from bloomnative.launch.rendezvous import BACKEND

    args = get_args_parser().parse_known_args(argv)[0]
    return args.rdzv_endpoint if args.rdzv_backend == BACKEND else None


def main(argv: list[str]) -> int:
    """Exit codes: torchrun's (0: every worker exited 0, as after a clean stop), 1 workers killed
    at the end of the grace period, 2 a bad --stop-grace-s or BLOOMNATIVE_LOG_* variable, a
    worker's final error (`bloomnative.launch.worker.final_errors`) or a first rendezvous that
    never formed, 3 (NODE_LOST_EXIT) a lost node that ends the job here."""
    try:
        setup_logging(tag="bloomnative launcher", all_to_stderr=True)
    except LogSettingError as e:
        setup_logging(LogSettings(), tag="bloomnative launcher", all_to_stderr=True)
        _log.error(str(e))
        return 2
    grace = DEFAULT_GRACE_S
    if argv and argv[0].startswith("--stop-grace-s"):
        _, eq, value = argv[0].partition("=")
        value, argv = (value, argv[1:]) if eq else ((argv[1:2] or [""])[0], argv[2:])
        try:
            grace = float(value)
        except ValueError:
            grace = -1.0
        if not grace > 0:
            _log.error(
                f"--stop-grace-s (STOP_GRACE_S) must be a positive number of seconds, got {value!r}"
            )
            return 2
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun

    leave_signals = ["--signals-to-handle=SIGHUP,SIGQUIT"]
    if get_args_parser().parse_known_args([*leave_signals, "script"])[1]:
        _log.info(
            "this torch's torchrun handles SIGTERM itself (--signals-to-handle needs torch 2.9)"
        )
        return _run_torchrun(torchrun, argv)
    stop = CleanStop(grace)
    stop.install()
    try:
        code = _run_torchrun(torchrun, [*leave_signals, *argv])
    finally:
        stop.done.set()
    if stop.first is not None and code == 0:
        _log.info(f"stopped cleanly on {stop.first}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

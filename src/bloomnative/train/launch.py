"""`python -m bloomnative.train.launch [--stop-grace-s S] TORCHRUN_ARGS`: torchrun, stoppable.

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
sent to the launcher's process group reaches them only through here).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from bloomnative.log import LogSettingError, LogSettings, get_logger, setup_logging

_log = get_logger(__name__)

DEFAULT_GRACE_S = 120.0
_RESEND_S = 1.0


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`, by ascending pid (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (command) state ppid ...": the command may contain spaces and parentheses.
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
        except OSError:
            continue  # exited meanwhile
        if int(ppid) == pid and state != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


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


def main(argv: list[str]) -> int:
    """Exit codes: torchrun's (0: every worker exited 0, as after a clean stop), 1 workers killed
    at the end of the grace period, 2 a bad --stop-grace-s or BLOOMNATIVE_LOG_* variable."""
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
        torchrun(argv)
        return 0
    stop = CleanStop(grace)
    stop.install()
    try:
        torchrun([*leave_signals, *argv])
    finally:
        stop.done.set()
    if stop.first is not None:
        _log.info(f"stopped cleanly on {stop.first}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

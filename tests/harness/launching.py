"""How the tests start processes: the command line of a Python program as one process or as a
torchrun world, the environment a launched program gets, running one to its end, starting one in
the background and waiting on it.

Every test that launches a program goes through here and is marked `multiprocess`, which leaves
it out of the quick run (`-m "not multiprocess"`): under pytest, a test without the mark that
launches one fails, saying so (the conftest sets `launches_allowed` for each test). Tests that
only need what runs leave behind share their worlds (`shared_world.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HARNESS_DIR = TESTS / "harness"
SCENARIO_DIR = TESTS / "scenarios"
"""The programs tests run by path (tests/scenarios/__init__.py)."""

# Set by torchrun for its workers; a launched program must not inherit them from the test
# process (a test run under torchrun, or a worker's leftovers).
_LAUNCHER_VARS = {
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    # bloomnative's rendezvous backend sets it for torchrun's agent; inherited, it makes a
    # torchrun world's workers init their process groups on an unprefixed store
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
}

launches_allowed: str | None = None
"""Outside pytest None (launch freely); under it, the running test's id while it may launch
(it is marked `multiprocess`), else ""."""


def train_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without torchrun's variables, one thread per process (the
    2-core machines run several processes at once), the source tree and tests/ (for `harness`
    and `scenarios`) on PYTHONPATH, Python's stack dump on a crash (a segfault in a launched
    process shows where it was in its stderr); `extra` added."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    path = os.pathsep.join([str(REPO / "src"), str(TESTS)])
    fixed = {"OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"}
    return {**env, **fixed, **(extra or {})}


def python_command(program: Sequence[str], nproc: int = 0, max_restarts: int = 0) -> list[str]:
    """`python PROGRAM...` (PROGRAM: a script and its arguments, or `-m module ...`), or with
    `nproc` the same program as the workers of a torchrun world of that size on this host,
    which restarts the failed world up to `max_restarts` times."""
    if not nproc:
        return [sys.executable, *program]
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
    ]
    return [sys.executable, *torchrun, *program]


def run(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    check: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """Runs `command` to its end with its output captured (`env`: the whole environment,
    `train_env()` when None); `check`: a non-zero exit fails the test with the output."""
    _refuse_unless_allowed(command)
    proc = subprocess.run(
        list(command),
        env=train_env() if env is None else dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, command))}\nexited with {proc.returncode}\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def start(
    command: Sequence[str], *, env: Mapping[str, str] | None = None, **popen
) -> subprocess.Popen:
    """Starts `command` in the background (`env` as in `run`); `popen`: subprocess.Popen's
    other arguments (where the output goes, a session of its own)."""
    _refuse_unless_allowed(command)
    return subprocess.Popen(list(command), env=train_env() if env is None else dict(env), **popen)


def _refuse_unless_allowed(command: Sequence[str]) -> None:
    if launches_allowed == "":
        raise AssertionError(
            f"this test launches {' '.join(map(str, command[:4]))} ...: mark it (or the test "
            "whose set-up launches it) @pytest.mark.multiprocess, which keeps it out of the "
            "quick run"
        )


def wait_for(
    predicate: Callable[[], bool],
    proc: subprocess.Popen,
    timeout: float = 120,
    what: str = "the condition",
    output: Callable[[], str] | None = None,
) -> None:
    """Polls `predicate` until it holds. Fails the test (killing `proc` on a timeout) if `proc`
    exits first or `timeout` seconds pass; the message ends with `output()` when given, else
    with the end of `proc`'s stderr when it is a pipe and the process has exited."""
    deadline = time.monotonic() + timeout
    while not predicate():
        exited = proc.poll() is not None
        if exited or time.monotonic() > deadline:
            if not exited:
                proc.kill()
            problem = f"exited with {proc.returncode}" if exited else f"timed out ({timeout} s)"
            raise AssertionError(f"{problem} waiting for {what}\n{_tail(proc, output)}")
        time.sleep(0.05)


def _tail(proc: subprocess.Popen, output: Callable[[], str] | None) -> str:
    if output is not None:
        return output()[-4000:]
    if proc.stderr is None or proc.poll() is None:
        return ""
    text = proc.stderr.read()
    return (text if isinstance(text, str) else text.decode(errors="replace"))[-4000:]


def logged_rows(dump: Path) -> int:
    """How many lines the run in `dump` has written to its metrics.jsonl so far."""
    metrics = dump / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def only_stderr_line(capsys) -> str:
    """The one line an in-process entry point wrote to stderr (failing unless exactly one)."""
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line

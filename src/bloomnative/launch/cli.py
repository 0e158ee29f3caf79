"""`python -m bloomnative.launch.cli [--config FILE] [--section.key=value ...]`: what
run_train.sh runs, in the directory it was started from (relative paths are the user's).

Reads the launcher's settings from the environment, refuses a malformed one with one line naming
it, runs the preflight checks for every world size the job may have, then starts torchrun on
`bloomnative.launch.worker` through `bloomnative.launch.torchrun`, in this same process. The
variables are parsed here as text: none of them reaches a shell, an arithmetic expansion or
`eval`.

    NPROC           processes on this node (default 1)
    NNODES          nodes (default 1), or an elastic range min:max
    RDZV_ENDPOINT   host:port of the rendezvous, required when NNODES is not 1
    RDZV_ID         when NNODES is not 1: the job's id, the same on every node and unique among
                    the jobs that share an endpoint (default: SLURM_JOB_ID, else none)
    RDZV_LAST_CALL_S  with an elastic range: seconds the rendezvous waits for more nodes once
                    min have joined, at the start and after a node is lost (default 30)
    MAX_RESTARTS    restarts of the job after a crashed or lost rank (default 3)
    STOP_GRACE_S    seconds the workers get to save after SIGTERM/Ctrl-C (default 120)
    OMP_NUM_THREADS CPU threads per process (default: this machine's cores / NPROC, at least 1)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

_DIGITS = re.compile(r"[0-9]+")
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
RESOLVE_TIMEOUT_S = 10.0
"""How long the launcher waits for the rendezvous host's name to resolve."""
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")


class LaunchSettingError(ValueError):
    """A malformed launcher variable, named with what would be valid."""


def _whole(env: Mapping[str, str], name: str, default: int, least: int, what: str) -> int:
    text = env.get(name, "")
    if text == "":
        return default
    if not _DIGITS.fullmatch(text) or int(text) < least:
        raise LaunchSettingError(f"{name}={text!r}: expected {what}")
    return int(text)


@dataclass(frozen=True)
class LaunchSettings:
    """The launcher's environment variables, parsed and checked (see the module docstring)."""

    nproc: int = 1
    nnodes: tuple[int, int] = (1, 1)
    """(min, max) nodes; equal for a fixed number of nodes."""
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    """torchrun's --rdzv-id: the rendezvous keeps each job's state under it, and a restarted world
    recognises its own earlier lock by it (train/run_lock.py)."""
    max_restarts: int = 3
    stop_grace_s: int = 120
    omp_threads: int = 1
    rdzv_last_call_s: int = 30
    """With an elastic range: how long a rendezvous that has its minimum of nodes waits for more
    before it starts the job (torch's last_call_timeout, 30 s by default): at the start, and when
    the survivors of a lost node gather again."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, cores: int = 1) -> LaunchSettings:
        """Raises LaunchSettingError on the first malformed variable."""
        nproc = _whole(env, "NPROC", 1, 1, "a whole number of processes per node, at least 1")
        nnodes = _node_range(env.get("NNODES", "") or "1")
        endpoint = env.get("RDZV_ENDPOINT", "")
        if nnodes != (1, 1) and not _ENDPOINT.fullmatch(endpoint):
            raise LaunchSettingError(
                f"RDZV_ENDPOINT={endpoint!r}: a run on NNODES={env.get('NNODES')} nodes needs the "
                "rendezvous address as host:port (e.g. node0:29500)"
            )
        if endpoint and not 1 <= int(endpoint.rpartition(":")[2]) <= 65535:
            raise LaunchSettingError(
                f"RDZV_ENDPOINT={endpoint!r}: the port must be between 1 and 65535"
            )
        return cls(
            nproc=nproc,
            nnodes=nnodes,
            rdzv_endpoint=endpoint,
            rdzv_id=_job_id(env),
            max_restarts=_whole(env, "MAX_RESTARTS", 3, 0, "a whole number of restarts, 0 or more"),
            stop_grace_s=_whole(
                env, "STOP_GRACE_S", 120, 1, "a whole number of seconds, 1 or more"
            ),
            omp_threads=_whole(
                env, "OMP_NUM_THREADS", max(cores // nproc, 1), 1, "a whole number, 1 or more"
            ),
            rdzv_last_call_s=_whole(
                env, "RDZV_LAST_CALL_S", 30, 1, "a whole number of seconds, 1 or more"
            ),
        )

    @property
    def job(self) -> str:
        """This multi-node job, as its workers record it in the dump folder's lock: the id and
        the endpoint of its rendezvous."""
        return f"{self.rdzv_id}@{self.rdzv_endpoint}"

    def world_sizes(self) -> list[int]:
        """Every number of processes the job may have (one unless NNODES is a range)."""
        return [self.nproc * nodes for nodes in range(self.nnodes[0], self.nnodes[1] + 1)]

    def torchrun_args(self, node_wait_s: int) -> list[str]:
        """torchrun's arguments (for bloomnative.launch.torchrun, which knows the rendezvous
        backend `bloomnative`); `node_wait_s`: how long a rendezvous waits for every node
        (job.collective_timeout_s)."""
        if self.nnodes == (1, 1):
            rendezvous = ["--standalone"]
        else:
            low, high = self.nnodes
            nodes = str(low) if low == high else f"{low}:{high}"
            rendezvous = [
                f"--nnodes={nodes}",
                "--rdzv-backend=bloomnative",
                f"--rdzv-endpoint={self.rdzv_endpoint}",
                f"--rdzv-id={self.rdzv_id}",
            ]
            conf = f"join_timeout={node_wait_s}"  # one --rdzv-conf: torchrun keeps the last
            if low != high:
                conf += f",last_call_timeout={self.rdzv_last_call_s}"
            rendezvous.append(f"--rdzv-conf={conf}")
        return [
            *rendezvous,
            f"--nproc-per-node={self.nproc}",
            f"--max-restarts={self.max_restarts}",
        ]


def check_rendezvous_host(endpoint: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """The host of `endpoint` (host:port) resolves to an address within `timeout_s`, so that a
    mistyped name is said at once instead of as a rendezvous that never forms.

    Raises:
        LaunchSettingError: naming the host and what the resolver said.
    """
    host = endpoint.rpartition(":")[0].strip("[]")
    lookup = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:  # a thread: a resolver that hangs cannot be interrupted otherwise
        lookup.submit(socket.getaddrinfo, host, None).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise LaunchSettingError(
            f"RDZV_ENDPOINT={endpoint!r}: the host {host!r} did not resolve within "
            f"{timeout_s:.0f} s; give a name or address every node can resolve"
        ) from None
    except OSError as e:
        raise LaunchSettingError(
            f"RDZV_ENDPOINT={endpoint!r}: the host {host!r} does not resolve "
            f"({e.strerror or e}); give a name or address every node can resolve"
        ) from None
    finally:
        lookup.shutdown(wait=False)


def _job_id(env: Mapping[str, str]) -> str:
    name = "RDZV_ID" if env.get("RDZV_ID") else "SLURM_JOB_ID"
    text = env.get(name, "") or "none"
    if not _JOB_ID.fullmatch(text):
        raise LaunchSettingError(
            f"{name}={text!r}: expected a job id of letters, digits, '.', '_' or '-' (at most "
            "128), the same on every node"
        )
    return text


def _node_range(text: str) -> tuple[int, int]:
    low, colon, high = text.partition(":")
    if (
        _DIGITS.fullmatch(low)
        and (not colon or _DIGITS.fullmatch(high))
        and 1 <= int(low) <= int(high if colon else low)
    ):
        return int(low), int(high if colon else low)
    raise LaunchSettingError(
        f"NNODES={text!r}: expected a whole number of nodes, at least 1, or an elastic range "
        "min:max with 1 <= min <= max"
    )


@contextlib.contextmanager
def _launcher_cpp_log_level() -> Iterator[None]:
    """For the imports of torch in the launcher: its C++ warnings (socket errors with their stack
    frames when a node is lost) are not words for its user, so unless the user set
    TORCH_CPP_LOG_LEVEL it logs C++ errors only. torch reads the variable once, when it loads;
    the environment the workers inherit is left as it was, so they keep torch's default."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def main(argv: list[str]) -> int:
    """Exit codes: those of bloomnative.launch.torchrun; 2 also for a malformed variable or a
    preflight failure (before any worker starts)."""
    try:
        settings = LaunchSettings.from_env(cores=len(os.sched_getaffinity(0)))
        if settings.rdzv_endpoint:
            check_rendezvous_host(settings.rdzv_endpoint)
    except LaunchSettingError as e:
        print(f"run_train.sh: {e}", file=sys.stderr)
        return 2
    with _launcher_cpp_log_level():  # torch and the rest: after the check
        from bloomnative.launch import preflight, torchrun
        from bloomnative.train.run_lock import JOB_VAR
    config = preflight.preflight(argv, settings.world_sizes(), settings.nnodes)
    if config is None:
        return 2
    os.environ["OMP_NUM_THREADS"] = str(settings.omp_threads)
    if settings.nnodes != (1, 1):
        os.environ[JOB_VAR] = settings.job
    started = time.time()
    code = torchrun.main(
        [
            f"--stop-grace-s={settings.stop_grace_s}",
            *settings.torchrun_args(config.job.collective_timeout_s),
            "-m",
            "bloomnative.launch.worker",
            *argv,
        ]
    )
    if code and code != torchrun.NODE_LOST_EXIT:  # a collective that timed out: name the rank
        # that did not arrive (after a lost node, the launcher's line has said why)
        from bloomnative.launch import hang_report

        hang_report.report(argv, since=started)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

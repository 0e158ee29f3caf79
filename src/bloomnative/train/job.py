"""`python -m bloomnative.train.job [--config FILE] [--section.key=value ...]`: what
run_train.sh runs, in the directory it was started from (relative paths are the user's).

Reads the launcher's settings from the environment, refuses a malformed one with one line naming
it, runs the preflight checks for every world size the job may have, then starts torchrun on
`bloomnative.train.main` through `bloomnative.train.launch`, in this same process. The variables
are parsed here as text: none of them reaches a shell, an arithmetic expansion or `eval`.

    NPROC           processes on this node (default 1)
    NNODES          nodes (default 1), or an elastic range min:max
    RDZV_ENDPOINT   host:port of the rendezvous, required when NNODES is not 1
    RDZV_LAST_CALL_S  with an elastic range: seconds the rendezvous waits for more nodes once
                    min have joined, at the start and after a node is lost (default 30)
    MAX_RESTARTS    restarts of the job after a crashed or lost rank (default 3)
    STOP_GRACE_S    seconds the workers get to save after SIGTERM/Ctrl-C (default 120)
    OMP_NUM_THREADS CPU threads per process (default: this machine's cores / NPROC, at least 1)
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

RENDEZVOUS_VAR = "BLOOMNATIVE_RENDEZVOUS"
"""Set for the workers of a multi-node job: its rendezvous endpoint, which the dump folder's lock
records (train/run_lock.py: a restarted world may take over its earlier worlds' lock from
another host)."""
CPP_LOG_LEVEL_VAR = "TORCH_CPP_LOG_LEVEL"

_DIGITS = re.compile(r"[0-9]+")
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
        return cls(
            nproc=nproc,
            nnodes=nnodes,
            rdzv_endpoint=endpoint,
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

    def world_sizes(self) -> list[int]:
        """Every number of processes the job may have (one unless NNODES is a range)."""
        return [self.nproc * nodes for nodes in range(self.nnodes[0], self.nnodes[1] + 1)]

    def torchrun_args(self, node_wait_s: int) -> list[str]:
        """torchrun's arguments (for bloomnative.train.launch, which knows the rendezvous
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


def main(argv: list[str]) -> int:
    """Exit codes: those of bloomnative.train.launch; 2 also for a malformed variable or a
    preflight failure (before any worker starts)."""
    try:
        settings = LaunchSettings.from_env(cores=len(os.sched_getaffinity(0)))
    except LaunchSettingError as e:
        print(f"run_train.sh: {e}", file=sys.stderr)
        return 2
    # torch and the rest: after the check. The launcher's C++ warnings (socket errors with their
    # stack frames when a node is lost) are not words for its user: this process logs C++ errors
    # only unless its user set a level (torch reads it at import); its workers keep torch's.
    users_cpp_log_level = CPP_LOG_LEVEL_VAR in os.environ
    os.environ.setdefault(CPP_LOG_LEVEL_VAR, "ERROR")
    from bloomnative.config import parse_args
    from bloomnative.train import launch, preflight

    if not users_cpp_log_level:
        del os.environ[CPP_LOG_LEVEL_VAR]
    code = preflight.preflight(argv, settings.world_sizes(), settings.nnodes)
    if code:
        return code
    node_wait_s = parse_args(argv).job.collective_timeout_s
    os.environ["OMP_NUM_THREADS"] = str(settings.omp_threads)
    if settings.nnodes != (1, 1):
        os.environ[RENDEZVOUS_VAR] = settings.rdzv_endpoint
    started = time.time()
    code = launch.main(
        [
            f"--stop-grace-s={settings.stop_grace_s}",
            *settings.torchrun_args(node_wait_s),
            "-m",
            "bloomnative.train.main",
            *argv,
        ]
    )
    if code and code != launch.NODE_LOST_EXIT:  # a collective that timed out: name the rank
        # that did not arrive (after a lost node, the launcher's line has said why)
        from bloomnative.train import hang

        hang.report(argv, since=started)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

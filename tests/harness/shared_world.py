"""Several scenarios in one launch: the tests that only read what runs leave behind (losses,
checkpoints, output) add their runs to a `SharedWorld` and start one world of processes for all
of them, instead of one or a torchrun world each. Each scenario still runs as a process would:
`bloomnative.launch.worker.main(argv)` (the trainer's entry point) or a test's own function, with
its own output and exit code (tests/harness/world_runner.py, which the workers run, says how).

Tests of what the launcher, signals, restarts or a process's exit do keep launching their own
processes (`launching.py`).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.launching import HARNESS_DIR, python_command, run, train_env

RUNNER = HARNESS_DIR / "world_runner.py"
TRAIN = "bloomnative.launch.worker:main"


@dataclass(frozen=True)
class RankOutput:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class ScenarioResult:
    """What a scenario left, read like a finished process's: `returncode` (the first rank's
    that is not 0, else 0), `stdout` and `stderr` (rank 0's); `ranks` has every rank's."""

    name: str
    ranks: list[RankOutput]

    @property
    def returncode(self) -> int:
        return next((r.returncode for r in self.ranks if r.returncode), 0)

    @property
    def stdout(self) -> str:
        return self.ranks[0].stdout

    @property
    def stderr(self) -> str:
        return self.ranks[0].stderr


class SharedWorld:
    """Scenarios to run, in the order added, in one world of `nproc` torchrun workers (0: one
    plain process); their output goes under `out`/<name>."""

    def __init__(self, out: Path, nproc: int = 0):
        self.out, self.nproc = Path(out), nproc
        self.scenarios: list[dict] = []
        self.launch: subprocess.CompletedProcess | None = None

    def add(self, name: str, call: str, *args, expect: int = 0) -> None:
        """A scenario calling `call` (`module:function` or `path/file.py:function`) with
        `args` (JSON values) on every rank; `expect`: the exit code it should end with."""
        if any(s["name"] == name for s in self.scenarios):
            raise ValueError(f"two scenarios named {name!r}")
        self.scenarios.append({"name": name, "call": call, "args": list(args), "expect": expect})

    def train(self, name: str, argv: Sequence[str], expect: int = 0) -> None:
        """A scenario running the trainer's entry point with `argv`."""
        self.add(name, TRAIN, [str(a) for a in argv], expect=expect)

    def run(self, timeout: float = 900, env: Mapping[str, str] | None = None) -> SharedWorld:
        """Launches the world (once) and waits for it; `env`: added to `train_env()`'s."""
        if self.launch is not None:
            raise RuntimeError("a shared world runs once")
        self.out.mkdir(parents=True, exist_ok=True)
        spec = self.out / "world.json"
        spec.write_text(json.dumps({"out": str(self.out), "scenarios": self.scenarios}))
        command = python_command([str(RUNNER), str(spec)], nproc=self.nproc)
        self.launch = run(command, env=train_env(env), timeout=timeout, check=False)
        return self

    def result(self, name: str) -> ScenarioResult:
        """`name`'s outcome; fails the test if it did not end, on every rank, with the code it
        was expected to end with (with its output, or why the world stopped before it)."""
        (scenario,) = [s for s in self.scenarios if s["name"] == name]
        if self.launch is None:
            raise RuntimeError("run() the shared world first")
        folder = self.out / name
        ranks = []
        for rank in range(max(self.nproc, 1)):
            exit_file = folder / f"rank{rank}.exit"
            if not exit_file.is_file():
                raise AssertionError(
                    f"scenario {name!r} did not finish on rank {rank}: the world exited with "
                    f"{self.launch.returncode}{self._ended_by()}\n{self._output(folder, rank)}"
                    f"\nthe launcher's output:\n{self.launch.stderr[-4000:]}"
                )
            ranks.append(
                RankOutput(
                    int(exit_file.read_text()),
                    (folder / f"rank{rank}.out").read_text(),
                    (folder / f"rank{rank}.err").read_text(),
                )
            )
        result = ScenarioResult(name, ranks)
        for rank, output in enumerate(ranks):
            if output.returncode != scenario["expect"]:
                raise AssertionError(
                    f"scenario {name!r} exited with {output.returncode} on rank {rank} "
                    f"(expected {scenario['expect']})\n{self._output(folder, rank)}"
                )
        return result

    def results(self) -> dict[str, ScenarioResult]:
        """Every scenario's `result`, by name (failing on the first that did not end well)."""
        return {s["name"]: self.result(s["name"]) for s in self.scenarios}

    def _ended_by(self) -> str:
        """ ", ended by scenario X (exit code C on rank R)" and that rank's output (the cause;
        the rank that did not finish was most likely stopped by the launcher), for the first
        scenario that ended with a code it was not expected to end with."""
        for scenario in self.scenarios:
            folder = self.out / scenario["name"]
            for exit_file in sorted(folder.glob("rank*.exit")):
                code = int(exit_file.read_text())
                if code != scenario["expect"]:
                    rank = int(exit_file.stem.removeprefix("rank"))
                    return (
                        f", ended by scenario {scenario['name']!r} (exit {code} on rank {rank})"
                        f"\n{self._output(folder, rank)}\n"
                    )
        return ""

    @staticmethod
    def _output(folder: Path, rank: int) -> str:
        parts = []
        for suffix in ("out", "err"):
            path = folder / f"rank{rank}.{suffix}"
            if path.is_file():
                parts.append(f"--- rank {rank} std{suffix}:\n{path.read_text()[-4000:]}")
        return "\n".join(parts)

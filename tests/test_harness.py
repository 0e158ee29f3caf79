"""The test harness's own rules: tests launch programs only through launching.py (so a test that
launches one without the `multiprocess` mark fails, and the quick run stays quick), and a shared
world runs each scenario as a process of its own would run: in order, with its own output and
exit code, a failed rank ending the world."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from harness import launching
from harness.shared_world import SharedWorld

TESTS = Path(__file__).resolve().parent
# What starts a program; only launching.py does it. The programs the tests launch (runners,
# probes, checks) may start their own.
LAUNCH = re.compile(r"subprocess\.(run|Popen|call|check_call|check_output)\(|os\.system\(")
LAUNCHED_PROGRAMS = {"launching.py", "sm90_compile_check.py"}

SCENARIOS = textwrap.dedent(
    """
    import os
    import sys


    def say(text, code):
        print(text)
        os.write(2, f"{text} on fd 2\\n".encode())
        return code


    def fail_on_rank(rank, code):
        print(f"rank {os.environ['RANK']}")
        return code if os.environ["RANK"] == str(rank) else 0


    def boom():
        raise RuntimeError("boom")


    def leave():
        sys.exit(7)
    """
)


def test_tests_launch_programs_only_through_launching_py():
    found = [
        f"{path.relative_to(TESTS)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in LAUNCHED_PROGRAMS
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if LAUNCH.search(line)
    ]
    assert not found, f"launch through tests/harness/launching.py (run, start): {found}"


def test_a_test_without_the_mark_may_not_launch():
    with pytest.raises(AssertionError, match="mark it .*multiprocess"):
        launching.run(launching.python_command(["-c", "pass"]))


@pytest.fixture
def scenarios(tmp_path) -> str:
    path = tmp_path / "scenarios.py"
    path.write_text(SCENARIOS)
    return str(path)


@pytest.mark.multiprocess
def test_a_world_of_one_runs_every_scenario_with_its_output_and_exit_code(scenarios, tmp_path):
    world = SharedWorld(tmp_path / "world")
    world.add("first", f"{scenarios}:say", "one", 0)
    world.add("raises", f"{scenarios}:boom", expect=1)
    world.add("exits", f"{scenarios}:leave", expect=7)
    world.add("unexpected", f"{scenarios}:say", "two", 5)
    world.add("last", f"{scenarios}:say", "three", 0)
    world.run()
    first = world.result("first")
    assert (first.returncode, first.stdout, first.stderr) == (0, "one\n", "one on fd 2\n")
    assert 'RuntimeError("boom")' in world.result("raises").stderr
    assert world.result("exits").returncode == 7
    with pytest.raises(AssertionError, match="'unexpected' exited with 5 on rank 0 .expected 0"):
        world.result("unexpected")
    assert world.result("last").stdout == "three\n"  # a world of one goes on


@pytest.mark.multiprocess
def test_a_rank_that_fails_ends_its_world_and_says_which(scenarios, tmp_path):
    world = SharedWorld(tmp_path / "world", nproc=2)
    world.add("both", f"{scenarios}:fail_on_rank", 1, 0)
    world.add("rank1_fails", f"{scenarios}:fail_on_rank", 1, 3)
    world.add("never", f"{scenarios}:say", "not reached", 0)
    world.run()
    assert [r.stdout for r in world.result("both").ranks] == ["rank 0\n", "rank 1\n"]
    with pytest.raises(AssertionError, match="'rank1_fails' exited with 3 on rank 1"):
        world.result("rank1_fails")
    with pytest.raises(AssertionError, match="ended by scenario 'rank1_fails' .exit 3 on rank 1"):
        world.result("never")

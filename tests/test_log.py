"""bloomnative.log: which ranks reach the console, at which level, on which stream, the
per-rank files, and what a malformed BLOOMNATIVE_LOG_* variable does."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch.distributed as dist

from bloomnative.log import (
    BARE,
    ON_EVERY_RANK,
    LogSettingError,
    LogSettings,
    current_rank,
    get_logger,
    setup_logging,
)
from harness.launching import python_command, run, train_env


@pytest.fixture
def log(monkeypatch):
    """A bloomnative logger in a process of rank 0; the defaults set up again afterwards."""
    monkeypatch.delenv("RANK", raising=False)
    yield get_logger("bloomnative.test_log")
    setup_logging(LogSettings())


def test_the_console_shows_rank_0_and_what_a_rank_marks_as_its_own(log, capsys, monkeypatch):
    setup_logging(LogSettings())
    log.info("from rank 0")
    monkeypatch.setenv("RANK", "1")
    log.info("from rank 1")
    log.warning("a warning on rank 1")
    log.info("rank 1: out of memory", extra=ON_EVERY_RANK)
    out, err = capsys.readouterr()
    assert out == "[bloomnative] from rank 0\n[bloomnative] rank 1: out of memory\n"
    assert err == ""


def test_other_ranks_on_request_tagged_with_their_rank(log, capsys, monkeypatch):
    setup_logging(LogSettings.from_env({"BLOOMNATIVE_LOG_RANKS": "0,3"}))
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        log.info("hello")
    assert capsys.readouterr().out == "[bloomnative rank 0] hello\n[bloomnative rank 3] hello\n"
    setup_logging(LogSettings.from_env({"BLOOMNATIVE_LOG_RANKS": "all"}))
    log.info("hello")
    assert capsys.readouterr().out == "[bloomnative rank 3] hello\n"


def test_levels_streams_and_bare_lines(log, capsys):
    setup_logging(LogSettings())
    log.debug("detail")
    log.info("news")
    log.info("step 1 | loss 2.0000", extra=BARE)
    log.warning("careful")
    out, err = capsys.readouterr()
    assert out == "[bloomnative] news\nstep 1 | loss 2.0000\n"
    assert err == "[bloomnative] WARNING: careful\n"
    setup_logging(LogSettings.from_env({"BLOOMNATIVE_LOG_LEVEL": "DEBUG"}))
    log.debug("detail")
    assert capsys.readouterr().out == "[bloomnative] DEBUG: detail\n"
    setup_logging(LogSettings.from_env({"BLOOMNATIVE_LOG_LEVEL": "warning"}))
    log.info("news")
    log.error("broken")
    assert capsys.readouterr() == ("", "[bloomnative] ERROR: broken\n")
    setup_logging(LogSettings(), tag="bloomnative launcher", all_to_stderr=True)
    log.info("news")
    assert capsys.readouterr() == ("", "[bloomnative launcher] news\n")


def test_each_rank_writes_its_own_file_whatever_the_console_shows(log, capsys, tmp_path):
    settings = LogSettings.from_env({"BLOOMNATIVE_LOG_DIR": str(tmp_path / "logs")})
    for rank in (0, 1):  # as two processes would: each sets up with its own RANK
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RANK", str(rank))
            setup_logging(settings)
            log.info(f"hello from rank {rank}")
            log.debug("not at the info level")
    assert capsys.readouterr().out == "[bloomnative] hello from rank 0\n"
    setup_logging(LogSettings())  # closes the files
    for rank in (0, 1):
        lines = (tmp_path / "logs" / f"rank-{rank}.log").read_text().splitlines()
        assert len(lines) == 1
        assert re.fullmatch(
            rf"\d{{4}}-\d\d-\d\d [\d:,]+ INFO bloomnative\.test_log: hello from rank {rank}",
            lines[0],
        )


def test_the_rank_of_a_process_group_wins_over_torchruns_variable(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    assert current_rank() == 7
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert current_rank() == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "variable, value",
    [
        ("BLOOMNATIVE_LOG_LEVEL", "loud"),
        ("BLOOMNATIVE_LOG_RANKS", "first"),
        ("BLOOMNATIVE_LOG_RANKS", "-1"),
        ("BLOOMNATIVE_LOG_RANKS", "0,,1"),
    ],
)
def test_a_malformed_variable_is_named_with_what_is_valid(variable, value):
    with pytest.raises(LogSettingError, match=rf"^{variable} = '{re.escape(value)}': use "):
        LogSettings.from_env({variable: value})


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return run(python_command(["-c", code]), env=train_env(env), timeout=120, check=False)


@pytest.mark.multiprocess
def test_the_first_record_sets_logging_up_from_the_environment():
    code = "from bloomnative.log import get_logger; log = get_logger('x')\nlog.info('a')\n"
    code += "log.warning('b')"
    default = _python(code)
    assert (default.stdout, default.stderr) == ("[bloomnative] a\n", "[bloomnative] WARNING: b\n")
    quiet = _python(code, BLOOMNATIVE_LOG_LEVEL="warning")
    assert (quiet.stdout, quiet.stderr) == ("", "[bloomnative] WARNING: b\n")
    malformed = _python(code, BLOOMNATIVE_LOG_LEVEL="loud")
    assert malformed.stdout == "[bloomnative] a\n"
    assert malformed.stderr == (
        "[bloomnative] WARNING: BLOOMNATIVE_LOG_LEVEL = 'loud': use one of debug, info, warning, "
        "error; logging with the defaults\n[bloomnative] WARNING: b\n"
    )


@pytest.mark.multiprocess
def test_the_launcher_refuses_a_malformed_variable_before_starting_workers():
    launcher = ["-m", "bloomnative.launch.torchrun", "--standalone", "--nproc-per-node=1"]
    proc = run(
        python_command([*launcher, "-m", "bloomnative.launch.worker"]),
        env=train_env({"BLOOMNATIVE_LOG_RANKS": "rank0"}),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        "[bloomnative launcher] ERROR: BLOOMNATIVE_LOG_RANKS = 'rank0': use all, or ranks "
        "separated by commas (0,3)\n"
    )


@pytest.mark.multiprocess
def test_a_two_rank_run_shows_rank_0_and_keeps_every_rank_in_its_file(fsdp_run):
    """The conftest's 2-process run (BLOOMNATIVE_LOG_DIR set): both ranks write the trace and say
    so; the console has rank 0's line only, each rank's file its own. The console is what it was
    before the logger: the metric rows bare, every other line of the trainer tagged."""
    dump, stdout = fsdp_run
    said = f"profiling: wrote the trace of steps-2-3 to {dump / 'profile' / 'steps-2-3'}"
    assert stdout.count(said) == 1
    files = {rank: (dump / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1)}
    assert all(said in text for text in files.values())
    rows = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert [row.split(" | ")[0] for row in rows] == ["step 1", "step 2", "step 3"]
    assert all(row in files[0] for row in rows) and "step 1 |" not in files[1]
    sample = stdout.splitlines().index(next(s for s in stdout.splitlines() if "sample from" in s))
    tagged = [line for line in stdout.splitlines()[: sample + 1] if line not in rows]
    assert tagged and all(line.startswith("[bloomnative] ") for line in tagged)

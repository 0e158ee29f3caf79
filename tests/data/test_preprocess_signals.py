"""tools/preprocess_data.py stopped by SIGTERM (a scheduler, `kill`): its worker pool ends with
it and no partial output is left."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness.launching import REPO, python_command, start, wait_for

TOKENIZER = str(REPO / "assets" / "pydocs" / "tokenizer.json")


def live_processes(parent: int | None = None, group: int | None = None) -> list[int]:
    """The live (not zombie) processes whose parent is `parent` and whose process group is
    `group`, each when given (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgid = stat.read_text().rpartition(")")[2].split()[:3]
        except OSError:
            continue
        if state != "Z" and parent in (None, int(ppid)) and group in (None, int(pgid)):
            found.append(int(stat.parent.name))
    return found


def open_for_writing(fifo: Path, proc: subprocess.Popen) -> int:
    """The write end of `fifo`, once `proc` has opened its read end."""
    opened: list[int] = []

    def reader_is_there() -> bool:
        try:
            opened.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        return bool(opened)

    wait_for(reader_is_there, proc, 120, f"{fifo} to be opened")
    os.set_blocking(opened[0], True)
    return opened[0]


@pytest.mark.multiprocess
def test_sigterm_ends_the_worker_pool_and_writes_nothing(tmp_path):
    """The input is a pipe the test writes: the signal lands while the tool waits for more
    input, and the lines written after it are still to be encoded, however fast the machine."""
    line = json.dumps({"text": " ".join(["def class return import the quick brown fox"] * 40)})
    lines = ((line + "\n") * 2_000).encode()
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    command = python_command(
        [
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(fifo),
            "--tokenizer",
            TOKENIZER,
            "--output-prefix",
            str(tmp_path / "out"),
            "--workers",
            "2",
        ]  # fmt: skip
    )
    proc = start(
        command,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: what is left of it can be found
    )
    with os.fdopen(open_for_writing(fifo, proc), "wb") as pipe:
        pipe.write(lines)
        pipe.flush()
        wait_for(lambda: len(live_processes(parent=proc.pid)) >= 2, proc, 120, "the worker pool")
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(BrokenPipeError):  # the tool may stop before reading them
            pipe.write(lines)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "preprocess_data: stopped by SIGTERM; nothing was written"
    deadline = time.monotonic() + 10
    while left := live_processes(group=proc.pid):
        assert time.monotonic() < deadline, f"processes left: {left}"
        time.sleep(0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]

"""tools/preprocess_data.py stopped by SIGTERM (a scheduler, `kill`): its worker pool ends with
it and no partial output is left."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launching import REPO, python_command, start, wait_for

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


@pytest.mark.multiprocess
def test_sigterm_ends_the_worker_pool_and_writes_nothing(tmp_path):
    # ~25 MB of JSON lines: seconds of tokenizing for two workers, so the signal lands mid-run.
    line = json.dumps({"text": " ".join(["def class return import the quick brown fox"] * 40)})
    (tmp_path / "in.jsonl").write_text((line + "\n") * 70_000)
    command = python_command(
        [
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(tmp_path / "in.jsonl"),
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
    wait_for(lambda: len(live_processes(parent=proc.pid)) >= 2, proc, 120, "the worker pool")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "preprocess_data: stopped by SIGTERM; nothing was written"
    deadline = time.monotonic() + 10
    while left := live_processes(group=proc.pid):
        assert time.monotonic() < deadline, f"processes left: {left}"
        time.sleep(0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]

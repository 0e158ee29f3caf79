"""tools/preprocess_data.py stopped by SIGTERM (a scheduler, `kill`): its worker pool ends with
it and no partial output is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(REPO / "assets" / "pydocs" / "tokenizer.json")


def live_children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def test_sigterm_ends_the_worker_pool_and_writes_nothing(tmp_path):
    # ~25 MB of JSON lines: seconds of tokenizing for two workers, so the signal lands mid-run.
    line = json.dumps({"text": " ".join(["def class return import the quick brown fox"] * 40)})
    (tmp_path / "in.jsonl").write_text((line + "\n") * 70_000)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(tmp_path / "in.jsonl"),
            "--tokenizer",
            TOKENIZER,
            "--output-prefix",
            str(tmp_path / "out"),
            "--workers",
            "2",
        ],  # fmt: skip
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: what is left of it can be found
    )
    deadline = time.monotonic() + 120
    while len(live_children(proc.pid)) < 2:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the worker pool did not start"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "preprocess_data: stopped by SIGTERM; nothing was written"
    deadline = time.monotonic() + 10
    while left := subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout:
        assert time.monotonic() < deadline, f"processes left: {left.split()}"
        time.sleep(0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    assert os.path.exists(tmp_path / "in.jsonl")

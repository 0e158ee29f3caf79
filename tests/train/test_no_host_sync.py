"""The step loop never makes the host wait for the device between log steps: the loss, the
gradient norm and the non-finite counters are read back only when a log step prints them.

On CUDA each such readback would stall the CPU until the GPU drains its queue, leaving the GPU
idle while the next step's kernels are being launched. The probe records every syncing aten op
the real trainer runs (on CPU, where they are visible to a dispatch mode and cost nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training_helpers import TINY_RUN, train_env

PROBE = Path(__file__).with_name("host_sync_probe.py")
# The stop check reads a flag that lives on the CPU by construction (a gloo all-reduce), and so
# do the checkpointer's verdicts on a save (gathered over its gloo group after the run).
CPU_BY_DESIGN = {"train/faults.py:should_stop", "checkpoint/checkpointer.py:_all_problems"}


def recorded_syncs(tmp_path, corpus: str, *extra: str, nproc: int = 0) -> list[dict]:
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv = [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={tmp_path / 'run'}",
        "--checkpoint.enable=false",
        "--training.steps=6",
        "--metrics.log_freq=3",
        *extra,
    ]
    proc = subprocess.run(
        [*launcher, str(PROBE), *argv],
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("SYNCS:"))
    return json.loads(line.removeprefix("SYNCS:"))


def unexpected(records: list[dict], from_step: int = 0) -> list[dict]:
    return [
        r
        for r in records
        if r["step"] >= from_step and not r["reading_metrics"] and r["where"] not in CPU_BY_DESIGN
    ]


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (0, []),
        (2, []),  # FSDP2 over both ranks
        (2, ["--parallelism.tp=2"]),
        (2, ["--parallelism.pp=2"]),
        (0, ["--spikes.enable=true", "--checkpoint.enable=true"]),  # the spike detector too
    ],
    ids=["one-process", "fsdp2", "tp2", "pp2", "spike-detection"],
)
def test_no_device_readback_between_log_steps(tmp_path, synthetic_corpus, nproc, layout):
    args = ["--optimizer.implementation=fused", *layout]
    records = recorded_syncs(tmp_path, synthetic_corpus, *args, nproc=nproc)
    # The first step does one-time set-up that may read back: the pipeline schedule exchanges
    # activation shapes between stages (torch's recv_object_list) when it first runs.
    assert unexpected(records, from_step=1) == []
    # The probe sees the readbacks the log steps do make (1, 3 and 6), so it is looking.
    assert {r["step"] for r in records if r["reading_metrics"]} == {1, 3, 6}


def test_the_probe_catches_a_per_step_readback(tmp_path, synthetic_corpus):
    # foreach AdamW has no found_inf input, so the skip decision (and the learning rate with it)
    # is read on the host every step; the non-capturable foreach kernel then reads its own step
    # counters (within _step_at).
    records = recorded_syncs(tmp_path, synthetic_corpus, "--optimizer.implementation=foreach")
    caught = unexpected(records)
    assert {r["where"] for r in caught} == {
        "train/nonfinite.py:step",
        "train/nonfinite.py:_step_at",
    }
    assert {r["step"] for r in caught} == set(range(6))

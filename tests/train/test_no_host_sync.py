"""The step loop never makes the host wait for the device between log steps: the loss, the
gradient norm and the non-finite counters are read back only when a log step prints them.

On CUDA each such readback would stall the CPU until the GPU drains its queue, leaving the GPU
idle while the next step's kernels are being launched. The probe records every syncing aten op
the real trainer runs (on CPU, where they are visible to a dispatch mode and cost nothing)."""

from __future__ import annotations

import json

import pytest

from harness.launching import SCENARIO_DIR
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN

RECORD_SYNCS = f"{SCENARIO_DIR / 'host_sync_scenario.py'}:record_syncs"
# The stop check reads a flag that lives on the CPU by construction (a gloo all-reduce), and so
# do the checkpointer's verdicts on a save (gathered over its gloo group after the run).
CPU_BY_DESIGN = {"train/faults.py:should_stop", "checkpoint/checkpointer.py:_all_problems"}
# name -> (world size, trainer options): the cases that check the step loop, and one that
# checks the probe.
CASES = {
    "one-process": (0, ["--optimizer.implementation=fused"]),
    "spike-detection": (  # the spike detector too
        0,
        ["--optimizer.implementation=fused", "--spikes.enable=true", "--checkpoint.enable=true"],
    ),
    "per-step-readback": (0, ["--optimizer.implementation=foreach"]),
    "fsdp2": (2, ["--optimizer.implementation=fused"]),  # FSDP2 over both ranks
    "tp2": (2, ["--optimizer.implementation=fused", "--parallelism.tp=2"]),
    "pp2": (2, ["--optimizer.implementation=fused", "--parallelism.pp=2"]),
}


@pytest.fixture(scope="module")
def recorded(synthetic_corpus, tmp_path_factory) -> dict[str, list[dict]]:
    """Every case's records: one shared world per world size."""
    out = tmp_path_factory.mktemp("host_sync")
    worlds = {nproc: SharedWorld(out / f"world{nproc}", nproc) for nproc, _ in CASES.values()}
    for name, (nproc, options) in CASES.items():
        argv = [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            f"--job.dump_folder={out / name}",
            "--checkpoint.enable=false",
            "--training.steps=6",
            "--metrics.log_freq=3",
            *options,
        ]
        worlds[nproc].add(name, RECORD_SYNCS, argv)
    for world in worlds.values():
        world.run()
    records = {}
    for name, (nproc, _) in CASES.items():
        stdout = worlds[nproc].result(name).stdout
        line = next(s for s in stdout.splitlines() if s.startswith("SYNCS:"))
        records[name] = json.loads(line.removeprefix("SYNCS:"))
    return records


def unexpected(records: list[dict], from_step: int = 0) -> list[dict]:
    return [
        r
        for r in records
        if r["step"] >= from_step and not r["reading_metrics"] and r["where"] not in CPU_BY_DESIGN
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["one-process", "fsdp2", "tp2", "pp2", "spike-detection"])
def test_no_device_readback_between_log_steps(recorded, case):
    records = recorded[case]
    # The first step does one-time set-up that may read back: the pipeline schedule exchanges
    # activation shapes between stages (torch's recv_object_list) when it first runs.
    assert unexpected(records, from_step=1) == []
    # The probe sees the readbacks the log steps do make (1, 3 and 6), so it is looking.
    assert {r["step"] for r in records if r["reading_metrics"]} == {1, 3, 6}


@pytest.mark.multiprocess
def test_the_probe_catches_a_per_step_readback(recorded):
    # foreach AdamW has no found_inf input, so the skip decision (and the learning rate with it)
    # is read on the host every step; the non-capturable foreach kernel then reads its own step
    # counters (within _step_at).
    caught = unexpected(recorded["per-step-readback"])
    assert {r["where"] for r in caught} == {
        "train/nonfinite.py:step",
        "train/nonfinite.py:_step_at",
    }
    assert {r["step"] for r in caught} == set(range(6))

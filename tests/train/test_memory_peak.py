"""`mem_peak_gib` is the peak since the previous log row, the largest over the ranks: an
interval in which one rank needs much more memory shows it, and the next interval drops back.
On CPU the peak is the resident set's, measured without lowering the process's own peak
counter (VmHWM, which /usr/bin/time -v and cluster accounting read): an interval that raised
VmHWM reports it, another the resident set sampled during the interval."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from bloomnative.train.metrics import PeakMemory, process_peak_rss_bytes
from harness.launching import SCENARIO_DIR, python_command, run
from harness.training import TINY_RUN, metric_rows

ALLOCATE_IN_STEP = SCENARIO_DIR / "allocate_in_step_scenario.py"
HELD_MIB = 512

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(),
    reason="the resident set is read from /proc/self (Linux)",
)


def hold(mib: int) -> None:
    """Holds `mib` MiB of written (resident) memory for a few of PeakMemory's samples."""
    held = torch.ones(mib * 2**20 // 4)
    time.sleep(5 * PeakMemory.SAMPLE_SECONDS)
    del held


def test_each_interval_reports_its_own_peak_on_cpu():
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    hold(HELD_MIB)
    busy = memory.interval_peak_gib()
    quiet = memory.interval_peak_gib()
    assert busy - quiet > 0.9 * HELD_MIB / 1024, (busy, quiet)


def test_an_interval_below_the_process_peak_reports_its_sampled_peak():
    """The process peaked earlier (at 2 x HELD_MIB more): the interval's peak is not VmHWM
    but what it held itself."""
    hold(2 * HELD_MIB)
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    hold(HELD_MIB)
    read = memory.read()
    busy = memory.interval_peak_gib()
    quiet = memory.interval_peak_gib()
    assert read["peak_rss_exact"] is False
    assert read["process_peak_rss_gib"] - busy > 0.9 * HELD_MIB / 1024, read
    assert busy - quiet > 0.9 * HELD_MIB / 1024, (busy, quiet)


def test_reading_intervals_leaves_the_process_peak_as_it_is():
    """VmHWM is what /usr/bin/time -v and cluster accounting report: PeakMemory only reads it
    (it used to reset it through /proc/self/clear_refs, lowering their figure)."""
    hold(HELD_MIB)
    process_peak = process_peak_rss_bytes()
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    memory.interval_peak_gib()
    memory.interval_peak_gib()
    assert process_peak_rss_bytes() >= process_peak


@pytest.mark.multiprocess
def test_mem_peak_gib_is_the_peak_since_the_last_row_over_all_ranks(tmp_path, synthetic_corpus):
    """Rank 1 holds 512 MiB during step 2 only; rank 0 writes the rows. Its process keeps that
    peak to the end (VmHWM: the trainer does not reset it)."""
    args = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        "--training.steps=3",
        "--parallelism.dp_shard=2",
        "--checkpoint.enable=false",
        f"--job.dump_folder={tmp_path}",
    ]
    run(python_command([str(ALLOCATE_IN_STEP), "1", "2", str(HELD_MIB), *args], nproc=2))
    peak = {row["step"]: row["mem_peak_gib"] for row in metric_rows(tmp_path)}
    held = 0.9 * HELD_MIB / 1024
    assert sorted(peak) == [1, 2, 3]
    assert peak[2] - peak[1] > held and peak[2] - peak[3] > held, peak
    rank1_process_peak = int((tmp_path / "vmhwm-rank1.txt").read_text()) / 2**30
    assert rank1_process_peak >= peak[2], (rank1_process_peak, peak)

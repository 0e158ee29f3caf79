"""`mem_peak_gib` is the peak since the previous log row, the largest over the ranks: an
interval in which one rank needs much more memory shows it, and the next interval drops back.
On CPU the peak is the resident set's (VmHWM, reset through /proc/self/clear_refs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bloomnative.train.metrics import PeakMemory
from harness.launching import SCENARIO_DIR, python_command, run
from harness.training import TINY_RUN, metric_rows

ALLOCATE_IN_STEP = SCENARIO_DIR / "allocate_in_step_scenario.py"
HELD_MIB = 512


def _peak_rss_resets() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not _peak_rss_resets(),
    reason="the peak resident set cannot be reset here (no writable /proc/self/clear_refs)",
)


def test_each_interval_reports_its_own_peak_on_cpu():
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    held = torch.ones(HELD_MIB * 2**20 // 4)
    del held
    busy = memory.interval_peak_gib()
    quiet = memory.interval_peak_gib()
    assert busy - quiet > 0.9 * HELD_MIB / 1024, (busy, quiet)


@pytest.mark.multiprocess
def test_mem_peak_gib_is_the_peak_since_the_last_row_over_all_ranks(tmp_path, synthetic_corpus):
    """Rank 1 holds 512 MiB during step 2 only; rank 0 writes the rows."""
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

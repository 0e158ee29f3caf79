"""tools/gpu_smoke.py (the GPU acceptance's first phase) runs end to end on CPU with --tiny: the
kernels in Triton's interpreter against float64, compiled against eager, and the three training
runs through run_train.sh (eager, compiled, resumed). A GPU's minutes are too scarce to find a
broken script on it."""

import json
import os
from pathlib import Path

import pytest

from harness.kernel_checks import NEEDS_TRITON, TEST_DEVICE
from harness.launching import python_command, run

REPO = Path(__file__).resolve().parents[2]


@NEEDS_TRITON
@pytest.mark.multiprocess
@pytest.mark.skipif(TEST_DEVICE == "cuda", reason="on a GPU, run the smoke phase itself")
def test_gpu_smoke_tiny_passes_every_check_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "TRITON_INTERPRET": "1"}
    smoke = [str(REPO / "tools" / "gpu_smoke.py"), "--tiny", "--out", str(tmp_path)]
    proc = run(python_command(smoke), env=env, timeout=900, check=False)
    report = json.loads((tmp_path / "smoke.json").read_text())
    failed = {name: section for name, section in report.items() if not section["ok"]}
    assert proc.returncode == 0 and not failed, (proc.stdout, failed)
    assert set(report) == {"versions", "kernels", "compiled", "training"}
    assert report["versions"]["triton_kernels"] is True
    losses = report["training"]["losses"]
    assert len(losses["eager"]) == len(losses["compiled"]) == 6 and len(losses["resumed"]) == 3

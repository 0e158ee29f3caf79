"""The Triton kernels compile for an H100 (sm_90) with Triton's real compiler, without spills.

The interpreter tests check the math; this checks what the interpreter cannot: that Triton's
compiler accepts every kernel as the GPU would specialize it, and that ptxas fits the first
(autotuner default) config of each in registers. See sm90_compile_check.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("sm90_compile_check.py")
BIN_DIR = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

EXPECTED_KERNELS = {
    "_flash_alibi_fwd_kernel",
    "_flash_alibi_bwd_preprocess_kernel",
    "_flash_alibi_bwd_dkdv_kernel",
    "_flash_alibi_bwd_dq_kernel",
    "_layer_norm_fwd_kernel",
    "_layer_norm_bwd_kernel",
    "_bias_gelu_fwd_kernel",
    "_bias_gelu_bwd_kernel",
    "_row_stats_kernel",
    "_row_grad_kernel",
}


@pytest.mark.skipif(
    not any((BIN_DIR / name).exists() for name in ("ptxas", "ptxas-blackwell")),
    reason="this Triton build ships no ptxas",
)
def test_every_kernel_compiles_for_sm90_without_register_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in results} == EXPECTED_KERNELS
    spilling = [
        r
        for r in results
        # Known and documented: BLOOM-176B's 14336 features (16384 lanes) in the LayerNorm
        # backward spill ~300 bytes a thread at 16 warps.
        if r["spill_bytes"]
        and not (r["kernel"] == "_layer_norm_bwd_kernel" and r["constexprs"]["BLOCK_N"] == 16384)
    ]
    assert not spilling, f"register spills on sm_90: {spilling}"
    assert all(r["shared_bytes"] <= 227 * 1024 for r in results)

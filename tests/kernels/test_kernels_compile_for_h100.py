"""The Triton kernels compile for an H100 (sm_90) with Triton's real compiler: every autotune
config of every kernel fits (no spills, <= 255 registers, <= 227 KB shared memory), and the
attention kernels use what Hopper offers (warpgroup MMA, TMA copies and reductions) with the
matmul count per loop iteration that the algorithm promises (forward 2, backward 5).

The interpreter tests check the math; this checks what the interpreter cannot. See
sm90_compile_check.py, whose table docs/kernels.md reproduces.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_test_utils import TEST_DEVICE

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("sm90_compile_check.py")
BIN_DIR = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

EXPECTED_KERNELS = {
    "_flash_alibi_fwd_kernel",
    "_flash_alibi_bwd_preprocess_kernel",
    "_flash_alibi_bwd_kernel",
    "_layer_norm_fwd_kernel",
    "_layer_norm_bwd_kernel",
    "_layer_norm_bwd_row_sums_kernel",
    "_layer_norm_bwd_wide_kernel",
    "_bias_gelu_fwd_kernel",
    "_bias_gelu_bwd_kernel",
    "_row_stats_kernel",
    "_row_grad_kernel",
}


@pytest.mark.skipif(
    not any((BIN_DIR / name).exists() for name in ("ptxas", "ptxas-blackwell")),
    reason="this Triton build ships no ptxas",
)
@pytest.mark.skipif(
    TEST_DEVICE == "cuda", reason="on a GPU the other tests run the compiled kernels themselves"
)
def test_every_config_of_every_kernel_fits_sm90_and_attention_uses_wgmma_and_tma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--all-configs", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in results} == EXPECTED_KERNELS
    for r in results:
        where = f"{r['kernel']} {r['constexprs']} warps {r['num_warps']}"
        assert r["spill_bytes"] == 0, f"register spills on sm_90: {where}"
        assert r["registers"] <= 255, where
        assert r["shared_bytes"] <= 227 * 1024, (
            f"{r['shared_bytes']} bytes of shared memory: {where}"
        )
    attention = [
        r for r in results if r["kernel"] in ("_flash_alibi_fwd_kernel", "_flash_alibi_bwd_kernel")
    ]
    assert {r["constexprs"]["HEAD_DIM"] for r in attention} == {64, 80, 96, 128}
    for r in attention:
        c = r["constexprs"]
        where = f"{r['kernel']} d{c['HEAD_DIM']} {c['BLOCK_M']}x{c['BLOCK_N']}"
        assert c["USE_TMA"], where
        assert r["wgmma"] > 0, f"no wgmma.mma_async: {where}"
        assert r["tma"] > 0, f"no cp.async.bulk.tensor: {where}"
        matmuls = 2 if r["kernel"] == "_flash_alibi_fwd_kernel" else 5
        dots = matmuls * (2 if c["D1"] else 1)  # a split head_dim makes each matmul two dots
        assert r["loop_dots"] and all(n == dots for n in r["loop_dots"]), (where, r["loop_dots"])
        if r["kernel"] == "_flash_alibi_bwd_kernel":
            assert r["tma_reduce"] > 0, f"dq is not accumulated with TMA reductions: {where}"

"""The Triton kernels compile for an H100 (sm_90) with Triton's real compiler: every autotune
config of every kernel fits (no spills, <= 255 registers, <= 227 KB shared memory), for every
head_dim family with and without dropout, and the attention kernels use what Hopper offers
(warpgroup MMA, TMA copies and reductions) with the matmul count per loop iteration that the
algorithm promises (forward 2, backward 5, or 4 + 3 as two kernels), and no matmul falls back to
mma.sync (Triton's choice for result tiles under 64 rows).
docs/kernels.md's tables are this check's output.

The interpreter tests check the math; this checks what the interpreter cannot. See
sm90_compile_check.py."""

import json
import os
from pathlib import Path

import pytest

from harness.kernel_checks import TEST_DEVICE
from harness.launching import HARNESS_DIR, python_command, run
from harness.sm90_tables import documented_tables, markdown_tables

triton = pytest.importorskip("triton")

SCRIPT = HARNESS_DIR / "sm90_compile_check.py"
BIN_DIR = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"
DOCUMENTED_TRITON, DOCUMENTED_TABLES = documented_tables(DOCS.read_text())

EXPECTED_KERNELS = {
    "_flash_alibi_fwd_kernel",
    "_flash_alibi_bwd_preprocess_kernel",
    "_flash_alibi_bwd_kernel",
    "_flash_alibi_bwd_dq_kernel",
    "_layer_norm_fwd_kernel",
    "_layer_norm_bwd_kernel",
    "_layer_norm_bwd_row_sums_kernel",
    "_layer_norm_bwd_wide_kernel",
    "_bias_gelu_fwd_kernel",
    "_bias_gelu_bwd_kernel",
    "_row_stats_kernel",
    "_row_grad_kernel",
}

# (head_dim, dropout, segments) whose backward is two kernels, dK/dV then dQ
# (kernels/flash_alibi_attention.py's _TWO_KERNEL_BWD): no one-kernel tile with 64 query rows
# fits in their registers.
TWO_KERNEL_BACKWARDS = {(d, True, s) for d in (96, 128) for s in (False, True)} | {
    (96, False, True),
    (128, False, True),
}
# Matmuls per loop iteration (each two dots with a split head_dim); the backward without dQ
# when it runs as the first of two kernels.
MATMULS = {
    "_flash_alibi_fwd_kernel": 2,
    "_flash_alibi_bwd_kernel": 5,
    "_flash_alibi_bwd_dq_kernel": 3,
}

# The float arguments of each kernel that has some: Inductor types a Python float fp64 where a
# direct launch types it fp32 (sm90_compile_check.compile_as_inductor_would).
FLOAT_ARGUMENTS = {
    "_flash_alibi_fwd_kernel": ["qk_scale", "drop_scale"],
    "_flash_alibi_bwd_kernel": ["qk_scale", "sm_scale", "drop_scale"],
    "_flash_alibi_bwd_dq_kernel": ["qk_scale", "sm_scale", "drop_scale"],
    "_layer_norm_fwd_kernel": ["eps"],
}

pytestmark = [
    pytest.mark.multiprocess,  # the kernels compile in a process of their own
    pytest.mark.skipif(
        not any((BIN_DIR / name).exists() for name in ("ptxas", "ptxas-blackwell")),
        reason="this Triton build ships no ptxas",
    ),
    pytest.mark.skipif(
        TEST_DEVICE == "cuda", reason="on a GPU the other tests run the compiled kernels themselves"
    ),
]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    """Every autotune config of every kernel, compiled for sm_90 (one run for both tests)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run(python_command([str(SCRIPT), "--all-configs", "--json"]), env=env, timeout=900)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_config_of_every_kernel_fits_sm90_and_attention_uses_wgmma_and_tma(compiled):
    assert {r["kernel"] for r in compiled} == EXPECTED_KERNELS
    for r in compiled:
        where = f"{r['kernel']} {r['constexprs']} warps {r['num_warps']}"
        assert r["spill_bytes"] == 0, f"register spills on sm_90: {where}"
        assert r["registers"] <= 255, where
        assert r["shared_bytes"] <= 227 * 1024, (
            f"{r['shared_bytes']} bytes of shared memory: {where}"
        )
    attention = [r for r in compiled if r["kernel"] in MATMULS]
    variants = {
        kernel: {
            (r["constexprs"]["HEAD_DIM"], r["constexprs"]["DROPOUT"], r["constexprs"]["SEGMENTS"])
            for r in attention
            if r["kernel"] == kernel
        }
        for kernel in MATMULS
    }
    flags = (False, True)
    every = {(d, p, s) for d in (64, 80, 96, 128) for p in flags for s in flags}
    assert variants["_flash_alibi_fwd_kernel"] == variants["_flash_alibi_bwd_kernel"] == every
    assert variants["_flash_alibi_bwd_dq_kernel"] == TWO_KERNEL_BACKWARDS
    for r in attention:
        c = r["constexprs"]
        where = f"{r['kernel']} d{c['HEAD_DIM']} {c['BLOCK_M']}x{c['BLOCK_N']}"
        assert c["USE_TMA"], where
        assert r["wgmma"] > 0, f"no wgmma.mma_async: {where}"
        assert r["mma_sync"] == 0, f"{r['mma_sync']} mma.sync instructions: {where}"
        assert r["tma"] > 0, f"no cp.async.bulk.tensor: {where}"
        two_kernels = (c["HEAD_DIM"], c["DROPOUT"], c["SEGMENTS"]) in TWO_KERNEL_BACKWARDS
        matmuls = MATMULS[r["kernel"]]
        if r["kernel"] == "_flash_alibi_bwd_kernel":
            assert c["WITH_DQ"] != two_kernels, where
            assert c["DQ_TMA"] == c["WITH_DQ"], where
            assert (r["tma_reduce"] > 0) == c["WITH_DQ"], f"dq reductions: {where}"
            matmuls -= not c["WITH_DQ"]
        dots = matmuls * (2 if c["D1"] else 1)  # a split head_dim makes each matmul two dots
        assert r["loop_dots"] and all(n == dots for n in r["loop_dots"]), (where, r["loop_dots"])


def test_with_inductors_fp64_floats_every_kernel_compiles_and_computes_in_fp32(compiled):
    # Under torch.compile the triton_ops' kernels get their float arguments as fp64: a kernel
    # that used one as it came promoted its scores to fp64, and the forward's P @ V did not
    # compile (the first H200 lease, docs/benchmarks.md).
    twins = [r for r in compiled if "inductor_fp64" in r]
    assert {r["kernel"]: r["inductor_fp64"] for r in twins} == FLOAT_ARGUMENTS
    for r in twins:
        where = f"{r['kernel']} {r['constexprs']}"
        assert "inductor_error" not in r, f"{where}: {r.get('inductor_error')}"
        assert r["f64_ops"] == 0, f"{r['f64_ops']} fp64 instructions under Inductor: {where}"


@pytest.mark.skipif(
    triton.__version__ != DOCUMENTED_TRITON,
    reason=f"docs/kernels.md's sm_90 tables are for Triton {DOCUMENTED_TRITON} (the GPU "
    f"machines'); registers differ between Triton versions (this is {triton.__version__})",
)
def test_the_documented_sm90_tables_are_this_checks_output(compiled):
    assert DOCUMENTED_TABLES == markdown_tables(compiled), (
        "regenerate them: python tests/harness/sm90_compile_check.py --all-configs --markdown"
    )

"""The kernels on the route a GPU takes (gpu_route.py): torch.compile traces every op's
``triton_op`` body, forward and backward, into its kernel launches (fullgraph: no graph break,
no error), with the H100's choices (TMA descriptors where the layout allows them), and torch's
Triton mutation analysis says each launch writes exactly what the kernel writes (WRITES, which
test_kernel_writes.py checks against the interpreter).

Runs gpu_route.py in a process of its own: the kernels must be compiled Triton functions, while
this test process runs them in Triton's interpreter."""

from __future__ import annotations

import json
import os

import pytest

from harness.kernel_writes import CASES, OPAQUE_OPS, WRITES
from harness.launching import HARNESS_DIR, python_command, run

pytest.importorskip("triton")
pytestmark = pytest.mark.multiprocess  # the traces are made in a process of their own

SCRIPT = HARNESS_DIR / "gpu_route.py"
ATTENTION_KERNELS = {
    "_flash_alibi_fwd_kernel",
    "_flash_alibi_bwd_kernel",
    "_flash_alibi_bwd_dq_kernel",
}


@pytest.fixture(scope="module")
def traced() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run(python_command([str(SCRIPT), "--json"]), env=env, timeout=900)
    return {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_op_traces_into_kernels_whose_writes_torch_sees_exactly(traced, case):
    result = traced[case.name]
    assert result["error"] is None, result["error"]
    assert set(result["opaque_ops"]) <= set(OPAQUE_OPS), (
        f"ops left untraced in the compiled graph: {result['opaque_ops']}"
    )
    assert result["launches"] or result["opaque_ops"], "no kernel launch was traced"
    for launch in result["launches"]:
        kernel, constexprs = launch["kernel"], launch["constexprs"]
        assert set(launch["written"]) == WRITES[kernel](constexprs), (
            f"{kernel} {constexprs}: torch.compile thinks it writes {launch['written']}"
        )
        if kernel in ATTENTION_KERNELS:
            expected = {k: v for k, v in case.on_an_h100.items() if k in constexprs}
            assert {k: constexprs[k] for k in expected} == expected, kernel


def test_every_kernel_is_traced_or_launched_by_a_documented_opaque_op(traced):
    launched = {launch["kernel"] for r in traced.values() for launch in r["launches"]}
    opaque = {kernel for kernels in OPAQUE_OPS.values() for kernel in kernels}
    assert launched | opaque == set(WRITES)
    assert not launched & opaque

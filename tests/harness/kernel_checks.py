"""Shared helpers of the kernel tests (the test device, tolerances, float64 copies, BLOOM's
ALiBi slopes).

The kernels run on CPU through Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before
Triton is imported (tests/conftest.py sets it before any test module is imported), or,
with ``BLOOMNATIVE_TEST_DEVICE=cuda``, compiled on a GPU: every test then creates its tensors
there, so the same comparisons check the compiled kernels and Inductor's capture of them.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from bloomnative.kernels import _dispatch

TEST_DEVICE = os.environ.get("BLOOMNATIVE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"BLOOMNATIVE_TEST_DEVICE={TEST_DEVICE!r}: use cpu or cuda")

NEEDS_TRITON = pytest.mark.skipif(
    not (
        _dispatch.INTERPRET
        or (TEST_DEVICE == "cuda" and _dispatch.HAS_TRITON and torch.cuda.is_available())
    ),
    reason="the Triton kernels cannot run: on CPU Triton must be imported with "
    "TRITON_INTERPRET=1 (run ./run_tests.sh); on a GPU set BLOOMNATIVE_TEST_DEVICE=cuda",
)

# Error allowed relative to the largest magnitude of the float64 reference. A bf16/fp16 kernel is
# expected to be at least as close to float64 as the same math done by torch in that dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def assert_close_to_reference(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "tensor"
) -> None:
    """max |actual - expected| <= tol * max(max |expected|, 1), and no NaN anywhere.

    The floor of 1 keeps the check meaningful for references that are (almost) all zero, such
    as dq for a single-token sequence; every test input is O(1).
    """
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert not torch.isnan(actual).any(), f"{name}: contains NaN (an unwritten output element?)"
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1.0)
    assert err <= tol * scale, f"{name}: max error {err:.3e} > {tol:.1e} * {scale:.3e}"


def float64_leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Detached float64 copies that require grad (None stays None)."""
    return [
        None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in tensors
    ]


def bloom_alibi_slopes(num_heads: int) -> torch.Tensor:
    """BLOOM's ALiBi slopes for any head count (geometric series, interleaved for non powers
    of two), as in the BLOOM paper and Megatron-DeepSpeed."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)

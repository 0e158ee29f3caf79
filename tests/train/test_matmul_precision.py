"""training.tf32 sets torch's TF32 switches for CUDA devices and leaves a CPU run alone."""

from __future__ import annotations

import pytest
import torch

from bloomnative.train.matmul_precision import apply_tf32


@pytest.fixture
def tf32_switches():
    """The process-wide switches, restored after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def switches() -> tuple[bool, bool, str]:
    """What cuBLAS, cuDNN and Inductor (through the float32 matmul precision) will use."""
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_on_a_cuda_device_sets_matmuls_and_convolutions(tf32_switches, enabled):
    apply_tf32(not enabled, torch.device("cuda", 0))
    apply_tf32(enabled, torch.device("cuda", 0))
    assert switches() == (enabled, enabled, "high" if enabled else "highest")


def test_tf32_does_nothing_on_cpu(tf32_switches):
    apply_tf32(False, torch.device("cuda", 0))
    before = switches()
    apply_tf32(True, torch.device("cpu"))
    assert switches() == before == (False, False, "highest")

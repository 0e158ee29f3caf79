"""Kernel tests run the Triton kernels on CPU through Triton's interpreter, or compiled on a GPU
with ``BLOOMNATIVE_TEST_DEVICE=cuda`` (see kernel_test_utils, imported first: it sets
``TRITON_INTERPRET`` before Triton is imported)."""

import pytest
import torch

from bloomnative.kernels import poison_outputs
from harness.kernel_checks import NEEDS_TRITON, TEST_DEVICE


@pytest.fixture(autouse=True)
def _kernel_test_setup():
    """Every kernel test: seeded, on the test device, and with kernel outputs NaN-poisoned
    before each launch, so an element a kernel forgets to write fails the comparison instead of
    passing by luck."""
    torch.manual_seed(0)
    with poison_outputs(), torch.device(TEST_DEVICE):
        yield


@pytest.fixture
def triton_kernels() -> None:
    """Tests that compare a Triton kernel against its reference need the kernels to run (the
    interpreter on CPU, or a GPU); otherwise the public ops would run the reference and the
    comparison could not fail. Requesting this fixture marks a test NEEDS_TRITON (see
    pytest_collection_modifyitems)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "triton_kernels" in getattr(item, "fixturenames", ()):
            item.add_marker(NEEDS_TRITON)

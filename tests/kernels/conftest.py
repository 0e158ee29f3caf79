"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before Triton (and so ``bloomnative.kernels``) is imported;
``run_tests.sh`` exports it, and this file sets it for a bare ``pytest tests/kernels``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from bloomnative.kernels import _dispatch, poison_outputs  # noqa: E402


@pytest.fixture(autouse=True)
def _kernel_test_setup():
    """Every kernel test: seeded, and with kernel outputs NaN-poisoned before each launch, so an
    element a kernel forgets to write fails the comparison instead of passing by luck."""
    torch.manual_seed(0)
    with poison_outputs():
        yield


NEEDS_INTERPRETER = pytest.mark.skipif(
    not _dispatch.INTERPRET,
    reason="Triton was imported without TRITON_INTERPRET=1 (or is missing), so the kernels "
    "cannot run on CPU; run ./run_tests.sh or set TRITON_INTERPRET=1",
)


@pytest.fixture
def interpreter() -> None:
    """Tests that compare a Triton kernel against its reference need the interpreter; without
    it the public ops would run the reference and the comparison could not fail. Requesting
    this fixture marks a test NEEDS_INTERPRETER (see pytest_collection_modifyitems)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "interpreter" in getattr(item, "fixturenames", ()):
            item.add_marker(NEEDS_INTERPRETER)

"""Every Triton kernel launch, run by Triton's interpreter, writes into exactly the tensors
kernel_writes.WRITES names for it, and never outside its tensor arguments. Together with
test_gpu_route.py (torch.compile's analysis reports WRITES) this proves the analysis sees every
write the kernels make: an unseen write could be read by compiled code before it happens.

Writes are observed where the interpreter performs them (stores, atomics, TMA stores and
reductions), as byte addresses, and attributed to the tensor arguments whose memory holds them."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from bloomnative.kernels._dispatch import INTERPRET
from harness.kernel_writes import CASES, WRITES, run_forward_backward

pytestmark = pytest.mark.skipif(
    not INTERPRET,
    reason="observes the writes inside Triton's interpreter (TRITON_INTERPRET=1); on a GPU the "
    "kernels run compiled",
)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte address of the elements of ``t``."""
    start = t.data_ptr()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else -1
    return start, start + (span + 1) * t.element_size() - 1


class _WriteRecorder:
    """Patches the interpreter to record, per kernel launch, the tensor arguments, the
    constexprs and every byte address written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from triton.runtime import interpreter

        self.launches: list[dict] = []
        self._addresses: list[np.ndarray] = []
        builder = interpreter.InterpreterBuilder

        def recording(method, pointer_at: int, mask_at: int | None):
            original = getattr(builder, method)

            def record(this, *args):
                pointers = np.asarray(args[pointer_at].data)
                if mask_at is not None and args[mask_at] is not None:
                    pointers = pointers[
                        np.broadcast_to(np.asarray(args[mask_at].data), pointers.shape)
                    ]
                self._addresses.append(pointers.ravel().astype(np.uint64))
                return original(this, *args)

            monkeypatch.setattr(builder, method, record)

        recording("create_store", 0, None)
        recording("create_masked_store", 0, 2)
        recording("create_atomic_rmw", 1, 3)
        recording("create_atomic_cas", 0, None)
        original_call = interpreter.GridExecutor.__call__
        recorder = self

        def call(executor, *args, **kwargs):
            recorder._addresses = []
            original_call(executor, *args, **kwargs)
            signature = inspect.signature(executor.fn)
            own = {k: v for k, v in kwargs.items() if k in signature.parameters}
            bound = signature.bind_partial(*args, **own).arguments
            recorder.launches.append(
                {
                    "kernel": executor.fn.__name__,
                    "constexprs": {k: bound[k] for k in executor.constexprs if k in bound},
                    "tensors": {k: v for k, v in bound.items() if isinstance(v, torch.Tensor)},
                    "addresses": np.concatenate(recorder._addresses or [np.zeros(0, np.uint64)]),
                }
            )

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", call)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_launch_writes_exactly_what_its_kernel_declares(monkeypatch, case):
    recorder = _WriteRecorder(monkeypatch)
    torch.manual_seed(0)
    with torch.device("cpu"):
        run_forward_backward(case)
    assert recorder.launches, "no kernel ran"
    for launch in recorder.launches:
        kernel, addresses = launch["kernel"], launch["addresses"]
        ranges = {name: _byte_range(t) for name, t in launch["tensors"].items()}
        written = {
            name
            for name, (first, last) in ranges.items()
            if ((addresses >= first) & (addresses <= last)).any()
        }
        inside = np.zeros(len(addresses), dtype=bool)
        for first, last in ranges.values():
            inside |= (addresses >= first) & (addresses <= last)
        assert inside.all(), f"{kernel} writes {int((~inside).sum())} bytes outside its tensors"
        declared = WRITES[kernel](launch["constexprs"])
        # A write into memory two arguments share (a kernel writing in place) lands in both.
        aliases = {
            name
            for name, (first, last) in ranges.items()
            for other in declared
            if first <= ranges[other][1] and ranges[other][0] <= last
        }
        assert written == declared | aliases, (kernel, launch["constexprs"])

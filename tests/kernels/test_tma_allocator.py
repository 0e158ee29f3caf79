"""Kernels that build TMA descriptors on the device get their scratch from Triton's allocator.
Triton keeps it in a ContextVar, which a new thread sees unset: a compiled backward, launched
from autograd's own threads, would fail with "no allocator was set". install_tma_allocator makes
one allocator visible to every thread."""

import threading

import pytest

from bloomnative.kernels._dispatch import install_tma_allocator

triton = pytest.importorskip("triton")


def _allocator_seen_by_a_new_thread():
    from triton.runtime import _allocation

    seen = []
    thread = threading.Thread(target=lambda: seen.append(_allocation._allocator.get()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_new_thread_sees_the_allocator_and_a_later_set_allocator_too(monkeypatch):
    from triton.runtime import _allocation

    monkeypatch.setattr(_allocation, "_allocator", _allocation._allocator)  # restored after
    assert isinstance(_allocator_seen_by_a_new_thread(), _allocation.NullAllocator)
    install_tma_allocator()
    assert not isinstance(_allocator_seen_by_a_new_thread(), _allocation.NullAllocator)

    def mine(size, alignment, stream):
        return None

    triton.set_allocator(mine)  # a user's allocator, set in this thread, holds in every thread
    assert _allocator_seen_by_a_new_thread() is mine
    install_tma_allocator()  # idempotent: keeps it
    assert _allocator_seen_by_a_new_thread() is mine

"""Async checkpoints (checkpoint.async_mode = "async"): `save` returns once the state is copied
into host memory that DCP's stager keeps between saves (pinned on CUDA), the files are written
in the background, and what is written is the state as it was when `save` returned."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager

from bloomnative.checkpoint import checkpointer as ckpt

# DCP says so when it runs without a process group, as it does here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def training_state(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(300_000, generator=g).to(device), "b": torch.zeros(7)},
        "train": {"step": torch.tensor(0)},
    }


def snapshot(state: dict) -> dict:
    return {k: {n: t.detach().cpu().clone() for n, t in v.items()} for k, v in state.items()}


def load_step(checkpointer: ckpt.Checkpointer, step: int) -> dict:
    target = snapshot(training_state())
    dcp.load(target, checkpoint_id=str(checkpointer.path(step)))
    return target


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name}"


def test_each_async_save_writes_the_state_of_when_it_returned(tmp_path):
    """The second save copies into the host memory the first one used; the state changes in
    place right after each save returns, as the next optimizer step changes it."""
    checkpointer = ckpt.Checkpointer(tmp_path, keep_latest_k=0, async_mode=True, min_free_gib=0)
    state = training_state()
    saved = {}
    for step in (1, 2):
        state["train"]["step"].fill_(step)
        checkpointer.save(step, state)
        saved[step] = snapshot(state)
        for tensors in state.values():
            for t in tensors.values():
                t.add_(1)
    checkpointer.wait()
    assert checkpointer.verified == {1, 2}
    for step in (1, 2):
        assert checkpointer.verify(step) is None
        assert_same(load_step(checkpointer, step), saved[step])


def test_async_saves_stage_through_one_dcp_stager_pinned_where_cuda_is(tmp_path, monkeypatch):
    stagers = []
    async_save = ckpt.dcp.async_save

    def recording_async_save(state, **kwargs):
        stagers.append(kwargs.get("async_stager"))
        return async_save(state, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "async_save", recording_async_save)
    checkpointer = ckpt.Checkpointer(tmp_path, keep_latest_k=0, async_mode=True, min_free_gib=0)
    for step in (1, 2):
        checkpointer.save(step, training_state())
    checkpointer.wait()
    first, second = stagers
    assert isinstance(first, DefaultStager) and isinstance(second, DefaultStager)
    # the host memory of the first save is reused, where torch's stager allows it
    assert (second is first) == (torch.__version__ >= "2.13")
    options = first._config
    cuda = torch.cuda.is_available()
    assert options.use_pinned_memory == options.use_non_blocking_copy == cuda
    assert not options.use_async_staging  # staged before save returns


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_async_staging_of_a_cuda_state_is_pinned(tmp_path, monkeypatch):
    staged = []
    stage = DefaultStager.stage

    def recording_stage(self, state, **kwargs):
        out = stage(self, state, **kwargs)
        staged.append(out)
        return out

    monkeypatch.setattr(DefaultStager, "stage", recording_stage)
    checkpointer = ckpt.Checkpointer(tmp_path, keep_latest_k=0, async_mode=True, min_free_gib=0)
    state = training_state("cuda")
    checkpointer.save(1, state)
    expected = snapshot(state)
    state["model"]["w"].add_(1)
    checkpointer.wait()
    (copy,) = staged
    assert copy["model"]["w"].device.type == "cpu" and copy["model"]["w"].is_pinned()
    assert_same(load_step(checkpointer, 1), expected)

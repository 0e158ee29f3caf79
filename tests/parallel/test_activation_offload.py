"""activation_checkpoint.offload: the blocks' saved tensors go through the offload hooks (on CPU
the "copy" is the tensor itself, on CUDA a pinned host copy), the losses are those of the run
without it, bit for bit, and what the hooks take from the device is what the planner counts as
offloaded."""

from __future__ import annotations

import pytest
import torch

from bloomnative.parallel import activation_offload
from harness.memory_measurement import (
    MICRO_BATCH,
    MICRO_BATCHES,
    build_trainer,
    predict,
    relative_error,
)

TOLERANCE = 0.15


def losses(trainer, steps: int = 3) -> list[float]:
    return [trainer.train_step()[0].item() for _ in range(steps)]


@pytest.fixture
def taken(monkeypatch) -> dict[int, int]:
    """The storages the offload hooks take ({address: bytes}), from the trainers built after it.
    By storage: CPU's math attention saves its probabilities through two views (the hooks copy
    each; nothing is copied on CPU), which the planner, and flash attention, count once."""
    sizes: dict[int, int] = {}
    pack = activation_offload.HostActivations.pack

    def counting_pack(self, t):
        packed = pack(self, t)
        if isinstance(packed, activation_offload._InHost):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return packed

    monkeypatch.setattr(activation_offload.HostActivations, "pack", counting_pack)
    return sizes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: FSDP2 on a mesh of one
def test_losses_with_offload_equal_those_without(tmp_path, dtype, taken):
    runs = {}
    for offload in (False, True):
        trainer = build_trainer(
            tmp_path / str(offload),
            f"--training.dtype={dtype}",
            f"--activation_checkpoint.offload={str(offload).lower()}",
        )
        runs[offload] = losses(trainer)
        assert bool(taken) == offload  # the hooks ran, and only with offload
    assert runs[True] == runs[False]


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_the_planner_offloads_what_the_hooks_take(tmp_path, taken, mode):
    """One micro batch's forward; with selective recompute (every 2nd block) only the other
    blocks go through the hooks."""
    trainer = build_trainer(
        tmp_path, "--activation_checkpoint.offload=true", f"--activation_checkpoint.mode={mode}"
    )
    micro = trainer.train_loader.next_batch(MICRO_BATCH * MICRO_BATCHES)[0]
    trainer.model_parts[0](micro.input_ids, segments=micro.segments)
    estimate = predict(trainer)
    predicted = estimate.component("activations: stage 0 blocks (offloaded)").bytes
    measured = sum(taken.values())
    assert relative_error(predicted, measured) < TOLERANCE, (predicted, measured)
    on_device = estimate.component("activations: stage 0 blocks (on the device with offload)")
    offloaded_blocks = trainer.resolved.model_args.n_layer // (2 if mode == "selective" else 1)
    assert on_device.bytes >= predicted // offloaded_blocks  # the block whose backward runs


def test_offload_keeps_parameters_and_copies_other_tensors():
    hooks = activation_offload.HostActivations()
    weight = torch.nn.Parameter(torch.ones(3))
    assert hooks.pack(weight) is weight
    activation = torch.arange(6.0).reshape(2, 3).t()  # a view: strides kept
    packed = hooks.pack(activation)
    assert isinstance(packed, activation_offload._InHost)
    restored = hooks.unpack(packed)
    assert torch.equal(restored, activation) and restored.stride() == activation.stride()

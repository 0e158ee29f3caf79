"""Activation offload: the tensors a block saves for its backward wait in host memory instead of
on the device (activation_checkpoint.offload), and come back when its backward needs them.

On CUDA each saved tensor is copied into pinned host memory on a side stream, so the copies run
beside the forward's compute; the device tensor's memory returns to the allocator once its copy
has run (`record_stream`). In backward each one is copied back on the compute stream when the
operation that saved it back-propagates (after the side stream's copy: an event), so the device
holds the activations of about one block at a time. On CPU the same hooks run and the "copy" is
the tensor itself (it is already in host memory): the computation is the same, bit for bit.

Left on the device: parameters and views of them (a linear layer saves its weight, transposed;
under FSDP2 the gathered one),
tensor subclasses (DTensor activations of tensor parallelism) and what recomputed blocks keep
(their inputs, held by the checkpoint, not saved through these hooks): the blocks that
activation checkpointing wraps are not offloaded, and the embedding, the head and the loss keep
theirs (they run outside the blocks). Each saved tensor is copied on its own: a storage saved
through two views (CPU's math attention saves its probabilities so) is copied twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from bloomnative.model import Bloom


@dataclass(frozen=True)
class _InHost:
    """A saved tensor in host memory: its copy, the device it returns to, and (CUDA) the event
    after which the copy is complete."""

    host: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event | None


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer's matmul saves its weight transposed)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class HostActivations:
    """The pack and unpack hooks of `saved_tensors_hooks` that keep saved tensors in host memory
    (module docstring). One side stream per CUDA device, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor | _InHost:
        if _is_weight(t) or type(t) is not torch.Tensor:
            return t
        if t.device.type != "cuda":
            return _InHost(t, t.device, None)
        stream = self._streams.setdefault(t.device, torch.cuda.Stream(t.device))
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)
            copied = stream.record_event()
        return _InHost(host, t.device, copied)

    def unpack(self, packed: torch.Tensor | _InHost) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.copied is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.copied)
        return packed.host.to(packed.device, non_blocking=True)


def apply_activation_offload(model: Bloom) -> None:
    """Makes every block of `model` (a `Bloom` or a pipeline stage of it) that activation
    checkpointing did not wrap keep its saved tensors in host memory (`HostActivations`), with
    forward hooks around the block: the module and its parameter names are unchanged."""
    offload = HostActivations()
    hooks = saved_tensors_hooks(offload.pack, offload.unpack)
    for block in model.layers.values():
        if isinstance(block, CheckpointWrapper):
            continue
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None), always_call=True)

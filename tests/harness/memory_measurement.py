"""Measuring what a real training step allocates on CPU, for the planner's tests.

- model states: the bytes of the live parameters, gradients and AdamW moments (exact);
- saved activations: every tensor autograd saves for backward during one micro batch's forward
  and loss, collected with saved-tensor hooks and de-duplicated by storage, parameters excluded
  (with bf16 the gathered bf16 ones FSDP's units run with, which the planner counts as weights);
  the trainer keeps no reference to the logits, so they count only if autograd saves them;
- the step's peak: every allocation and free the c10 CPU allocator reports to the profiler
  (profile_memory=True) during one full `Trainer.train_step()`, replayed in time order on top of
  the bytes already live (weights and AdamW moments). On CPU this is the quantity
  torch.cuda.max_memory_allocated reports on GPU. Blocks allocated before the profiled step and
  freed during it (a pipeline's logits of the previous step) are neither counted as live nor
  seen being freed, so they cancel out.

On CPU the process holds more than its tensors: what `planner.Overhead.cpu()` counts, the
process's runtime and the free memory glibc's malloc keeps. `process_peak_rss` (the kernel's peak
resident set, what /usr/bin/time -v reports) and `runtime_rss` measure them in a process of its
own (tests/scenarios/memory_scenario.py --process-peak): a test process's resident set holds
whatever its earlier tests left.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from bloomnative import planner
from bloomnative.config import parse_args
from bloomnative.train.loss import cross_entropy_sum
from bloomnative.train.metrics import process_peak_rss_bytes
from bloomnative.train.trainer import Trainer

MICRO_BATCH, SEQ, MICRO_BATCHES = 4, 128, 2


def build_trainer(dump: Path, *overrides: str) -> Trainer:
    """The debug model at seq 128, 2 micro batches of 4 per step, no checkpoints or logs."""
    config = parse_args(
        [
            f"--job.dump_folder={dump}",
            "--checkpoint.enable=false",
            "--metrics.tensorboard=false",
            "--validation.freq=0",
            "--data.prefetch=false",
            "--training.steps=4",
            f"--training.seq_len={SEQ}",
            f"--training.micro_batch_size={MICRO_BATCH}",
            f"--training.global_batch_size={MICRO_BATCH * MICRO_BATCHES}",
            "--optimizer.implementation=foreach",
            *overrides,
        ]
    )
    return Trainer(config)


def predict(trainer: Trainer, overhead: planner.Overhead | None = None) -> planner.RankEstimate:
    """The planner's estimate for this trainer's config, layout and pipeline rank, on CPU (with
    `overhead` in its device bytes; none by default: the allocated bytes are compared)."""
    layout = trainer.resolved.planner_layout()
    workload = trainer.resolved.planner_workload()
    pp_rank = trainer.mesh["pp"].get_local_rank()
    return planner.estimate_rank(
        trainer.resolved.model_args, layout, workload, pp_rank, overhead, device_type="cpu"
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s bytes on this rank (a DTensor's shard, a collective's
    result)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if isinstance(t, AsyncCollectiveTensor):
        t = t.elem
    return t


def held_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s bytes on this rank: `local(t)`, or the inner tensors of
    a wrapper subclass without storage of its own (QLoRA's NF4 weights)."""
    t = local(t)
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    return [getattr(t, name) for name in t.__tensor_flatten__()[0]]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {}
    for t in (inner for tensor in tensors for inner in held_tensors(tensor)):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def parameters(trainer: Trainer) -> list[torch.Tensor]:
    return [p for part in trainer.model_parts for p in part.parameters()]


def optimizer_state_tensors(trainer: Trainer) -> list[torch.Tensor]:
    return [
        value
        for opt in trainer.optimizers
        for state in opt.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.numel() > 1  # not the step counters
    ]


def live_tensor_bytes(trainer: Trainer) -> int:
    """Bytes of the parameters, their gradients (if any) and the AdamW moments."""
    params = parameters(trainer)
    grads = [p.grad for p in params if p.grad is not None]
    return storage_bytes(params + grads + optimizer_state_tensors(trainer))


def process_peak_rss() -> int:
    """The process's peak resident set since it started (VmHWM, never reset by bloomnative)."""
    return process_peak_rss_bytes()


def runtime_rss(live_bytes: int) -> int:
    """The process's resident set besides `live_bytes` of tensors, once malloc has returned the
    free memory it keeps (malloc_trim): the interpreter, the libraries and their buffers."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc_trim(0)
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") - live_bytes


def measured_step_peak(trainer: Trainer) -> int:
    """Peak live bytes during one train_step: the bytes live before it plus the highest point
    of the running sum of the allocator's allocation (+) and free (-) events."""
    live_before = storage_bytes(parameters(trainer) + optimizer_state_tensors(trainer))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step()
    return live_before + allocation_peak(prof)


def allocation_peak(prof: profile) -> int:
    """The highest point of the running sum of the allocation (+) and free (-) events a
    memory-profiling run recorded."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def saved_activation_bytes(trainer: Trainer) -> int:
    """Bytes of the distinct storages autograd saves in one micro batch's forward + loss (the
    trainer computes the loss from the logits without keeping them, as done here). Weights are
    not activations: a tensor on the storage of a parameter the model has at that moment (under
    FSDP the gathered one the running unit uses) is left out."""
    model = trainer.model_parts[0]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        weights = {
            w.untyped_storage().data_ptr() for p in model.parameters() for w in held_tensors(p)
        }
        for storage in (inner.untyped_storage() for inner in held_tensors(t)):
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
        return t

    micro = trainer.train_loader.next_batch(MICRO_BATCH * MICRO_BATCHES)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy_sum(model(micro.input_ids, segments=micro.segments), micro.labels)
    return sum(saved.values())


def predicted_saved_bytes(estimate: planner.RankEstimate) -> int:
    """Stored activations and the loss's saved tensors."""
    names = ("activations:", "loss:")
    return sum(c.bytes for c in estimate.components if c.name.startswith(names))


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured

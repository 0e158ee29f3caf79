"""Process-group and device set-up for a torchrun-launched (or plain) process."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


def pick_device(requested: str) -> torch.device:
    """ "auto": this rank's CUDA device when CUDA is present, else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("job.device = 'cuda' but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device, timeout_s: int) -> tuple[int, int]:
    """Initialises the default process group (nccl on GPU, gloo on CPU) and returns
    (rank, world_size). Without torchrun (no WORLD_SIZE in the environment) it is a world of one
    on an in-memory store: no port is opened."""
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        single = (
            {}
            if "WORLD_SIZE" in os.environ
            else {
                "store": dist.HashStore(),
                "rank": 0,
                "world_size": 1,
            }
        )
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
            **single,
        )
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def exit_process(code: int) -> NoReturn:
    """Ends a process whose distributed work is done, without finalizing the interpreter.

    Gloo's worker threads outlive `destroy_process_group()`. If one is still releasing the tensors
    of the last collective when the interpreter finalizes, taking the GIL kills the thread inside
    a noexcept destructor and the process aborts (SIGABRT) after a successful run: a torch race
    (pytorch/pytorch#190489) that a loaded 2-core machine hits in a few percent of 2-rank runs.
    Every process has such threads: single-process runs use a gloo world of one, GPU runs a gloo
    group for CPU tensors. Call this last, once checkpoints are written, metrics closed and the
    process group destroyed; atexit handlers do not run.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)

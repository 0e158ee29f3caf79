"""Process-group and device set-up for a torchrun-launched (or plain) process."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist


def init_distributed(device: torch.device, timeout_s: int) -> tuple[int, int]:
    """Makes `device` this process's CUDA device (when it is one), initialises the default
    process group (nccl on GPU, gloo on CPU) and returns (rank, world_size). Without torchrun (no
    WORLD_SIZE in the environment) it is a world of one on an in-memory store: no port is
    opened."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "WORLD_SIZE" not in os.environ:
            rendezvous: dict[str, Any] = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rendezvous = {
                "store": _restart_attempt_store(timeout),
                "rank": int(os.environ["RANK"]),
                "world_size": int(os.environ["WORLD_SIZE"]),
            }
        else:
            rendezvous = {}
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **rendezvous,
        )
    return dist.get_rank(), dist.get_world_size()


def _restart_attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with this restart attempt's keys under their own prefix.

    torchrun's agent keeps one TCPStore server for the whole job and hands it to every restart
    attempt, and `init_process_group` writes the process groups' rendezvous keys (each rank's
    address) without an attempt prefix. Workers restarted after a failure then read the dead
    workers' addresses: gloo's connectFullMesh gets "Connection refused" or waits up to the
    collective timeout, so torchrun's restart never resumes the run (NCCL's unique id goes
    stale the same way: pytorch/pytorch#135712). TORCHELASTIC_RESTART_COUNT numbers the attempts
    of this node's agent, which all agents share when a failure restarts every node.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"bloomnative/attempt-{attempt}", store)


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

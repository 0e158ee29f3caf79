"""Which device a process computes on."""

from __future__ import annotations

import os

import torch


def pick_device(requested: str | torch.device) -> torch.device:
    """The device for `requested`: "auto" is CUDA when present, else the CPU; "cpu"; "cuda" is
    this process's GPU (torchrun's LOCAL_RANK, 0 without torchrun); "cuda:N" as given. Raises
    ValueError for anything else, or for CUDA without a CUDA device."""
    name = str(requested)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f'device {requested!r} is not "auto", "cpu", "cuda" or "cuda:N"') from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} asked for, but no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    elif device.type != "cpu":
        raise ValueError(f'device {requested!r} is not "auto", "cpu", "cuda" or "cuda:N"')
    return device

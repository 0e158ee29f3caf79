"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout: <dump>/<folder>/step-<N>/ holds the DCP files. A save writes step-<N>.partial/ and only
rank 0 renames it to step-<N> after every rank has finished, so a folder named step-<N> is always
complete; anything else is ignored by `latest_step` and cleaned up by the next save.

Model and optimizer state are saved under fully qualified parameter names through DCP's
state-dict API, so a checkpoint does not depend on the parallel layout that wrote it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"^step-(\d+)$")
TIED_HEAD = "lm_head.weight"
EMBEDDING = "word_embeddings.weight"


def latest_step(folder: Path) -> int | None:
    """The newest complete checkpoint's step in `folder`, or None."""
    if not folder.is_dir():
        return None
    steps = [int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))]
    return max(steps) if steps else None


def model_state(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Model state under canonical names: the tied head is stored once, as the embedding."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        sd = get_model_state_dict(part)
        if EMBEDDING in sd or TIED_HEAD not in sd:
            sd.pop(TIED_HEAD, None)
        else:  # a last pipeline stage: its head copy is the embedding
            sd[EMBEDDING] = sd.pop(TIED_HEAD)
        state.update(sd)
    return state


def load_model_state(
    parts: list[nn.Module], state: dict[str, torch.Tensor], full: bool = False
) -> None:
    """Copies canonical-name `state` into the parts. `full`: the tensors are whole (e.g. from a
    Hugging Face folder) and each rank takes its shard of them."""
    options = StateDictOptions(strict=False, full_state_dict=full)
    for part in parts:
        names = set(get_model_state_dict(part))
        sd = {k: state[k] for k in names if k in state}
        if TIED_HEAD in names and EMBEDDING not in names:
            sd[TIED_HEAD] = state[EMBEDDING]
        set_model_state_dict(part, sd, options=options)


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state: dict = {}
    for part, opt in zip(parts, optimizers, strict=True):
        state.update(get_optimizer_state_dict(part, opt, options=options))
    return state


def load_optimizer_state(parts, optimizers, state: dict) -> None:
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, opt in zip(parts, optimizers, strict=True):
        set_optimizer_state_dict(part, opt, optim_state_dict=state, options=options)


def save(folder: Path, step: int, state: dict, keep_latest_k: int) -> Path:
    """Saves `state` (a DCP state dict) as step-<step>, atomically, then prunes old ones."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = folder / f"step-{step}"
    partial = folder / f"step-{step}.partial"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(partial))
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        prune(folder, keep_latest_k)
    _barrier()
    return final


def load(path: Path, state: dict) -> None:
    """Fills `state` in place from the checkpoint at `path`."""
    dcp.load(state, checkpoint_id=str(path))


def is_model_only(path: Path) -> bool:
    """True for a checkpoint with weights but no training state (tools/convert_hf.py to-native)."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return not any(k.startswith("optimizer.") for k in keys)


def prune(folder: Path, keep_latest_k: int) -> None:
    """Removes complete checkpoints beyond the newest k, and leftover partial ones."""
    steps = sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)))
    for p in folder.iterdir():
        if p.name.endswith(".partial"):
            shutil.rmtree(p, ignore_errors=True)
    if keep_latest_k > 0:
        for step in steps[:-keep_latest_k]:
            shutil.rmtree(folder / f"step-{step}", ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

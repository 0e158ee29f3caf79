"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout: <dump>/<folder>/step-<N>/ holds the DCP files. A save writes step-<N>.partial/ and only
rank 0 renames it to step-<N> after every rank has finished, so a folder named step-<N> is always
complete; anything else is ignored by `latest_step` and removed by the next save.

Model and optimizer state are saved under canonical fully qualified parameter names through
DCP's state-dict API (the tied head is stored once, as the embedding), so a checkpoint does not
depend on the parallel layout that wrote it and loads under any other.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from concurrent.futures import Future
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
from torch.distributed.tensor import DTensor

_STEP_DIR = re.compile(r"^step-(\d+)$")
TIED_HEAD = "lm_head.weight"
EMBEDDING = "word_embeddings.weight"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; nothing already saved was touched."""


def latest_step(folder: Path) -> int | None:
    """The newest complete checkpoint's step in `folder`, or None."""
    if not folder.is_dir():
        return None
    steps = [int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))]
    return max(steps) if steps else None


def _owns_head_copy(part: nn.Module) -> bool:
    """A last pipeline stage: it has the head but not the embedding it is tied to."""
    return (
        getattr(part, "word_embeddings", None) is None
        and getattr(part, "lm_head", None) is not None
    )


def model_state(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Model state under canonical names: the tied head is stored once, as the embedding."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        sd = get_model_state_dict(part)
        if _owns_head_copy(part):
            sd[EMBEDDING] = sd.pop(TIED_HEAD)
        else:
            sd.pop(TIED_HEAD, None)
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
        if _owns_head_copy(part):
            sd[TIED_HEAD] = state[EMBEDDING]
        set_model_state_dict(part, sd, options=options)


def _rename_head(key: str, to_canonical: bool) -> str:
    src, dst = (TIED_HEAD, EMBEDDING) if to_canonical else (EMBEDDING, TIED_HEAD)
    return key.replace(f".{src}.", f".{dst}.")


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """Flattened optimizer state (`state.<param>.<name>`, `param_groups.<param>.<option>`) under
    canonical parameter names."""
    state: dict = {}
    for part, opt in zip(parts, optimizers, strict=True):
        sd = get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS)
        if _owns_head_copy(part):
            sd = {_rename_head(k, to_canonical=True): v for k, v in sd.items()}
        state.update(sd)
    return state


def load_optimizer_state(parts: list[nn.Module], optimizers: list, state: dict) -> None:
    for part, opt in zip(parts, optimizers, strict=True):
        sd = state
        if _owns_head_copy(part):
            sd = {_rename_head(k, to_canonical=False): v for k, v in state.items()}
        set_optimizer_state_dict(part, opt, optim_state_dict=sd, options=_OPTIM_OPTIONS)


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's RNG states, keyed by rank (restored only under the same world size)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = {f"cpu.rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available():
        state[f"cuda.rank{rank}"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        (torch.set_rng_state if key.startswith("cpu.") else torch.cuda.set_rng_state)(value)


def saved_keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def is_model_only(path: Path) -> bool:
    """True for a checkpoint with weights but no training state (tools/convert_hf.py to-native)."""
    return not any(k.startswith("optimizer.") for k in saved_keys(path))


def load(path: Path, state: dict) -> None:
    """Fills `state` in place from the checkpoint at `path`."""
    dcp.load(state, checkpoint_id=str(path))


def local_bytes(state: dict) -> int:
    """Bytes of the tensors this rank writes (its shards)."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += local_bytes(value)
        elif isinstance(value, torch.Tensor):
            t = value.to_local() if isinstance(value, DTensor) else value
            total += t.numel() * t.element_size()
    return total


class Checkpointer:
    """Saves and prunes the checkpoints of one folder; optionally in the background.

    With `async_mode`, `save` returns once the state is staged in host memory; the files are
    written by a background thread over a separate gloo group (so its collectives never
    interleave with training's), and the checkpoint is marked complete by the next `save` or
    `wait`.
    """

    def __init__(self, folder: Path, keep_latest_k: int, async_mode: bool, min_free_gib: float):
        self.folder = folder
        self.keep_latest_k = keep_latest_k
        self.min_free_gib = min_free_gib
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = (
            dist.new_group(backend="gloo") if async_mode and dist.is_initialized() else None
        )
        self.async_mode = async_mode
        self._pending: tuple[Future, int] | None = None

    def save(self, step: int, state: dict) -> None:
        self.wait()
        self._check_free_space(state)
        partial = self.folder / f"step-{step}.partial"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        if self.async_mode:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            self._pending = (future, step)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._finalize(step)

    def wait(self) -> None:
        """Blocks until a background save has finished and marks it complete."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        future.result()
        self._finalize(step)

    def _finalize(self, step: int) -> None:
        if delay := float(os.environ.get("BLOOMNATIVE_FAULT_SAVE_DELAY_S", "0")):
            time.sleep(delay)  # fault injection for tests: widen the window of an unfinished save
        _barrier()  # every rank has written its files
        if self.rank == 0:
            final = self.folder / f"step-{step}"
            if final.exists():
                shutil.rmtree(final)
            (self.folder / f"step-{step}.partial").rename(final)
            self._prune()
        _barrier()

    def _prune(self) -> None:
        """Keeps the newest k complete checkpoints; removes partial ones of crashed saves."""
        for p in self.folder.glob("*.partial"):
            shutil.rmtree(p, ignore_errors=True)
        steps = sorted(
            int(m.group(1)) for p in self.folder.iterdir() if (m := _STEP_DIR.match(p.name))
        )
        if self.keep_latest_k > 0:
            for step in steps[: -self.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)

    def _check_free_space(self, state: dict) -> None:
        """Refuses to start a save that cannot fit (nothing is deleted to make room)."""
        needed = torch.tensor(local_bytes(state), dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(needed, group=self.group)
        probe = self.folder if self.folder.exists() else self.folder.parent
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        required = needed.item() + self.min_free_gib * 2**30
        if free < required:
            raise CheckpointError(
                f"not enough disk space to save a checkpoint in {self.folder}: it needs about "
                f"{needed.item() / 2**30:.2f} GiB plus checkpoint.min_free_gib = "
                f"{self.min_free_gib} GiB, but {free / 2**30:.2f} GiB are free; free space, "
                f"lower checkpoint.keep_latest_k or point job.dump_folder elsewhere"
            )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

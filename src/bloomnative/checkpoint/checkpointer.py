"""Sharded checkpoints with torch.distributed.checkpoint (DCP), checksummed.

Layout: <dump>/<folder>/step-<N>/ holds the DCP files and `checksums.json`, the completion record
(size and CRC-32 of every file, taken as the files were written). A save writes
step-<N>.partial/; after every rank has finished, rank 0 writes the record and renames the folder
to step-<N>, so a folder named step-<N> is always complete; a `.partial` folder is ignored and
removed by the next save.

After a save each rank reads its files back from the disk and compares them with the record;
before a resume the ranks split the record's files and verify them. A checkpoint that fails is
never loaded and never deleted: it is renamed step-<N>.corrupt and reported. Rotation
(`keep_latest_k`) always keeps the newest checkpoint that has verified.

What a checkpoint holds is the composition of its components' states (torchtitan's `Stateful`
pattern): each component (the model, the optimizer, the data loader, the learning-rate clock,
...) has `state_dict`/`load_state_dict`, and its entries are saved under its name
(`<name>.<key>`); `load_components` gives each component back what it saved. Model and optimizer
state are saved under canonical fully qualified parameter names through DCP's state-dict API (the
tied head is stored once, as the embedding), so a checkpoint does not depend on the parallel
layout that wrote it and loads under any other.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from bloomnative.checkpoint.integrity import (
    RECORD,
    ChecksummingWriter,
    FileSum,
    IntegrityError,
    complete_steps,
    gather_sums,
    read_record,
    share_of_files,
    uncheckable,
    unrecorded_files,
    verify_files,
    write_record,
)
from bloomnative.checkpoint.legacy import legacy_states
from bloomnative.log import get_logger
from bloomnative.model.state import canonical_key, load_model_state, model_state, owns_head_copy

_log = get_logger(__name__)

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# torch 2.11's DefaultStager closes itself at the end of each staging, so it serves one save
# (pytorch/pytorch#183413, fixed for 2.13): there every async save stages through a new one.
_STAGER_SERVES_MANY_SAVES = torch.__version__ >= "2.13"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; nothing already saved was touched."""


class BadCheckpointError(CheckpointError):
    """The checkpoint asked for (checkpoint.load_step) is missing or fails verification."""


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """Flattened optimizer state (`state.<param>.<name>`, `param_groups.<param>.<option>`) under
    canonical parameter names."""
    state: dict = {}
    for part, opt in zip(parts, optimizers, strict=True):
        sd = get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS)
        if owns_head_copy(part):
            sd = {canonical_key(k): v for k, v in sd.items()}
        state.update(sd)
    return state


def load_optimizer_state(parts: list[nn.Module], optimizers: list, state: dict) -> None:
    for part, opt in zip(parts, optimizers, strict=True):
        sd = state
        if owns_head_copy(part):
            sd = {canonical_key(k, to_canonical=False): v for k, v in state.items()}
        set_optimizer_state_dict(part, opt, optim_state_dict=sd, options=_OPTIM_OPTIONS)


class ModelState:
    """The weights of this rank's model parts (whole model or pipeline stages), as a component
    of a checkpoint."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict[str, torch.Tensor]:
        return model_state(self.parts)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.parts, state)


class OptimizerState:
    """The optimizers of this rank's model parts, as a component of a checkpoint."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts, self.optimizers = parts, optimizers

    def state_dict(self) -> dict:
        return optimizer_state(self.parts, self.optimizers)

    def load_state_dict(self, state: dict) -> None:
        load_optimizer_state(self.parts, self.optimizers, state)


class RNGState:
    """This rank's RNG states, keyed by rank: restored only when a checkpoint holds every one of
    this rank's keys (the same rank existed when it was saved)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        state = {f"cpu.rank{rank}": torch.get_rng_state()}
        if torch.cuda.is_available():
            state[f"cuda.rank{rank}"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state.keys() != self.state_dict().keys():
            return
        for key, value in state.items():
            (torch.set_rng_state if key.startswith("cpu.") else torch.cuda.set_rng_state)(value)


def saved_shapes(path: Path) -> dict[str, torch.Size | None]:
    """Key -> global shape of every entry of the checkpoint at `path` (None: not a tensor)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key: getattr(entry, "size", None) for key, entry in metadata.items()}


def is_model_only(path: Path) -> bool:
    """True for a checkpoint with weights but no training state (tools/convert_hf.py to-native)."""
    return not any(k.startswith("optimizer.") for k in saved_shapes(path))


def load_components(
    path: Path, components: Mapping[str, Stateful], complete: Collection[str] = ()
) -> None:
    """Loads every component from the checkpoint at `path` in one read. Each component asks for
    the entries of its `state_dict()`; the components named in `complete` must find all of them
    (a missing or reshaped weight is an error). The others get what the checkpoint holds in the
    shape they ask for, and their `load_state_dict` decides what a missing entry means (a
    checkpoint from before a component saved something, or with spike detection off). A
    checkpoint in the format of before components owned their state is read through
    `checkpoint.legacy`."""
    saved = saved_shapes(path)
    request = {}
    for name, component in components.items():
        state = component.state_dict()
        if name not in complete:
            state = {k: v for k, v in state.items() if _holds(saved, f"{name}.{k}", v)}
        request[name] = state
    dcp.load(request, checkpoint_id=str(path))
    legacy = legacy_states(path, saved)
    for name, component in components.items():
        component.load_state_dict({**legacy.get(name, {}), **request[name]})


def _holds(saved: dict[str, torch.Size | None], key: str, value: object) -> bool:
    """Whether the checkpoint has `key` in `value`'s global shape (both not tensors, or both
    tensors of one shape)."""
    shape = value.shape if isinstance(value, torch.Tensor) else None
    return key in saved and saved[key] == shape


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


def host_stager() -> DefaultStager:
    """How an async save copies the state to host memory before `save` returns (DCP's stager).
    With CUDA the copy is pinned memory and the device-to-host copies are issued non-blocking,
    then waited for together; on a CPU-only machine it is ordinary memory (pinning needs CUDA).
    The host copy is kept for the next save through the same stager, which copies into it again
    (the previous write has ended by then: `save` waits for it), so only the first save
    allocates and pins it."""
    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,  # the writer is a thread of this process
            use_async_staging=False,  # staged before `save` returns: training may change it
            use_non_blocking_copy=cuda,
        )
    )


@dataclass
class _PendingSave:
    """A save whose files are written (or being written, async) but not yet judged."""

    step: int
    writer: ChecksummingWriter
    check: Future  # -> this rank's problems reading its files back: {file: problem}


class Checkpointer:
    """Saves, verifies and prunes the checkpoints of one folder; optionally in the background.

    With `async_mode`, `save` returns once the state is staged in host memory (`host_stager`:
    pinned on CUDA, so the step waits only for the device-to-host copies); the files are
    written by a background thread over a separate gloo group (so its collectives never
    interleave with training's), and the checkpoint is marked complete by the next `save` or
    `wait`. Either way each rank then reads its files back (from the disk, not the page cache,
    where the OS allows) on a background thread; the verdict is collected by the next `save` or
    `wait`, which also prunes.
    """

    def __init__(self, folder: Path, keep_latest_k: int, async_mode: bool, min_free_gib: float):
        self.folder = folder
        self.keep_latest_k = keep_latest_k
        self.min_free_gib = min_free_gib
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # Collective when distributed: every rank constructs its Checkpointer at the same point.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.async_mode = async_mode
        self._stager = host_stager() if async_mode else None
        self.verified: set[int] = set()
        """Steps whose files matched their record in this process (after saving or loading)."""
        self._pending: _PendingSave | None = None
        self._checker = ThreadPoolExecutor(1, "bloomnative-checkpoint-check")

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: dict) -> None:
        self.wait()
        self._check_free_space(state)
        partial = self.folder / f"step-{step}.partial"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()
        writer = ChecksummingWriter(partial)
        if self.async_mode:
            if not _STAGER_SERVES_MANY_SAVES:
                self._stager = host_stager()
            write = dcp.async_save(
                state, storage_writer=writer, process_group=self.group, async_stager=self._stager
            )
            check = self._checker.submit(_written_then_read_back, write, writer, partial)
            self._pending = _PendingSave(step, writer, check)
        else:
            dcp.save(state, storage_writer=writer)
            self._complete(step, writer.sums)
            check = self._checker.submit(_read_back, self.path(step), writer.sums)
            self._pending = _PendingSave(step, writer, check)

    def wait(self) -> None:
        """Blocks until the last save is written (async) and read back; marks it complete, takes
        the verdict and prunes."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        problems = pending.check.result()  # raises what a background write raised
        if self.async_mode:  # a synchronous save was completed by `save` itself
            self._complete(pending.step, pending.writer.sums)
        _log.debug(
            f"step-{pending.step}: read back this rank's {len(pending.writer.sums)} files: "
            f"{len(problems)} differ from what was written"
        )
        self._judge(pending.step, problems, "reading it back after the save")
        if self.rank == 0:
            self._prune()
        self._barrier()

    def _complete(self, step: int, sums: dict[str, FileSum]) -> None:
        """Rank 0 writes the completion record from every rank's file sums, then renames
        step-<N>.partial to step-<N>."""
        merged = gather_sums(sums, self.group)
        if merged is not None:
            partial, final = self.folder / f"step-{step}.partial", self.path(step)
            write_record(partial, merged)
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
        self._barrier()

    def _judge(self, step: int, problems: dict[str, str], when: str) -> None:
        """Collective: `step` counts as verified if no rank found a problem, else it is set
        aside with a warning."""
        merged = self._all_problems(problems)
        if merged:
            self._set_aside(step, f"{when}: {_describe(merged, self.path(step))}")
        else:
            self.verified.add(step)

    def _prune(self) -> None:
        """Keeps the newest k complete checkpoints and the newest verified one; removes partial
        ones of crashed saves. Checkpoints set aside as corrupt are not touched."""
        for p in self.folder.glob("*.partial"):
            shutil.rmtree(p, ignore_errors=True)
        steps = complete_steps(self.folder)
        if self.keep_latest_k <= 0:
            return
        keep = set(steps[-self.keep_latest_k :])
        if verified := self.verified.intersection(steps):
            keep.add(max(verified))
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.path(step), ignore_errors=True)

    def _check_free_space(self, state: dict) -> None:
        """Refuses to start a save that cannot fit (nothing is deleted to make room)."""
        needed = torch.tensor(local_bytes(state), dtype=torch.float64)
        if self.distributed:
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

    # ------------------------------------------------------------------ verifying before a load

    def verify(self, step: int) -> str | None:
        """Collective: None if checkpoint `step`'s files match its record (the ranks split the
        reading), else the first problem found, naming the file. A checkpoint that cannot be
        verified (no record: written before records existed; or summed with a checksum this
        process cannot compute) passes with a warning."""
        folder = self.path(step)
        problems: dict[str, str] = {}
        unverifiable = None
        try:
            record = read_record(folder)
            if record is None:
                unverifiable = f"it has no {RECORD}"
            elif why := uncheckable(record):
                unverifiable = why
            else:
                if self.rank == 0:
                    problems = dict.fromkeys(unrecorded_files(folder, record), "not in the record")
                mine = share_of_files(record, self.rank, self.world_size)
                problems.update(verify_files(folder, record, mine))
                _log.debug(f"{folder}: checked this rank's {len(mine)} files against its {RECORD}")
        except (IntegrityError, OSError) as e:
            problems = {RECORD: str(e)}
        merged = self._all_problems(problems)
        if merged:
            return _describe(merged, folder)
        if unverifiable:
            _log.warning(f"cannot verify {folder} ({unverifiable}): loading it unverified")
        else:
            self.verified.add(step)
        return None

    def newest_verified(self, before: int | None = None) -> int | None:
        """Collective: the newest complete checkpoint (with a step below `before`, if given)
        that verifies. Those that fail are set aside as corrupt, with a warning each."""
        for step in reversed(complete_steps(self.folder)):
            if before is not None and step >= before:
                continue
            problem = self.verify(step)
            if problem is None:
                return step
            self._set_aside(step, problem)
        return None

    def require(self, step: int) -> None:
        """Collective: raises BadCheckpointError unless checkpoint `step` exists and verifies.
        The message names the problem and the newest checkpoint that does verify."""
        if not self.path(step).is_dir():
            problem = f"no complete checkpoint at {self.path(step)}"
        elif (problem := self.verify(step)) is None:
            return
        good = next(
            (s for s in reversed(complete_steps(self.folder)) if s != step and not self.verify(s)),
            None,
        )
        hint = (
            f"the newest checkpoint that verifies is step {good} (set checkpoint.load_step = "
            f"{good}, or -1 to take the newest good one)"
            if good is not None
            else "no checkpoint in the folder verifies (set checkpoint.load_step = -1 to start "
            "afresh)"
        )
        raise BadCheckpointError(f"checkpoint.load_step = {step}: {problem}; {hint}")

    def set_aside_after(self, step: int, tag: str) -> None:
        """Collective: renames every complete checkpoint newer than `step` to
        step-<N>.<tag> (out of reach of resumes and rotation, not deleted)."""
        newer = [s for s in complete_steps(self.folder) if s > step]
        if self.rank == 0 and newer:
            names = ", ".join(self._rename_aside(s, tag) for s in newer)
            _log.info(f"set aside checkpoints newer than step-{step}: {names}")
        self.verified.difference_update(newer)
        self._barrier()

    def _set_aside(self, step: int, reason: str) -> None:
        """Collective: renames step-<N> to step-<N>.corrupt (never deletes it) and says why."""
        if self.rank == 0:
            name = self._rename_aside(step, "corrupt")
            _log.warning(f"checkpoint step-{step} is corrupt, skipped: {reason}; left as {name}")
        self.verified.discard(step)
        self._barrier()

    def _rename_aside(self, step: int, tag: str) -> str:
        """Renames step-<N> to step-<N>.<tag> (or .<tag>-2, ...: never over another); rank 0."""
        target = self.folder / f"step-{step}.{tag}"
        n = 1
        while target.exists():
            n += 1
            target = self.folder / f"step-{step}.{tag}-{n}"
        self.path(step).rename(target)
        return target.name

    # ------------------------------------------------------------------ collectives

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _all_problems(self, problems: dict[str, str]) -> dict[str, str]:
        if not self.distributed:
            return problems
        every = [None] * self.world_size
        dist.all_gather_object(every, problems, group=self.group)
        return {name: p for rank_problems in every for name, p in rank_problems.items()}


def _describe(problems: dict[str, str], folder: Path) -> str:
    """One line: the first problem (by file name), with the file's path, and how many more."""
    name = min(problems)
    more = len(problems) - 1
    return f"{folder / name}: {problems[name]}" + (f" (and {more} more files)" if more else "")


def _read_back(folder: Path, sums: dict[str, FileSum]) -> dict[str, str]:
    """This rank's files in `folder` read from the disk and compared with what it wrote."""
    return verify_files(folder, sums, sums, from_storage=True)


def _written_then_read_back(
    write: Future, writer: ChecksummingWriter, folder: Path
) -> dict[str, str]:
    write.result()
    return _read_back(folder, writer.sums)

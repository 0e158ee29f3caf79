"""Sharded checkpoints with torch.distributed.checkpoint (DCP), checksummed.

Layout: <dump>/<folder>/step-<N>/ holds the DCP files and `checksums.json`, the completion record
(size and CRC-32 of every file, taken as the files were written). A save writes
step-<N>.partial/; after every rank has finished, rank 0 writes the record and renames the folder
to step-<N>, so a folder named step-<N> is always complete; a `.partial` folder is ignored and
removed by the next save.

After a save each rank reads its files back from the disk and compares them with the record;
before a resume the ranks split the record's files and verify them, and only then is anything
of the folder read, through checkpoint/reading.py (no code in a checkpoint ever runs). A
checkpoint that cannot be loaded (corrupt, unverifiable here, or of another model) is never
deleted: when an older one is resumed instead it is renamed step-<N>.<why> and reported; when
none can be, nothing is renamed and the resume is refused (checkpoint/resume.py decides which
checkpoint a run starts from). Rotation (`keep_latest_k`) always keeps the newest checkpoint
that has verified.

Before a save, the disk's free space is compared with what the checkpoint will take
(checkpoint/footprint.py: DCP's own plan of the files, within a fraction of a percent), after
removing the `.partial` folders that saves which did not complete left behind; a disk too full
raises DiskSpaceError and nothing is written. A save that fails while writing (a full disk, an
I/O error) raises CheckpointWriteError at that step (an async save's at the first step after
its background write failed), naming the cause, the disk and its free space, and removes its
own `.partial` folder; the checkpoints already complete are untouched.

What a checkpoint holds is the composition of its components' states (torchtitan's `Stateful`
pattern): each component (the model, the optimizer, the data loader, the learning-rate clock,
...) has `state_dict`/`load_state_dict`, and its entries are saved under its name
(`<name>.<key>`); `load_components` gives each component back what it saved. Model and optimizer
state are saved under canonical fully qualified parameter names through DCP's state-dict API (the
tied head is stored once, as the embedding), so a checkpoint does not depend on the parallel
layout that wrote it and loads under any other.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from bloomnative.checkpoint import reading
from bloomnative.checkpoint.disk import describe_disk, describe_os_error, format_bytes
from bloomnative.checkpoint.footprint import Footprint
from bloomnative.checkpoint.integrity import (
    METADATA,
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
from bloomnative.checkpoint.reading import CheckpointReader
from bloomnative.checkpoint.run_record import json_file_bytes, write_json_file
from bloomnative.log import get_logger
from bloomnative.model.state import (
    canonical_key,
    load_model_state,
    model_state,
    owns_head_copy,
    stored_tensor,
)

_log = get_logger(__name__)

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# What a failed save raises: DCP gathers the ranks' errors into a CheckpointException, which is
# a BaseException.
_WRITE_FAILURES = (Exception, CheckpointException)

# torch 2.11's DefaultStager closes itself at the end of each staging, so it serves one save
# (pytorch/pytorch#183413, fixed for 2.13): there every async save stages through a new one.
_STAGER_SERVES_MANY_SAVES = torch.__version__ >= "2.13"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; nothing already saved was touched."""


class BadCheckpointError(CheckpointError):
    """The run cannot resume as configured: the checkpoint asked for (checkpoint.load_step) is
    missing or cannot be loaded, none of the folder's checkpoints can be, or the one found was
    trained on other data. Nothing was loaded or renamed."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (a full disk, an I/O error); the complete ones are intact and
    the failed save's own `.partial` folder is removed."""


class DiskSpaceError(CheckpointError):
    """The disk has too little free space to start a save (nothing was written or deleted, but
    the `.partial` folders of saves that did not complete). A restart meets the same disk."""


@dataclass(frozen=True)
class Rejection:
    """Why a complete checkpoint is not loaded. `kind` is also the suffix it is set aside
    under: "corrupt" (its files differ from its record), "unverified" (it has no record, or
    one this process cannot check) or "foreign" (another model's)."""

    step: int
    kind: str
    reason: str

    def describe(self) -> str:
        what = {
            "corrupt": "is corrupt",
            "unverified": "cannot be verified",
            "foreign": "does not fit this run",
        }[self.kind]
        return f"checkpoint step-{self.step} {what}: {self.reason}"


Fits = Callable[[CheckpointReader], str | None]
"""Why a verified checkpoint cannot be loaded into this run (another model shape, ...), or None."""


def first_usable(
    steps: Iterable[int], rejection: Callable[[int], Rejection | None]
) -> tuple[int | None, list[Rejection]]:
    """The first of `steps` that `rejection` passes, and the rejections of those before it (None,
    and every rejection, when it passes none)."""
    rejected: list[Rejection] = []
    for step in steps:
        why = rejection(step)
        if why is None:
            return step, rejected
        rejected.append(why)
    return None, rejected


def optimizer_state(
    parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> dict:
    """Flattened optimizer state (`state.<param>.<name>`, `param_groups.<param>.<option>`) under
    canonical parameter names, plain tensors (`model.state.stored_tensor`: AdamW's moments of
    an FP8 all-gather weight are made like it)."""
    state: dict = {}
    for part, opt in zip(parts, optimizers, strict=True):
        sd = get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS)
        sd = {k: stored_tensor(v) for k, v in sd.items()}
        if owns_head_copy(part):
            sd = {canonical_key(k): v for k, v in sd.items()}
        state.update(sd)
    return state


def load_optimizer_state(
    parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], state: dict
) -> None:
    for part, opt in zip(parts, optimizers, strict=True):
        sd = state
        if owns_head_copy(part):
            sd = {canonical_key(k, to_canonical=False): v for k, v in state.items()}
        set_optimizer_state_dict(part, opt, optim_state_dict=sd, options=_OPTIM_OPTIONS)


class ModelState:
    """The weights of this rank's model parts (whole model or pipeline stages), as a component
    of a checkpoint. `frozen`: with the parameters that do not train; without them, the
    checkpoint of a LoRA run holds its adapters, and its frozen base is loaded from where it
    came from (checkpoint.initial_hf, `resume.Resume.base`)."""

    def __init__(self, parts: Sequence[nn.Module], frozen: bool = True):
        self.parts, self.frozen = parts, frozen

    def state_dict(self) -> dict[str, torch.Tensor]:
        return model_state(self.parts, self.frozen)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.parts, state)


class OptimizerState:
    """The optimizers of this rank's model parts, as a component of a checkpoint."""

    def __init__(self, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]):
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


def is_model_only(reader: CheckpointReader) -> bool:
    """True for a checkpoint with weights but no training state (tools/convert_hf.py to-native)."""
    return not any(k.startswith("optimizer.") for k in reader.shapes())


def load_components(
    reader: CheckpointReader, components: Mapping[str, Stateful], complete: Collection[str] = ()
) -> None:
    """Loads every component from the verified checkpoint `reader` reads, in one read. Each
    component asks for the entries of its `state_dict()`; the components named in `complete`
    must find all of them (a missing or reshaped weight is an error). The others get what the
    checkpoint holds in the shape they ask for, and their `load_state_dict` decides what a
    missing entry means (a checkpoint from before a component saved something, or with spike
    detection off). A checkpoint in the format of before components owned their state is read
    through `checkpoint.legacy`."""
    saved = reader.shapes()
    request = {}
    for name, component in components.items():
        state = component.state_dict()
        if name not in complete:
            state = {k: v for k, v in state.items() if _holds(saved, f"{name}.{k}", v)}
        request[name] = state
    reading.load(request, reader)
    legacy = legacy_states(reader)
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
    files: Mapping[str, dict] = field(default_factory=dict)  # written by rank 0 on completion


class Checkpointer:
    """Saves, verifies and prunes the checkpoints of one folder; optionally in the background.

    With `async_mode`, `save` returns once the state is staged in host memory (`host_stager`:
    pinned on CUDA, so the step waits only for the device-to-host copies); the files are
    written by a background thread over a separate gloo group (so its collectives never
    interleave with training's), and the checkpoint is marked complete by the next `save` or
    `wait`. Either way each rank then reads its files back (from the disk, not the page cache,
    where the OS allows) on a background thread; the verdict is collected by the next `save` or
    `wait`, which also prunes.

    `before_complete`, if given, is called with the step on every rank once a save's files are
    written, just before the save is marked complete (a test holds saves there, so that a
    signal or a kill lands inside one).
    """

    def __init__(
        self,
        folder: Path,
        keep_latest_k: int,
        async_mode: bool,
        min_free_gib: float,
        before_complete: Callable[[int], None] | None = None,
    ):
        self.folder = folder
        self.keep_latest_k = keep_latest_k
        self.min_free_gib = min_free_gib
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # Collective when distributed: every rank constructs its Checkpointer at the same point.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.async_mode = async_mode
        self.before_complete = before_complete
        self._stager = host_stager() if async_mode else None
        self.verified: set[int] = set()
        """Steps whose files matched their record in this process (after saving or loading)."""
        self._readers: dict[int, CheckpointReader] = {}
        self._pending: _PendingSave | None = None
        self._checker = ThreadPoolExecutor(1, "bloomnative-checkpoint-check")
        self._footprint = Footprint(self.group)

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: dict, files: Mapping[str, dict] | None = None) -> None:
        """Saves `state` as checkpoint `step` (collective), with `files`: JSON records that rank
        0 writes beside DCP's files (checkpoint/run_record.py), covered by the checksum record.
        Raises DiskSpaceError when the disk is too full to start, CheckpointWriteError when a
        write fails (async: from `poll`, `wait` or the next `save`)."""
        self.wait()
        files = files or {}
        partial = self.folder / f"step-{step}.partial"
        self._make_room(step, state, files)
        writer = ChecksummingWriter(partial)
        try:
            if self.async_mode:
                if not _STAGER_SERVES_MANY_SAVES:
                    self._stager = host_stager()
                write = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=self.group,
                    async_stager=self._stager,
                )
                # A Future: the stager stages before async_save returns (use_async_staging off).
                assert isinstance(write, Future)
                check = self._checker.submit(_written_then_read_back, write, writer, partial)
                self._pending = _PendingSave(step, writer, check, files)
            else:
                dcp.save(state, storage_writer=writer)
                self._complete(step, writer.sums, files)
                check = self._checker.submit(_read_back, self.path(step), writer.sums)
                self._pending = _PendingSave(step, writer, check)
        except _WRITE_FAILURES as e:
            raise CheckpointWriteError(self._write_failure(step, writer, e)) from e

    def poll(self, step: int) -> None:
        """Raises CheckpointWriteError if the background write of an async save has failed, at
        training step `step` (the trainer asks every step: a look at a future, no device work
        and no collective)."""
        pending = self._pending
        if pending is None or not pending.check.done() or pending.check.exception() is None:
            return
        self._pending = None
        error = pending.check.exception()
        assert error is not None  # looked at above
        raise CheckpointWriteError(
            self._write_failure(pending.step, pending.writer, error, noticed_at=step)
        ) from error

    def wait(self) -> None:
        """Blocks until the last save is written (async) and read back; marks it complete, takes
        the verdict and prunes."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            problems = pending.check.result()  # raises what a background write raised
            if self.async_mode:  # a synchronous save was completed by `save` itself
                self._complete(pending.step, pending.writer.sums, pending.files)
        except _WRITE_FAILURES as e:
            raise CheckpointWriteError(self._write_failure(pending.step, pending.writer, e)) from e
        _log.debug(
            f"step-{pending.step}: read back this rank's {len(pending.writer.sums)} files: "
            f"{len(problems)} differ from what was written"
        )
        self._judge(pending.step, problems, "reading it back after the save")
        if self.rank == 0:
            self._prune()
        self._barrier()

    def _complete(self, step: int, sums: dict[str, FileSum], files: Mapping[str, dict]) -> None:
        """Rank 0 writes `files` and the completion record from every rank's file sums, then
        renames step-<N>.partial to step-<N>."""
        if self.before_complete is not None:
            self.before_complete(step)
        merged = gather_sums(sums, self.group)
        if merged is not None:
            partial, final = self.folder / f"step-{step}.partial", self.path(step)
            for name, content in files.items():
                write_json_file(partial, name, content)
            write_record(partial, merged)
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
        self._barrier()

    def _write_failure(
        self,
        step: int,
        writer: ChecksummingWriter,
        error: BaseException,
        noticed_at: int | None = None,
    ) -> str:
        """One line: which save failed and why, on which disk with how much space left, and
        which checkpoint is the newest intact one."""
        partial = self.folder / f"step-{step}.partial"
        error = _unwrapped(error)
        os_error = next(iter(writer.write_errors), None) or _os_error_in(error)
        if os_error is not None:
            cause = describe_os_error(os_error)
        else:
            cause = f"{type(error).__name__}: {(str(error).strip() or '?').splitlines()[0]}"
        when = f" (found at step {noticed_at}: it was written in the background)"
        newest = [s for s in complete_steps(self.folder) if s != step]
        intact = (
            f"the newest complete checkpoint, step-{newest[-1]}, is intact"
            if newest
            else "no earlier checkpoint exists"
        )
        disk = describe_disk(partial)  # as the write found it, before the removal below
        removed = ""
        if self.rank == 0 and partial.exists():
            # Every rank is past its writes (DCP gathers their outcomes before raising), and
            # nothing ever loads a .partial folder: what it holds is only taking the disk.
            size = _tree_bytes(partial)
            shutil.rmtree(partial, ignore_errors=True)
            removed = f"; its partial folder ({format_bytes(size)}) is removed"
        return (
            f"writing checkpoint step-{step} into {partial} failed"
            f"{when if noticed_at is not None else ''}: {cause}; {disk}; {intact}{removed}"
        )

    def _judge(self, step: int, problems: dict[str, str], when: str) -> None:
        """Collective: `step` counts as verified if no rank found a problem, else it is set
        aside with a warning."""
        merged = self._all_problems(problems)
        if merged:
            reason = f"{when}: {_describe(merged, self.path(step))}"
            self.set_aside(Rejection(step, "corrupt", reason))
        else:
            self.verified.add(step)

    def _prune(self) -> None:
        """Keeps the newest k complete checkpoints and the newest verified one; removes partial
        ones of crashed saves. Checkpoints set aside are not touched."""
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

    def _make_room(self, step: int, state: dict, files: Mapping[str, dict]) -> None:
        """Collective: removes the `.partial` folders of saves that did not complete (a crash, a
        kill, a failed write: nothing loads them) and refuses, with DiskSpaceError on every
        rank, to start a save that the disk cannot hold with checkpoint.min_free_gib to spare.
        Nothing else is deleted to make room. Rank 0 decides, for every rank."""
        texts = {name: json_file_bytes(content) for name, content in files.items()}
        needed = self._footprint.of(state, texts, self.folder / f"step-{step}.partial")
        verdict = None
        if self.rank == 0:
            assert needed is not None  # the footprint's sum is rank 0's
            self.folder.mkdir(parents=True, exist_ok=True)
            verdict = self._space_verdict(step, needed)
        if self.distributed:
            box = [verdict]
            dist.broadcast_object_list(box, src=0, group=self.group)
            verdict = box[0]
        if verdict is not None:
            raise DiskSpaceError(verdict)

    def _space_verdict(self, step: int, needed: int) -> str | None:
        """Rank 0: removes leftover `.partial` folders, then None if the disk holds `needed`
        more bytes and checkpoint.min_free_gib, else the one line that says it does not."""
        removed = []
        for leftover in sorted(self.folder.glob("step-*.partial")):
            size = _tree_bytes(leftover)
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(f"{leftover.name} ({format_bytes(size)})")
        if removed:
            _log.info(
                f"removed {', '.join(removed)} from {self.folder}: left by a save that did not "
                "complete (never loaded)"
            )
        free = shutil.disk_usage(self.folder).free
        margin = self.min_free_gib * 2**30
        if free >= needed + margin:
            return None
        complete = complete_steps(self.folder)
        held = format_bytes(sum(_tree_bytes(self.path(s)) for s in complete))
        names = ", ".join(f"step-{s}" for s in complete)
        rotation = (
            "checkpoint.keep_latest_k = 0 keeps every one"
            if self.keep_latest_k <= 0
            else f"checkpoint.keep_latest_k = {self.keep_latest_k} removes older ones only once "
            "a save has succeeded"
        )
        checkpoints = (
            "it holds no complete checkpoint"
            if not complete
            else f"its complete checkpoint {names} takes {held}; {rotation}"
            if len(complete) == 1
            else f"its {len(complete)} complete checkpoints ({names}) take {held}; {rotation}"
        )
        after = f" (after removing {', '.join(removed)})" if removed else ""
        return (
            f"not enough disk space to save a checkpoint in {self.folder}: step-{step} takes "
            f"{format_bytes(needed)} plus checkpoint.min_free_gib = {self.min_free_gib} GiB, but "
            f"{describe_disk(self.folder)}{after}; free {format_bytes(needed + margin - free)} "
            f"more ({checkpoints}), lower checkpoint.min_free_gib or point job.dump_folder "
            "elsewhere"
        )

    # ------------------------------------------------------------------ verifying before a load

    def verify(self, step: int) -> Rejection | None:
        """Collective: None if checkpoint `step`'s files match its record (the ranks split the
        reading) and its metadata is safe to read (checkpoint/reading.py), else why not. Files
        in the folder that the record does not list are reported (rank 0) and ignored. A
        checkpoint with no record, or summed with a checksum this process cannot compute, is
        rejected as "unverified": nothing of it is read."""
        folder = self.path(step)
        problems: dict[str, str] = {}
        unverifiable = None
        extra: list[str] = []
        record = None
        try:
            record = read_record(folder)
            if record is None:
                unverifiable = f"it has no {RECORD}"
            elif why := uncheckable(record):
                unverifiable = why
            else:
                if self.rank == 0:
                    extra = unrecorded_files(folder, record)
                mine = share_of_files(record, self.rank, self.world_size)
                problems.update(verify_files(folder, record, mine))
                _log.debug(f"{folder}: checked this rank's {len(mine)} files against its {RECORD}")
        except (IntegrityError, OSError) as e:
            problems = {RECORD: str(e)}
        if record is not None and not unverifiable and not problems:
            try:
                self._readers[step] = CheckpointReader(folder, record)
            except IntegrityError as e:
                problems = {METADATA: str(e)}
        merged = self._all_problems(problems)
        if merged:
            self._readers.pop(step, None)
            return Rejection(step, "corrupt", _describe(merged, folder))
        if unverifiable:
            return Rejection(step, "unverified", f"{unverifiable}, so nothing in it is read")
        if extra:
            _log.warning(
                f"{folder}: {', '.join(extra)} not listed in its {RECORD}: ignored (a checkpoint "
                "reads only the files its record vouches for)"
            )
        self.verified.add(step)
        return None

    def reader(self, step: int) -> CheckpointReader:
        """The reader of checkpoint `step`, which `verify` has passed in this process."""
        if step not in self._readers:
            raise CheckpointError(f"checkpoint step-{step} has not been verified in this process")
        return self._readers[step]

    def usable(self, step: int, fits: Fits | None = None) -> Rejection | None:
        """Collective: None if checkpoint `step` verifies and `fits` this run, else why not."""
        rejection = self.verify(step)
        if rejection is None and fits is not None:
            try:
                why = fits(self.reader(step))
            except IntegrityError as e:
                return Rejection(step, "corrupt", str(e))
            if why is not None:
                return Rejection(step, "foreign", why)
        return rejection

    def newest_usable(
        self, fits: Fits | None = None, before: int | None = None
    ) -> tuple[int | None, list[Rejection]]:
        """Collective: the newest complete checkpoint (with a step below `before`, if given)
        that verifies and `fits`, and the newer ones that do not. When one is found, those are
        set aside (renamed step-<N>.<kind>, a warning each) so that this run's own saves and
        rotation never meet them; when none is, nothing is renamed."""
        steps = [s for s in reversed(complete_steps(self.folder)) if before is None or s < before]
        step, rejected = first_usable(steps, lambda s: self.usable(s, fits))
        if step is not None:
            for passed_over in rejected:
                self.set_aside(passed_over)
        return step, rejected

    def set_aside_after(self, step: int, tag: str) -> None:
        """Collective: renames every complete checkpoint newer than `step` to
        step-<N>.<tag> (out of reach of resumes and rotation, not deleted)."""
        newer = [s for s in complete_steps(self.folder) if s > step]
        if self.rank == 0 and newer:
            names = ", ".join(self._rename_aside(s, tag) for s in newer)
            _log.info(f"set aside checkpoints newer than step-{step}: {names}")
        self.verified.difference_update(newer)
        self._barrier()

    def set_aside(self, rejection: Rejection) -> None:
        """Collective: renames step-<N> to step-<N>.<kind> (never deletes it) and says why."""
        if self.rank == 0:
            name = self._rename_aside(rejection.step, rejection.kind)
            _log.warning(f"{rejection.describe()}; skipped, left as {name}")
        self.verified.discard(rejection.step)
        self._readers.pop(rejection.step, None)
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
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, problems, group=self.group)
        return {name: p for rank_problems in every for name, p in rank_problems.items()}


def _describe(problems: dict[str, str], folder: Path) -> str:
    """One line: the first problem (by file name), with the file's path, and how many more."""
    name = min(problems)
    more = len(problems) - 1
    return f"{folder / name}: {problems[name]}" + (f" (and {more} more files)" if more else "")


def _tree_bytes(folder: Path) -> int:
    """The disk the files under `folder` take (as `du` counts it)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _unwrapped(error: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException (else `error`)."""
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def _os_error_in(error: BaseException) -> OSError | None:
    """The first OSError in `error`'s chain of causes."""
    seen = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _read_back(folder: Path, sums: dict[str, FileSum]) -> dict[str, str]:
    """This rank's files in `folder` read from the disk and compared with what it wrote."""
    return verify_files(folder, sums, sums, from_storage=True)


def _written_then_read_back(
    write: Future, writer: ChecksummingWriter, folder: Path
) -> dict[str, str]:
    write.result()
    return _read_back(folder, writer.sums)

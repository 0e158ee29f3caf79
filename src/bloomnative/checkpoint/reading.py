"""Reading a verified checkpoint folder without running anything from it.

DCP keeps two kinds of pickles in a checkpoint folder: `.metadata` (the index of every entry:
which file, which byte range, which shape) and the non-tensor entries of the state (the
optimizer's hyper-parameters, the data loader's skipped windows), and DCP itself unpickles both
with Python's full unpickler, which runs whatever code a pickle names. Here:

- `.metadata` is read by `MetadataUnpickler`, which builds only the classes a checkpoint's index
  is made of (DCP's metadata dataclasses, `torch.Size`, dtypes, layouts, paths), so a planted
  pickle fails with an error naming what it asked for instead of running it;
- the index may name only files of its own folder that its checksum record lists, in byte
  ranges inside them, with no storage transforms (bloomnative writes none);
- non-tensor entries are read with `torch.load(weights_only=True)` (plain containers, numbers,
  strings, tensors), as DCP already reads tensors.

A `CheckpointReader` is made from a record that has been checked against the files (by the
trainer's `Checkpointer.verify`, collectively, or by `verified_reader` in one process), so
nothing of the folder is unpickled unless it verified. See docs/checkpointing.md, "Trust".
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from bloomnative.checkpoint.integrity import (
    METADATA,
    RECORD,
    FileSum,
    IntegrityError,
    open_plain_file,
    read_record,
    uncheckable,
    verify_files,
)

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name: torch.strided, ...
    # StorageMeta.checkpoint_id: the folder the save wrote (pathlib._local from Python 3.13 on).
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
}
_DTYPES = {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
ALLOWED_GLOBALS = frozenset(_METADATA_CLASSES | _DTYPES)
"""(module, name) of everything a DCP `.metadata` file of bloomnative's checkpoints refers to,
under every parallel layout (tests/train/test_checkpoint_trust.py checks FSDP, TP, PP and CP
checkpoints and model-only ones against it)."""
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class UnsafeCheckpointError(IntegrityError):
    """A checkpoint's metadata asks for something a checkpoint never holds (code to run, a file
    outside its folder): nothing of it is loaded."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file, building only `ALLOWED_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(
                f"it refers to {module}.{name}, which checkpoint metadata never holds"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("it refers to a persistent object")


def read_metadata(folder: Path, record: dict[str, FileSum]) -> Metadata:
    """The DCP index of the checkpoint in `folder`, whose files matched `record`: unpickled by
    `MetadataUnpickler` and checked to name only the record's files, within their sizes. Raises
    UnsafeCheckpointError (or IntegrityError) naming the file and what is wrong."""
    path = folder / METADATA
    if METADATA not in record:
        raise IntegrityError(f"{folder}: its {RECORD} does not list {METADATA}")
    try:
        with open_plain_file(path) as f:
            metadata = MetadataUnpickler(io.BytesIO(f.read())).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{path}: {e}; not loaded") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise IntegrityError(f"{path} is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    _check_storage(path, metadata, record)
    return metadata


def _check_storage(path: Path, metadata: Metadata, record: dict[str, FileSum]) -> None:
    """Every entry's bytes must lie in a file of the record, with no transform to apply."""
    if not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpointError(f"{path}: its storage index is not a mapping")
    for index, info in metadata.storage_data.items():
        where = getattr(index, "fqn", index)
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise UnsafeCheckpointError(f"{path}: entry {where!r} has no file name")
        name = info.relative_path
        if name not in record or name in (METADATA, RECORD):
            raise UnsafeCheckpointError(
                f"{path}: entry {where!r} is stored in {name!r}, which is not a data file of "
                f"this checkpoint's {RECORD}"
            )
        if not (
            isinstance(info.offset, int)
            and isinstance(info.length, int)
            and 0 <= info.offset
            and 0 <= info.length
            and info.offset + info.length <= record[name].size
        ):
            raise UnsafeCheckpointError(
                f"{path}: entry {where!r} lies outside {name} ({record[name].size} bytes)"
            )
        if info.transform_descriptors:
            raise UnsafeCheckpointError(
                f"{path}: entry {where!r} asks for storage transforms "
                f"{list(info.transform_descriptors)}, which bloomnative never writes"
            )


class CheckpointReader(FileSystemReader):
    """DCP's file reader for a checkpoint folder whose files matched `record`: its metadata is
    `read_metadata`'s (read once, then kept)."""

    def __init__(self, folder: Path, record: dict[str, FileSum]):
        super().__init__(folder)
        self.folder = folder
        self.record = record
        self.metadata = read_metadata(folder, record)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def shapes(self) -> dict[str, torch.Size | None]:
        """Key -> global shape of every entry (None: not a tensor)."""
        return {
            key: getattr(entry, "size", None)
            for key, entry in self.metadata.state_dict_metadata.items()
        }


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries as plain data (weights_only) where DCP
    would unpickle them in full; otherwise `DefaultLoadPlanner.load_bytes` as it is."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"entry {fqn!r} is not plain data ({_what_was_refused(e)}); not loaded"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _what_was_refused(error: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only error that names what the pickle asked for (the rest
    is advice to load it in full, which is what must not happen)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "?")


def load(state: dict, reader: CheckpointReader, process_group=None, no_dist: bool = False) -> None:
    """`dcp.load` of `state` through `reader`, non-tensor entries read as plain data. Raises
    UnsafeCheckpointError for an entry that is not (DCP would wrap it with the ranks' other
    errors)."""
    with _single_process_quiet(no_dist):
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=_WeightsOnlyLoadPlanner(),
                process_group=process_group,
                no_dist=no_dist,
            )
        except CheckpointException as e:
            for error, _ in e.failures.values():
                if isinstance(error, UnsafeCheckpointError):
                    raise UnsafeCheckpointError(f"{reader.folder}: {error}") from None
            raise


def verified_reader(folder: Path) -> CheckpointReader:
    """A reader for the checkpoint in `folder`, in this process: every file of its record is
    read and checked first. Raises IntegrityError (one line naming the file and the problem)
    when the folder has no usable record, a file differs from it, or the metadata is unsafe."""
    record = read_record(folder)
    if record is None:
        raise IntegrityError(
            f"{folder} has no {RECORD}, so it cannot be verified, and nothing in it is read "
            "(every checkpoint bloomnative writes has one)"
        )
    if why := uncheckable(record):
        raise IntegrityError(f"{folder} cannot be verified here: {why}")
    problems = verify_files(folder, record, record)
    if problems:
        name = min(problems)
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        raise IntegrityError(
            f"{folder / name}: {problems[name]}{more}: the checkpoint does not match its "
            f"{RECORD}; nothing in it is read"
        )
    return CheckpointReader(folder, record)


@contextlib.contextmanager
def _single_process_quiet(no_dist: bool) -> Iterator[None]:
    """DCP warns when it runs without a process group; with `no_dist` that is the intent."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield

"""Checksums of checkpoint folders: taken as the files are written, checked before they are read.

`ChecksummingWriter` is DCP's file writer with one addition: every byte it writes also goes
through a checksum, so each rank knows the size and checksum of each file it wrote without
reading anything back (with async saves this happens in DCP's background thread). The saver
gathers these into the folder's completion record, `checksums.json`, written last.
`verify_files` compares files on disk with the record; `tools/verify_checkpoint.py` runs it on a
whole folder.

The checksum is xxHash's XXH3-64 (about 20 GB/s on one core of the CI machine, so a save hardly
notices it), or zlib's CRC-32 (2-4 GB/s) where the xxhash package is not installed; the record
names the one it used. Either detects a changed file with probability 1 - 2^-64 (resp. 2^-32),
CRC-32 every error burst up to 32 bits; they guard against bad disks and broken copies, not
against tampering (checkpoint/reading.py is what makes a tampered folder harmless).

A record names only plain files of its own folder: a name with a path in it (`..`, `/`), or
one that is a symbolic link, a device, a pipe or a folder on disk, is a verification failure,
and such a file is never opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import zlib
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

try:
    import xxhash
except ImportError:  # an environment that uses its own Python without installing bloomnative
    xxhash = None  # type: ignore[assignment]

ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"
"""The checksum new records use."""
RECORD = "checksums.json"
"""The completion record of a checkpoint folder: size and checksum of every other file in it."""
METADATA = ".metadata"
"""DCP's index of a checkpoint folder (a pickle: read only through checkpoint/reading.py)."""
_RECORD_FORMAT = 1
_CHUNK = 8 << 20
# Large writes are summed on a helper thread while the calling thread writes the same bytes:
# both hashes and file writes release the GIL, so with a spare core the checksum costs a save
# nothing at all (docs/benchmarks.md).
_OVERLAP_BYTES = 1 << 20
_SUM_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bloomnative-checksum")


class IntegrityError(RuntimeError):
    """A checkpoint folder's completion record is missing, unreadable or incomplete."""


class NotAPlainFileError(IntegrityError):
    """A name of a checkpoint folder is a symbolic link, a folder, a device or a pipe."""


@dataclass(frozen=True)
class FileSum:
    size: int
    checksum: int
    algorithm: str

    def hex(self) -> str:
        return f"{self.checksum:0{16 if self.algorithm == 'xxh3_64' else 8}x}"


class _RunningSum:
    """A checksum fed in pieces."""

    def __init__(self, algorithm: str):
        if algorithm not in ("xxh3_64", "crc32"):
            raise IntegrityError(f"unknown checksum algorithm {algorithm!r}")
        if algorithm == "xxh3_64" and xxhash is None:
            raise IntegrityError("it was summed with xxh3_64: install the xxhash package")
        self.algorithm = algorithm
        self._xxh = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc


class _HashingStream:
    """A writable file that also keeps the size and running checksum of what went through it,
    and the first OSError a write or flush raised (`errors`): torch.save reports a failed
    write only as an unexpected file position, so the cause (a full disk, say) is kept here."""

    def __init__(self, raw, errors: list[OSError]):
        self._raw = raw
        self._errors = errors
        self.size = 0
        self.sum = _RunningSum(ALGORITHM)

    def write(self, data) -> int:
        view = memoryview(data)
        with self._keeping_errors():
            if view.nbytes < _OVERLAP_BYTES:
                self.sum.update(view)
                written = self._raw.write(view)
            else:
                summed = _SUM_THREADS.submit(self.sum.update, view)
                written = self._raw.write(view)
                summed.result()
        self.size += view.nbytes
        return written

    def flush(self) -> None:
        with self._keeping_errors():
            self._raw.flush()

    @contextlib.contextmanager
    def _keeping_errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            self._errors.append(e)
            raise

    def __getattr__(self, name: str):  # tell, fileno, close: the file's own
        return getattr(self._raw, name)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording a FileSum per file it writes (keyed by file name) and
    the OSErrors of its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileSum] = {}
        self.write_errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        try:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = _HashingStream(stream, self.write_errors)
                yield hashing
        except OSError as e:  # opening, or the final flush on closing
            self.write_errors.append(e)
            raise
        self.sums[Path(path).name] = FileSum(
            hashing.size, hashing.sum.value(), hashing.sum.algorithm
        )

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes .metadata under a temporary name first
        if (name := Path(path).name) in self.sums:
            self.sums[Path(new_path).name] = self.sums.pop(name)


class ChecksummingWriter(FileSystemWriter):
    """`FileSystemWriter` whose `sums` hold the size and checksum of every file this rank
    wrote."""

    def __init__(self, path: str | os.PathLike, **kwargs):
        super().__init__(path, **kwargs)
        self._summing = _ChecksummingFileSystem()
        self.fs = self._summing

    @property
    def sums(self) -> dict[str, FileSum]:
        return dict(self._summing.sums)

    @property
    def write_errors(self) -> list[OSError]:
        """The OSErrors this rank's writes raised (whatever DCP made of them)."""
        return list(self._summing.write_errors)


def open_plain_file(path: Path):
    """`path` opened for reading, unbuffered, if it is a regular file (not a symbolic link, a
    device, a pipe or a folder: those raise NotAPlainFileError without being opened, so a
    name like /dev/zero or a pipe cannot make a reader hang)."""
    kind = os.lstat(path).st_mode
    if stat.S_ISLNK(kind):
        raise NotAPlainFileError("a symbolic link, not a file")
    if not stat.S_ISREG(kind):
        raise NotAPlainFileError("not a regular file (a folder, device or pipe)")
    # O_NOFOLLOW and O_NONBLOCK: what was checked above cannot be swapped for a link or a pipe.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAPlainFileError("not a regular file (a folder, device or pipe)")
    return open(fd, "rb", buffering=0)


def file_sum(path: Path, algorithm: str | None = None, from_storage: bool = False) -> FileSum:
    """Size and checksum of a regular file (`open_plain_file`). `from_storage`: first ask the
    kernel to drop the file's cached pages, so the bytes come from the disk rather than from
    memory (where supported)."""
    algorithm = algorithm or ALGORITHM
    running, size = _RunningSum(algorithm), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open_plain_file(path) as f:
        if from_storage and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while n := f.readinto(buffer):
            running.update(view[:n])
            size += n
    return FileSum(size, running.value(), algorithm)


def write_record(folder: Path, sums: dict[str, FileSum]) -> None:
    """Writes `folder`'s completion record from the writers' `sums`, durably (temporary file,
    fsync, rename). Files in the folder that no writer summed (e.g. a JSON file written beside
    DCP's) are read and summed here; a summed file that is not in the folder is an error."""
    files = dict(sums)
    absent = sorted(name for name in files if not (folder / name).is_file())
    if absent:
        raise IntegrityError(f"{folder}: files {absent} were written but are not in the folder")
    algorithms = {s.algorithm for s in files.values()} | {ALGORITHM}
    if len(algorithms) > 1:
        raise IntegrityError(f"{folder}: files were summed with {sorted(algorithms)}")
    for path in sorted(folder.iterdir()):
        if path.name not in files and path.name != RECORD and _is_plain_file(path):
            files[path.name] = file_sum(path)
    write_json_durably(folder / RECORD, _record(files))


def _record(files: dict[str, FileSum]) -> dict:
    return {
        "format": _RECORD_FORMAT,
        "algorithm": ALGORITHM,
        "files": {
            name: {"bytes": s.size, "checksum": s.hex()} for name, s in sorted(files.items())
        },
    }


def record_bytes(sizes: Mapping[str, int]) -> int:
    """Bytes of the completion record of a folder of files of these sizes (as `write_record`
    writes it: the checksums have a fixed width)."""
    record = _record({name: FileSum(size, 0, ALGORITHM) for name, size in sizes.items()})
    return len(_json_text(record).encode())


def read_record(folder: Path) -> dict[str, FileSum] | None:
    """The file sums of `folder`'s completion record; None when it has no record (a checkpoint
    written before records existed). Raises IntegrityError if the record cannot be used,
    including when it names anything but a plain file name of the folder."""
    path = folder / RECORD
    if not os.path.lexists(path):
        return None
    try:
        with open_plain_file(path) as f:
            record = json.loads(f.read())
        algorithm = record.get("algorithm")
        if record.get("format") != _RECORD_FORMAT or algorithm not in ("xxh3_64", "crc32"):
            raise ValueError(f"format {record.get('format')}, algorithm {algorithm}")
        sums = {
            name: FileSum(int(entry["bytes"]), int(entry["checksum"], 16), algorithm)
            for name, entry in record["files"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IntegrityError) as e:
        raise IntegrityError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    for name, entry in sums.items():
        if not is_plain_name(name):
            raise IntegrityError(
                f"{path} names {name!r}, which is not a file of this folder (a record lists "
                "only plain file names)"
            )
        if entry.size < 0:
            raise IntegrityError(f"{path} gives {name} a size of {entry.size} bytes")
    return sums


def is_plain_name(name: object) -> bool:
    """Whether `name` can only mean an entry of the folder itself: no path separator, not `.`
    or `..`, not the record itself, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", RECORD)
        and "/" not in name
        and "\0" not in name
    )


def _is_plain_file(path: Path) -> bool:
    return stat.S_ISREG(os.lstat(path).st_mode)


def uncheckable(record: dict[str, FileSum]) -> str | None:
    """Why this process cannot compute the record's checksums, or None if it can."""
    if xxhash is None and any(s.algorithm == "xxh3_64" for s in record.values()):
        return "it was summed with xxh3_64 and the xxhash package is not installed"
    return None


def unrecorded_files(folder: Path, record: dict[str, FileSum]) -> list[str]:
    """Entries of `folder` that its record does not cover (a README, an editor's backup): nothing
    vouches for them and nothing reads them, so they are reported, not counted as damage."""
    return sorted(p.name for p in folder.iterdir() if p.name != RECORD and p.name not in record)


def check_file(
    folder: Path, name: str, expected: FileSum, from_storage: bool = False
) -> str | None:
    """None if `folder/name` is a regular file with the expected size and checksum, else what
    is wrong with it."""
    path = folder / name
    try:
        size = os.lstat(path).st_size
        if _is_plain_file(path) and size != expected.size:
            return f"{size} bytes, the record says {expected.size}"
        actual = file_sum(path, expected.algorithm, from_storage)
    except FileNotFoundError:
        return "missing"
    except NotAPlainFileError as e:
        return str(e)
    except OSError as e:
        return f"unreadable ({e})"
    except IntegrityError as e:
        return f"cannot be checked: {e}"
    if actual.size != expected.size:
        return f"{actual.size} bytes, the record says {expected.size}"
    if actual.checksum != expected.checksum:
        return f"checksum {actual.hex()}, the record says {expected.hex()}"
    return None


def verify_files(
    folder: Path, record: dict[str, FileSum], names: Iterable[str], from_storage: bool = False
) -> dict[str, str]:
    """Problems of the named files of `folder` against `record`: name -> what is wrong."""
    problems = {}
    for name in names:
        if (problem := check_file(folder, name, record[name], from_storage)) is not None:
            problems[name] = problem
    return problems


def share_of_files(record: dict[str, FileSum], rank: int, world_size: int) -> list[str]:
    """The files `rank` verifies when `world_size` ranks split a folder: largest first, each to
    the rank with the fewest bytes so far (the same split on every rank)."""
    load = [0] * world_size
    mine = []
    for name in sorted(record, key=lambda n: (-record[n].size, n)):
        owner = load.index(min(load))
        load[owner] += record[name].size
        if owner == rank:
            mine.append(name)
    return mine


def gather_sums(
    sums: dict[str, FileSum], group: dist.ProcessGroup | None = None
) -> dict[str, FileSum] | None:
    """Every rank's file sums (each rank's own files) merged on rank 0, for `write_record`; None
    on the other ranks. Without a process group, `sums` itself. Collective over `group`."""
    if not dist.is_initialized():
        return sums
    every_rank: list[Any] | None = (
        [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    )
    dist.gather_object(sums, every_rank, dst=0, group=group)
    if every_rank is None:
        return None
    return {name: s for rank_sums in every_rank for name, s in rank_sums.items()}


def write_json_durably(path: Path, obj: object) -> None:
    """Writes `obj` as JSON to `path` so that a crash leaves the old file or the new one, never
    a torn one: a temporary file, fsync, rename, fsync of the folder."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        f.write(_json_text(obj))
        f.flush()
        os.fsync(f.fileno())
    temporary.rename(path)
    _fsync_dir(path.parent)


def _json_text(obj: object) -> str:
    return json.dumps(obj, indent=1) + "\n"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints (folders named step-<N>) in `folder`, ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)))


def latest_step(folder: Path) -> int | None:
    """The newest complete checkpoint's step in `folder`, or None."""
    steps = complete_steps(folder)
    return steps[-1] if steps else None

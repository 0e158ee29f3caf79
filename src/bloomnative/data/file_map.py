"""Read-only memory maps that keep no file descriptor open.

`np.memmap` and `np.load(mmap_mode="r")` map a file through Python's `mmap`, which (up to Python
3.12) keeps a duplicate of the file's descriptor for as long as the map lives. A training run
maps eight files per dataset of its blend (the `.bin`, the `.idx`, three sample-index arrays for
each of the train and valid splits), so a blend of 128 datasets used the 1,024 descriptors of the
usual soft limit, and a larger one died with "Too many open files". A map does not need its
descriptor: `map_file` opens the file, maps it with the C library's `mmap` and closes it at once,
so a blend of any size holds no descriptor, and the limit that grows with the blend is the
kernel's count of maps per process (`vm.max_map_count`), which preflight checks
(`launch/preflight.py`'s `check_map_count`). The pages are unmapped when the last numpy view
of them is freed.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
"""Linux's limit on the memory maps of one process (65,530 by default)."""


class _Pages:
    """Owns one mapping; numpy arrays made from it keep it alive (their `base`), and the last
    one freed unmaps it."""

    def __init__(self, address: int, size: int) -> None:
        self.address, self.size = address, size
        self.__array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, True),  # read-only
            "version": 3,
        }

    def __del__(self) -> None:
        _munmap(self.address, self.size)


def map_file(path: str | os.PathLike) -> np.ndarray:
    """The bytes of the file `path` as a read-only uint8 array, mapped (shared, as
    `np.memmap(path, mode="r")` maps it) with no descriptor left open. An empty file is an empty
    array.

    Raises:
        OSError: the file cannot be opened, or mapped (out of maps: the message names
            `vm.max_map_count`).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            empty = np.empty(0, np.uint8)
            empty.flags.writeable = False
            return empty
        address = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            raise _map_error(ctypes.get_errno(), path)
    finally:
        os.close(fd)
    return np.asarray(_Pages(address, size))


def map_npy(path: str | os.PathLike) -> np.ndarray:
    """The array of a `.npy` file, read-only and mapped as `np.load(path, mmap_mode="r")` maps
    it, with no descriptor left open.

    Raises:
        OSError: as `map_file`.
        ValueError: not a `.npy` file of version 1 or 2, or one holding Python objects.
    """
    with open(path, "rb") as stream:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"{path}: .npy format version {version} is not read here")
        offset = stream.tell()
    if dtype.hasobject:
        raise ValueError(f"{path}: holds Python objects, which cannot be mapped")
    count = int(np.prod(shape, dtype=np.int64))
    data = map_file(path)[offset : offset + count * dtype.itemsize]
    return data.view(dtype).reshape(shape, order="F" if fortran_order else "C")


def maps_in_use() -> int | None:
    """This process's memory maps (Linux: lines of /proc/self/maps), or None where unknown."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def max_map_count() -> int | None:
    """The kernel's limit on a process's memory maps (`vm.max_map_count`), or None where there
    is none to read (not Linux)."""
    try:
        return int(MAX_MAP_COUNT.read_text())
    except (OSError, ValueError):
        return None


def _map_error(code: int, path: str | os.PathLike) -> OSError:
    if code == errno.ENOMEM:
        limit, used = max_map_count(), maps_in_use()
        if limit is not None and used is not None and used >= limit - 16:
            return OSError(
                code,
                f"cannot map {path}: this process has {used:,} memory maps, the limit is "
                f"vm.max_map_count = {limit:,}; raise it (sysctl -w vm.max_map_count=N) or "
                "blend fewer datasets",
            )
    return OSError(code, f"cannot map {path}: {os.strerror(code)}")

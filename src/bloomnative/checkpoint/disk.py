"""Which disk a path is on and how full it is, for errors about writes that failed there."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


def describe_disk(path: Path) -> str:
    """'the file system mounted at /mnt/x (tmpfs, device tmpfs): 12.0 KiB free of 1.0 MiB' for
    the disk that holds `path` (or would: the nearest folder that exists)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    mount = probe
    while not os.path.ismount(mount):
        mount = mount.parent
    device, kind = _mount_source(mount)
    what = f" ({kind}, device {device})" if device else ""
    return (
        f"the file system mounted at {mount}{what}: {format_bytes(usage.free)} free of "
        f"{format_bytes(usage.total)}"
    )


def _mount_source(mount: Path) -> tuple[str, str]:
    """(device, file-system type) of the mount point `mount` from /proc/self/mounts (the last
    mount there wins), or ("", "") where that is not readable."""
    found = ("", "")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        # Spaces in mount points are written as \040.
        if len(fields) >= 3 and fields[1].replace("\\040", " ") == str(mount):
            found = (fields[0], fields[2])
    return found


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; sizes from bytes to TiB."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_os_error(error: OSError) -> str:
    """'No space left on device (ENOSPC)'."""
    name = errno.errorcode.get(error.errno or 0)
    reason = error.strerror or str(error)
    return f"{reason} ({name})" if name else reason

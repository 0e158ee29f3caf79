#!/usr/bin/env python
"""Verify checkpoint folders against their checksum records, one line per file.

  python tools/verify_checkpoint.py outputs/run/checkpoints/step-1000
  python tools/verify_checkpoint.py outputs/run            (every checkpoint of a dump folder)

PATH is a checkpoint folder (it holds checksums.json or .metadata), or a folder whose step-<N>
sub-folders (directly or under checkpoints/) are verified newest first, including those a run
set aside (step-<N>.corrupt, step-<N>.rolled-back, ...) but not unfinished saves (.partial).
Reads every byte, in one process; needs no GPU and no process group. Once the files match, the
DCP metadata is read as a resume reads it (checkpoint/reading.py: nothing in it can run) and
must name only files of the record. A file the record does not list is reported as "extra"
and ignored (a resume never reads it). Exit code 0: everything verifies; 1: a recorded file
is missing, changed or unreadable (or not a plain file), the record names something outside
the folder, the metadata is unsafe, or a folder has no record; 2: PATH is not a checkpoint
folder.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bloomnative.checkpoint.integrity import (
    METADATA,
    RECORD,
    IntegrityError,
    check_file,
    read_record,
    uncheckable,
    unrecorded_files,
)
from bloomnative.checkpoint.reading import read_metadata

_STEP = re.compile(r"^step-(\d+)(\..*)?$")


def checkpoint_folders(path: Path) -> list[Path]:
    """`path` itself if it is a checkpoint folder, else its step-<N>* folders, newest first."""
    if (path / RECORD).is_file() or (path / METADATA).is_file():
        return [path]
    for parent in (path, path / "checkpoints"):
        if parent.is_dir():
            found = [
                p
                for p in parent.iterdir()
                if p.is_dir() and _STEP.match(p.name) and not p.name.endswith(".partial")
            ]
            if found:
                return sorted(found, key=lambda p: (-int(_STEP.match(p.name)[1]), p.name))
    return []


def verify_folder(folder: Path) -> bool:
    """Prints one line per file of `folder` and a summary line; True if all of it verifies."""
    try:
        record = read_record(folder)
    except IntegrityError as e:
        print(f"BAD      {folder / RECORD}: {e}")
        print(f"{folder}: BAD (its record is unreadable)")
        return False
    if record is None:
        print(f"{folder}: BAD (no {RECORD}: it cannot be verified)")
        return False
    if why := uncheckable(record):
        print(f"{folder}: cannot be verified here: {why}")
        return False
    problems = {name: check_file(folder, name, expected) for name, expected in record.items()}
    for name, problem in sorted(problems.items()):
        if problem is None:
            entry = record[name]
            print(f"ok       {name}  {entry.size} bytes  {entry.algorithm} {entry.hex()}")
        else:
            print(f"BAD      {name}  {problem}")
    for name in unrecorded_files(folder, record):
        print(f"extra    {name}  not in the record: ignored (nothing reads it)")
    bad = sum(problem is not None for problem in problems.values())
    if bad == 0 and METADATA in record:
        try:
            read_metadata(folder, record)
        except IntegrityError as e:
            print(f"BAD      {METADATA}  {e}")
            bad += 1
    verdict = "ok" if bad == 0 else f"BAD ({bad} of {len(problems)} files)"
    print(f"{folder}: {verdict}")
    return bad == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="verify_checkpoint.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", type=Path, help="checkpoint folder, checkpoints/ or dump folder")
    args = parser.parse_args(argv)
    folders = checkpoint_folders(args.path)
    if not folders:
        print(
            f"verify_checkpoint: {args.path} is not a checkpoint folder and holds no step-<N> "
            "folders (give <dump_folder>/checkpoints/step-<N>, the checkpoints folder or the "
            "dump folder)",
            file=sys.stderr,
        )
        return 2
    results = [verify_folder(folder) for folder in folders]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

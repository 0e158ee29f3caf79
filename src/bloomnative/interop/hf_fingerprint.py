"""A fingerprint of the weights of a Hugging Face folder, cheap enough to take at every start:
a LoRA run's checkpoints hold its adapters and not the frozen base, so a resume, and reading the
checkpoint as a model, must find the very base they were trained on (checkpoint.initial_hf),
which the fingerprint recorded beside them tells.

For safetensors files (what Hugging Face saves today) it hashes, tensor by tensor in name order,
the name, dtype and shape and three 4 KiB windows of the data (its start, middle and end): a few
MiB read for a 14 GB base, in milliseconds, against about 9 s of sha256 over every byte (1.6 GB/s
on this project's machines, before reading the files). Another model, another shape or dtype,
and a fine-tuned copy of the same model (every trained tensor changes in all its windows) give
another fingerprint; a copy, a move or another sharding of the same weights gives the same. What
it misses is an edit confined to bytes outside every window of a tensor. Older PyTorch `.bin`
folders have no header to read the tensors from: their files are hashed whole.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from bloomnative.interop.hf import hf_weight_files
from bloomnative.interop.native_checkpoint import CheckpointFormatError

WINDOW = 4096
"""Bytes hashed at each of the start, middle and end of a tensor's data."""
VERSION = "hf-weights-v1"
"""Names how the fingerprint is taken; a record with another one is not comparable."""


def base_record(hf_dir: str) -> dict:
    """What a LoRA run's checkpoints record of their frozen base, the Hugging Face folder
    `hf_dir` (checkpoint.run_record.BASE_FILE), by its absolute path: sampling and export read
    the base from there, from any directory."""
    return {"initial_hf": str(Path(hf_dir).resolve()), "fingerprint": hf_fingerprint(hf_dir)}


def hf_fingerprint(hf_dir: str | Path) -> str:
    """The fingerprint of the weights of the Hugging Face folder `hf_dir` (module docstring):
    '<VERSION>:<sha256 hex>'. Raises CheckpointFormatError for a folder without weights or a
    safetensors file whose header cannot be read."""
    digest = hashlib.sha256()
    files = hf_weight_files(hf_dir)
    if all(path.suffix == ".safetensors" for path in files):
        for entry in sorted(_safetensors_entries(files)):
            digest.update(entry)
    else:
        for path in files:
            with path.open("rb") as f:
                content = hashlib.file_digest(f, "sha256").digest()
            digest.update(path.name.encode() + b"\0" + content)
    return f"{VERSION}:{digest.hexdigest()}"


def _safetensors_entries(files: list[Path]) -> Iterator[bytes]:
    """For each tensor of the files: its name, dtype and shape and its sampled data, as bytes
    that sort by the tensor's name."""
    for path in files:
        with path.open("rb") as f:
            header, data_start = _read_header(f, path)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                begin, end = (data_start + offset for offset in meta["data_offsets"])
                described = json.dumps([name, meta["dtype"], meta["shape"]]).encode()
                yield described + b"\0" + b"".join(_windows(f, begin, end))


def _read_header(f: BinaryIO, path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header (8-byte little-endian length, then the JSON) and the
    offset its data starts at."""
    try:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    except (struct.error, ValueError) as e:
        raise CheckpointFormatError(f"{path}: not a readable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: its safetensors header is not a JSON object")
    return header, 8 + length


def _windows(f: BinaryIO, begin: int, end: int) -> Iterator[bytes]:
    """The data bytes [begin, end) of a file: whole when three windows would cover them, else
    a window at the start, the middle and the end."""
    if end - begin <= 3 * WINDOW:
        starts = [begin]
        size = end - begin
    else:
        starts = [begin, (begin + end - WINDOW) // 2, end - WINDOW]
        size = WINDOW
    for start in starts:
        f.seek(start)
        yield f.read(size)

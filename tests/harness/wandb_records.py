"""Reads what an offline W&B run wrote: the records of its `run-<id>.wandb` file, parsed with
wandb's own protobuf messages (`wandb.proto.wandb_internal_pb2.Record`).

The file is a 7-byte header (b":W&B", the magic 0xBEE1 little-endian, version 0) followed by
LevelDB's log format: 32 KiB blocks (the header counts towards the first) of chunks, each a
7-byte header (CRC-32C, u16 length, u8 type: 1 full, 2 first, 3 middle, 4 last) and its data; a
block tail shorter than a chunk header is zero padding. A record is the data of one full chunk or
of a first, middles and a last.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every record of a .wandb file, in order, as wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data.startswith(HEADER), f"{path} does not start with the W&B header"
    position, pending, found = len(HEADER), b"", []
    while position + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < CHUNK_HEADER:
            position += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        chunk = data[position + CHUNK_HEADER : position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            position += BLOCK - position % BLOCK if position % BLOCK else 0
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


@dataclass
class OfflineRun:
    """What one offline run folder (<dir>/wandb/offline-run-<time>-<id>) holds."""

    run_id: str
    project: str
    display_name: str
    tags: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per `log` call: key -> value (W&B's own `_step`, `_runtime`, ... included)."""


def read_offline_run(folder: Path) -> OfflineRun:
    (path,) = folder.glob("run-*.wandb")
    found = records(path)
    (run,) = [r.run for r in found if r.WhichOneof("record_type") == "run"]
    result = OfflineRun(run.run_id, run.project, run.display_name, list(run.tags))
    for item in run.config.update:
        result.config[item.key] = json.loads(item.value_json)
    for record in found:
        kind = record.WhichOneof("record_type")
        if kind == "config":
            for item in record.config.update:
                result.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            result.history.append({_history_key(i): _history_value(i) for i in record.history.item})
    return result


def _history_key(item) -> str:
    """A history item's name: `key`, or its `nested_key` parts (as wandb 0.31 writes them)."""
    return item.key or ".".join(item.nested_key)


def _history_value(item) -> Any:
    """A history item's value: JSON (as wandb 0.31 writes it), or one of its typed fields."""
    if item.value_json:
        return json.loads(item.value_json)
    kind = item.WhichOneof("value")
    return getattr(item, kind) if kind else None

"""How much disk a checkpoint takes, known before a byte of it is written: what the free-space
check of a save compares with the disk's free space.

What DCP writes (`FileSystemWriter`, `DefaultSavePlanner`): one file per rank,
`__<rank>_0.distcp`, holding each of that rank's entries as a `torch.save` archive of its own,
one after the other: a tensor's (this rank's chunk of it) is its bytes plus about 1.5 KiB of
archive, any other entry's (a learning rate, the data position) is about 1.2 KiB. An entry that
several ranks hold alike (a replicated tensor, the optimizer's hyper-parameters) is written
once, by one of them. Rank 0 then writes `.metadata`, DCP's index of every entry and chunk (a
pickle of tens of KiB for a small model), the run's JSON records and `checksums.json`; every
file takes whole blocks of its file system. For a small model the archives and the index are
most of the checkpoint (a 0.1M-parameter model: 650 KiB of tensors in a 1.9 MiB checkpoint).

`Footprint.of` makes the plan DCP makes (each rank's entries, with the same deduplication on
rank 0, and the index built from them), writes nothing, and sums those sizes. The plan depends
only on the entries' names, shapes and sizes, so later saves of the same state reuse it: each
rank then sends rank 0 nothing but the fact that its entries are unchanged.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_files
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from bloomnative.checkpoint.integrity import METADATA, RECORD, record_bytes

_ARCHIVE_PROBE_BYTES = 1024
"""A tensor of this many bytes (a whole number of the archive's 64-byte records) measures the
largest framing torch.save puts around a tensor's bytes."""
_framing: dict[torch.dtype, int] = {}

_Key = tuple[str, Any]
"""An entry (or chunk) of a checkpoint: its name and, for a tensor, its offset in the whole."""


def saved_bytes(obj: object) -> int:
    """Bytes `torch.save(obj)` writes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def tensor_archive_bytes(dtype: torch.dtype, numel: int) -> int:
    """Bytes of `torch.save` of a tensor of `numel` elements of `dtype` (at most 64 more than
    it writes: the data is aligned to 64 bytes)."""
    item = torch.empty((), dtype=dtype).element_size()
    if dtype not in _framing:
        probe = torch.zeros(_ARCHIVE_PROBE_BYTES // item, dtype=dtype)
        _framing[dtype] = saved_bytes(probe) - _ARCHIVE_PROBE_BYTES
    return _framing[dtype] + numel * item


def _key(item: WriteItem) -> _Key:
    return item.index.fqn, item.index.offset


def local_plan(state: dict, coordinator: bool) -> tuple[SavePlan, dict[_Key, int]]:
    """This rank's part of DCP's plan for saving `state`, and the bytes of each entry's archive."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=coordinator)
    plan = planner.create_local_plan()
    sizes: dict[_Key, int] = {}
    by_pickle: dict[bytes, int] = {}  # entries of equal value (the groups' options) saved once
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            sizes[_key(item)] = _object_bytes(planner.lookup_object(item.index), by_pickle)
        else:
            data = item.tensor_data
            assert data is not None and data.chunk is not None  # DCP's plan of a tensor
            numel = math.prod(data.chunk.sizes)
            sizes[_key(item)] = tensor_archive_bytes(data.properties.dtype, numel)
    return plan, sizes


def _object_bytes(obj: object, by_pickle: dict[bytes, int]) -> int:
    try:
        key = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - torch.save may still take it: measured directly
        return saved_bytes(obj)
    if key not in by_pickle:
        by_pickle[key] = saved_bytes(obj)
    return by_pickle[key]


def file_sizes(
    plans: list[tuple[SavePlan, dict[_Key, int]]], checkpoint_id: Path
) -> dict[str, int]:
    """The bytes of each file DCP writes for these ranks' plans: the ranks' data files and
    `.metadata` (built as DCP builds it, with the offsets and lengths of every entry)."""
    planner = DefaultSavePlanner()
    local_plans = [plan for plan, _ in plans]
    if dist.is_initialized():
        # DCP sends the plans to rank 0 and back as pickles: the names in the index then come
        # from several copies, which its pickle does not share (a third of a small one's size).
        local_plans = [_copied(plan) for plan in local_plans]
    final_plans, metadata = planner.create_global_plan(local_plans)
    if dist.is_initialized():
        final_plans = [_copied(plan) for plan in final_plans]
    sizes: dict[str, int] = {}
    storage: dict = {}
    for rank, (plan, (_, lengths)) in enumerate(zip(final_plans, plans, strict=True)):
        name = f"__{rank}_0.distcp"
        offset = 0
        for item in plan.items:
            length = lengths[_key(item)]
            storage[item.index] = dcp_files._StorageInfo(name, offset, length)
            offset += length
        sizes[name] = offset
    metadata.storage_data = storage
    metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()))
    metadata.version = getattr(dcp_files, "CURRENT_DCP_VERSION", "1.0.0")
    sizes[METADATA] = len(pickle.dumps(metadata))
    return sizes


def _copied(plan: SavePlan) -> SavePlan:
    return pickle.loads(pickle.dumps(plan))


def disk_bytes(sizes: Mapping[str, int], block: int) -> int:
    """What a folder of files of these sizes takes on a file system of `block`-byte blocks
    (the folder's own entries one block)."""
    return block + sum(-(-size // block) * block for size in sizes.values())


def block_size(folder: Path) -> int:
    """The allocation unit of the file system that holds `folder` (or would: its nearest
    existing ancestor)."""
    probe = Path(os.path.abspath(folder))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.statvfs(probe).f_frsize or 4096


class Footprint:
    """The disk a checkpoint of a given state takes; one per Checkpointer, so that the plan is
    made again only when some rank's entries change."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self._mine: dict[_Key, int] | None = None  # this rank's entries at the last call
        self._plans: list[Any] = []  # rank 0: every rank's (plan, sizes)
        self._files: dict[str, int] | None = None  # rank 0: DCP's files for `_plans`

    def of(self, state: dict, files: Mapping[str, bytes], checkpoint_id: Path) -> int | None:
        """Collective: the bytes the checkpoint of `state` takes on the disk of `checkpoint_id`
        (DCP's files, plus `files`, the JSON records rank 0 writes, plus the checksum record),
        on rank 0; None on the other ranks."""
        distributed = self.group is not None and dist.is_initialized()
        rank = dist.get_rank(self.group) if distributed else 0
        plan, sizes = local_plan(state, coordinator=rank == 0)
        sent = (plan, sizes) if sizes != self._mine else None
        self._mine = sizes
        every: list[Any] | None = [sent]
        if distributed:
            every = [None] * dist.get_world_size(self.group) if rank == 0 else None
            dist.gather_object(sent, every, dst=0, group=self.group)
        if every is None:
            return None
        if any(part is not None for part in every):
            kept = self._plans or [None] * len(every)
            pairs = zip(every, kept, strict=True)
            self._plans = [new if new is not None else old for new, old in pairs]
            self._files = file_sizes(self._plans, checkpoint_id)
        assert self._files is not None  # every rank sent its plan the first time
        written = {**self._files, **{name: len(text) for name, text in files.items()}}
        written[RECORD] = record_bytes(written)
        return disk_bytes(written, block_size(checkpoint_id))

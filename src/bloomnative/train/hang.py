"""Hang records: what every rank was doing when a collective failed.

When a collective fails on a rank (it waited `job.collective_timeout_s` for a peer, or a peer's
connection closed), that rank writes <dump_folder>/hang/rank-<R>.json before it exits: the step
and what it was doing in it (`Progress`: the phase, the micro batch, the pipeline action), the
error, and torch's flight recorder, which keeps the last collectives of every process group
(their op, group and sequence number; gloo's as well as NCCL's). On CUDA, NCCL's watchdog also
writes its own flight-recorder dump there on a timeout (hang/nccl_trace_rank_<R>), even where it
aborts the process before Python sees the error.

The launcher reads these records back to name the rank that did not arrive
(`bloomnative.launch.hang_report`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bloomnative.log import get_logger

_log = get_logger(__name__)

HANG_FOLDER = "hang"
FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives the flight recorder keeps per process (torchtitan keeps 20000 on GPU)."""
KEPT_ENTRIES = 50
"""Newest flight-recorder entries copied into a record."""
# How gloo words a collective that waited too long or lost its peer (a plain RuntimeError);
# NCCL's errors that reach Python are torch.distributed.DistError.
GLOO_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def enable_flight_recorder(dump_folder: Path, device_type: str) -> None:
    """Before the process group is made: torch's flight recorder on (gloo and NCCL), and on CUDA
    NCCL's dump on a timeout into <dump_folder>/hang/. Variables the user set are kept."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    if device_type == "cuda":
        folder = dump_folder / HANG_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "nccl_trace_rank_"))


@dataclass
class Progress:
    """Where this rank is, kept up to date by the trainer with plain attribute writes."""

    step: int = 0
    """The step being trained (1-based; 0: setting up)."""
    phase: str = "setup"
    """What the step is doing: "forward-backward", "optimizer", "log", "evaluate", "stop-check",
    "checkpoint"."""
    micro_batch: int | None = None
    """Index of this rank's micro batch in the step (None outside the micro-batch loop)."""
    pipeline_action: str | None = None
    """The newest pipeline-stage computation begun, e.g. "stage 1 backward of micro batch 3",
    with " (done)" once it ended."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out or lost a peer."""
    return isinstance(error, dist.DistError) or any(m in str(error) for m in GLOO_FAILURES)


class HangRecorder:
    """This rank's `Progress`, and its record when a collective fails."""

    def __init__(self, dump_folder: Path, rank: int, world_size: int, timeout_s: int):
        self.folder = dump_folder / HANG_FOLDER
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.progress = Progress()

    def watch_pipeline(self, stages: Sequence[Any]) -> None:
        """Records each computation the schedule runs on `stages` (torch PipelineStages) in
        `progress.pipeline_action`."""
        for stage in stages:
            for method, what in (
                ("forward_one_chunk", "forward"),
                ("backward_one_chunk", "backward"),
                ("backward_weight_one_chunk", "weight backward"),
            ):
                real = getattr(stage, method)
                setattr(stage, method, self._recording(real, f"stage {stage.stage_index} {what}"))

    def _recording(self, real: Callable, what: str) -> Callable:
        progress = self.progress

        def run(chunk: int, *args, **kwargs):
            progress.pipeline_action = f"{what} of micro batch {chunk}"
            result = real(chunk, *args, **kwargs)
            progress.pipeline_action += " (done)"
            return result

        return run

    def record(self, error: BaseException) -> Path | None:
        """If `error` is a collective's failure, writes this rank's record; returns its path."""
        if self.world_size == 1 or not is_collective_failure(error):
            return None
        entries = flight_recorder_entries()
        record = {
            "rank": self.rank,
            "world_size": self.world_size,
            "attempt": _attempt(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "written_at": time.time(),
            "collective_timeout_s": self.timeout_s,
            **asdict(self.progress),
            "error": str(error).strip().splitlines()[0] if str(error).strip() else repr(error),
            "in_flight": _describe(entries[-1]) if entries else None,
            "last_seq_by_group": _last_seq_by_group(entries),
            "flight_recorder": entries[-KEPT_ENTRIES:],
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank-{self.rank}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(record, indent=1, default=str))
        partial.rename(path)
        _log.info(f"collective failed: what this rank was doing is in {path}")
        return path


def flight_recorder_entries() -> list[dict[str, Any]]:
    """The flight recorder's entries, oldest first (NCCL's and the others'); [] where this torch
    has no recorder or it is off."""
    from torch._C import _distributed_c10d as c10d

    entries: list[dict[str, Any]] = []
    for dump in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        if not hasattr(c10d, dump):
            continue
        try:
            trace = json.loads(getattr(c10d, dump)(True, False))
        except Exception as e:  # a recorder that is off, or has no such backend here
            _log.debug(f"flight recorder {dump}: {e}")
            continue
        entries += trace.get("entries", [])
    ranks = _ranks_by_group_name()
    for entry in entries:
        entry["group_ranks"] = ranks.get((entry.get("process_group") or ["?"])[0], "?")
    return sorted(entries, key=lambda e: e.get("time_created_ns", 0))


def _ranks_by_group_name() -> dict[str, list[int]]:
    """The global ranks of this process's groups, by the name the flight recorder gives them
    (its own `pg_config` leaves them out for gloo); {} where torch keeps them elsewhere."""
    try:
        from torch.distributed.distributed_c10d import _world

        return {name: dist.get_process_group_ranks(pg) for pg, name in _world.pg_names.items()}
    except Exception as e:
        _log.debug(f"process group ranks: {e}")
        return {}


def _group_name(entry: dict[str, Any]) -> str:
    """The process group's name, description and ranks: names alone may be reused for groups
    of other ranks."""
    name, desc = (list(entry.get("process_group", [])) + ["?", ""])[:2]
    label = f"{name} ({desc})" if desc and desc != "undefined" else str(name)
    return f"{label} ranks {entry.get('group_ranks', '?')}"


def _describe(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "op": entry.get("profiling_name"),
        "group": _group_name(entry),
        "seq": entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id"),
        "is_p2p": entry.get("is_p2p", False),
        "input_sizes": entry.get("input_sizes"),
        "time_created_ns": entry.get("time_created_ns"),
    }


def _last_seq_by_group(entries: list[dict[str, Any]]) -> dict[str, int]:
    last: dict[str, int] = {}
    for entry in entries:
        if not entry.get("is_p2p"):
            group = _group_name(entry)
            last[group] = max(last.get(group, 0), int(entry.get("collective_seq_id", 0)))
    return last


def _attempt() -> str:
    """This launch and restart attempt: records of earlier ones are not compared with it."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

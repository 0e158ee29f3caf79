"""The real trainer, started the way `main` starts it, on a dump folder someone has tampered
with, or with a fault injected: the scenarios of tests/checkpoint/test_checkpoint_trust.py's shared
world (tests/harness/shared_world.py). They import only bloomnative and the standard library (the
world runs them in its own process).

- `resume_after(plant, source, dump, argv, *plant_args)`: copies the dump folder `source` to
  `dump`, applies `PLANTS[plant]` to the copy, then runs `bloomnative.launch.worker.main(argv)`;
- `train_poisoning_optimizer_state(step, argv)`: a NaN enters AdamW's state just before the
  checkpoint of `step` is taken;
- `train_with_full_disk(step, argv)`: every file write of the checkpoint of `step` fails with
  ENOSPC, as on a disk that has filled up;
- `train_then_crash(step, argv)`: the step after `step` raises an error no check foresaw (a
  crash: a restart may well get past it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.checkpoint import integrity, reading
from bloomnative.checkpoint.integrity import RECORD
from bloomnative.checkpoint.run_record import ARGS_FILE, DATA_FILE
from bloomnative.launch.worker import main
from bloomnative.train.trainer import Trainer


class Payload:
    """A pickle that, when unpickled in full, runs a shell command: one that creates `marker`."""

    def __init__(self, marker: str | Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def rewrite_record(folder: Path) -> None:
    """What someone who changed a checkpoint and wants it to verify does: records every file as
    it now is."""
    (folder / RECORD).unlink()
    integrity.write_record(folder, {})


def plant_metadata_payload(folder: Path, marker: str) -> None:
    """DCP's `.metadata` replaced by `Payload(marker)`, the record rewritten to match."""
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_record(folder)


def plant_entry_payload(folder: Path, marker: str) -> None:
    """The checkpoint saved again, by bloomnative's own saver (so every file matches its record
    and the metadata is genuine), with `Payload(marker)` as the data loader's skipped windows:
    a non-tensor entry, which DCP keeps as a pickle."""
    reader = reading.verified_reader(folder)
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
        for key, m in reader.metadata.state_dict_metadata.items()
    }
    reading.load(state, reader, no_dist=True)
    state["data.skipped"] = Payload(marker)
    files = {name: json.loads((folder / name).read_text()) for name in (ARGS_FILE, DATA_FILE)}
    forged = folder.parent / "forged"
    step = int(folder.name.removeprefix("step-"))
    ckpt.Checkpointer(forged, 0, async_mode=False, min_free_gib=0).save(step, state, files)
    shutil.rmtree(folder)
    (forged / folder.name).rename(folder)
    shutil.rmtree(forged)


def plant_record_entry(folder: Path, name: str) -> None:
    """`name` added to the folder's checksum record, as a forged record would list it."""
    record = json.loads((folder / RECORD).read_text())
    record["files"][name] = {"bytes": 4096, "checksum": "0" * 16}
    (folder / RECORD).write_text(json.dumps(record))


def largest_data_file(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_bytes(path: Path, count: int = 64) -> None:
    """`count` bytes in the middle of the file changed, as a bad disk or a broken copy does."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def free_pid() -> int:
    """A pid no process has: the kernel hands out pids below pid_max (as if the run that held
    it had died and nothing had taken its pid since)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def plant_lock(path: Path, pid: int, start_ticks: int | None = None) -> None:
    """A run.lock as a run on this host since its last boot writes it, naming `pid`, which
    started at `start_ticks` (default: when process `pid` did)."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    if start_ticks is None:
        start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    holder = {"host": socket.gethostname(), "pid": pid, "started": "earlier"}
    path.write_text(json.dumps({**holder, "start_ticks": start_ticks, "boot_id": boot_id}))


def append_text(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def _steps(dump: Path) -> list[Path]:
    return sorted((dump / "checkpoints").glob("step-*"))


PLANTS: dict[str, Callable[..., None]] = {
    "nothing": lambda dump: None,
    # step-4: the newest of the two checkpoints that `source` holds (step-2 and step-4).
    "metadata payload": lambda dump, marker: plant_metadata_payload(
        dump / "checkpoints" / "step-4", marker
    ),
    "entry payload": lambda dump, marker: plant_entry_payload(
        dump / "checkpoints" / "step-4", marker
    ),
    "device in the record": lambda dump: plant_record_entry(
        dump / "checkpoints" / "step-4", "/dev/zero"
    ),
    "readme": lambda dump: (dump / "checkpoints" / "step-4" / "README.txt").write_text(
        "notes on this checkpoint\n"
    ),
    # `other`: a checkpoint folder of a model of another shape.
    "foreign newest": lambda dump, other: shutil.copytree(other, dump / "checkpoints" / "step-6"),
    "only foreign": lambda dump, other: (
        [shutil.rmtree(p) for p in _steps(dump)],
        shutil.copytree(other, dump / "checkpoints" / "step-4"),
    ),
    "every checkpoint corrupt": lambda dump: [
        flip_bytes(largest_data_file(p)) for p in _steps(dump)
    ],
    "torn metrics": lambda dump: append_text(dump / "metrics.jsonl", '{"step": 5, "lo'),
    "stale lock": lambda dump: plant_lock(dump / "run.lock", free_pid(), start_ticks=1234),
    # The lock of a run that is alive: the world's launcher (the test process), as it started.
    "live lock": lambda dump: plant_lock(dump / "run.lock", os.getppid()),
}
"""How a dump folder (copied from a run that saved step-2 and step-4) is changed before the
resume, by name; each takes the dump folder and the scenario's extra arguments."""


def resume_after(plant: str, source: str, dump: str, argv: list[str], *plant_args) -> int:
    shutil.copytree(source, dump)
    PLANTS[plant](Path(dump), *plant_args)
    return main(argv)


def train_poisoning_optimizer_state(step: int, argv: list[str]) -> int:
    """`main(argv)`, with a NaN written into AdamW's first moment of the first parameter just
    before the checkpoint of `step` is taken: the weights are still finite, the state is not."""
    real_save = Trainer.save_checkpoint

    def save_checkpoint(trainer: Trainer) -> None:
        if trainer.step == step:
            state = trainer.optimizers[0].state[trainer.params[0]]
            local = state["exp_avg"]
            local = local.to_local() if hasattr(local, "to_local") else local
            local.view(-1)[0] = float("nan")
        real_save(trainer)

    Trainer.save_checkpoint = save_checkpoint
    try:
        return main(argv)
    finally:
        Trainer.save_checkpoint = real_save


class FullDiskFile:
    """A file on a disk that has filled up: every write fails with ENOSPC."""

    def __init__(self, file):
        self.file = file

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def train_with_full_disk(step: int, argv: list[str]) -> int:
    """`main(argv)`, where every write into a file of the checkpoint of `step` fails with
    ENOSPC (what a file system that has filled up raises), in the saving thread or DCP's
    background one: DCP's file system (which checkpoints write through) opens those files on
    a full disk."""
    real_create_stream = FileSystem.create_stream
    folder = f"step-{step}.partial"

    @contextlib.contextmanager
    def create_stream(fs: FileSystem, path, mode: str) -> Iterator:
        with real_create_stream(fs, path, mode) as stream:
            full = "w" in mode and folder in Path(path).parts
            yield FullDiskFile(stream) if full else stream

    with mock.patch.object(FileSystem, "create_stream", create_stream):
        return main(argv)


def train_then_crash(step: int, argv: list[str]) -> int:
    class Crashing(Trainer):
        def train_step(self):
            if self.step == step:
                raise RuntimeError(f"planted crash after step {step}")
            return super().train_step()

    return main(argv, trainer_class=Crashing)

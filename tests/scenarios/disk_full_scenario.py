"""The real trainer on a small file system that fills up: the scenarios of
tests/checkpoint/test_disk_full.py's shared world (one process, one after the other, on one
tmpfs the test mounts). What fills the disk is a file, `<disk>/filler`, as another program's
would; every write that does not fit fails in the kernel with ENOSPC.

- `fill_while_saving(disk, leave, argv)`: `main(argv)`, where the disk is filled to `leave`
  free bytes once the save has passed its free-space check, as DCP starts writing (in the
  saving thread, or in the background for an async save): its writes meet a full disk;
- `free_then_train(disk, argv)`: the filler removed, then `main(argv)`;
- `leave_partial_then_train(disk, partial, leave, argv)`: a `.partial` folder planted (as a save
  killed while it wrote leaves it) that leaves `leave` bytes free, then `main(argv)`;
- `fill_before_save(disk, fraction, argv)`: `main(argv)`, where just before the first save the
  disk is filled so that `fraction` x the newest complete checkpoint's size is free.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from unittest import mock

from torch.distributed.checkpoint import FileSystemWriter

from bloomnative.checkpoint.integrity import complete_steps
from bloomnative.launch.worker import main
from bloomnative.train.trainer import Trainer

FILLER = "filler"


def free_bytes(disk: str | Path) -> int:
    return shutil.disk_usage(disk).free


def fill(disk: str | Path, leave: int) -> None:
    """Grows `<disk>/filler` until `leave` bytes (to a page) of the disk are free."""
    with open(Path(disk) / FILLER, "ab") as f:
        while (extra := free_bytes(disk) - leave) >= 4096:
            f.write(bytes(extra // 4096 * 4096))
            f.flush()


def tree_bytes(folder: Path) -> int:
    """What `du` counts for `folder`."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def fill_while_saving(disk: str, leave: int, argv: list[str]) -> int:
    real = FileSystemWriter.prepare_local_plan

    def prepare_local_plan(writer, plan):
        fill(disk, leave)
        return real(writer, plan)

    with mock.patch.object(FileSystemWriter, "prepare_local_plan", prepare_local_plan):
        return main(argv)


def free_then_train(disk: str, argv: list[str]) -> int:
    (Path(disk) / FILLER).unlink(missing_ok=True)
    return main(argv)


def leave_partial_then_train(disk: str, partial: str, leave: int, argv: list[str]) -> int:
    (Path(disk) / FILLER).unlink(missing_ok=True)
    folder = Path(partial)
    folder.mkdir(parents=True)
    with open(folder / "__0_0.distcp", "wb") as f:  # a data file cut short by the kill
        while (extra := free_bytes(disk) - leave) >= 4096:
            f.write(bytes(extra // 4096 * 4096))
            f.flush()
    return main(argv)


def fill_before_save(disk: str, fraction: float, argv: list[str]) -> int:
    (Path(disk) / FILLER).unlink(missing_ok=True)
    real = Trainer.save_checkpoint

    def save_checkpoint(trainer: Trainer) -> None:
        if trainer.rank == 0 and not (Path(disk) / FILLER).exists():
            folder = trainer.ckpt_folder
            newest = folder / f"step-{complete_steps(folder)[-1]}"
            fill(disk, int(fraction * tree_bytes(newest)))
        real(trainer)

    Trainer.save_checkpoint = save_checkpoint
    try:
        return main(argv)
    finally:
        Trainer.save_checkpoint = real

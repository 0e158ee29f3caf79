"""Checkpoint integrity without a training run: the record holds the checksum of every file as
written (compared with xxhash and zlib over the bytes on disk), verification names each damaged
file (an extra file is only reported), rotation never removes the newest verified checkpoint, a
save that reads back wrong is set aside, and tools/verify_checkpoint.py reports one line per
file."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import xxhash

from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.checkpoint import integrity
from bloomnative.checkpoint.integrity import RECORD
from bloomnative.checkpoint.resume import VerifiedCheck, plan_start
from bloomnative.interop import save_native_checkpoint
from bloomnative.model import Bloom, BloomArgs
from harness.training import flip_bytes, load_tool

# DCP says so when it runs without a process group, as it does here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


verify_checkpoint = load_tool("verify_checkpoint")


def state(seed: int = 0) -> dict:
    """A little of everything a training checkpoint holds; one tensor above the 1 MiB at which
    writes are summed on a helper thread."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"big": torch.randn(700_000, generator=g), "small": torch.randn(5, generator=g)},
        "train": {"step": torch.tensor(seed), "consumed_samples": torch.tensor(8 * seed)},
    }


def save(folder: Path, steps, keep_latest_k: int = 0, async_mode: bool = False, **hooks):
    checkpointer = ckpt.Checkpointer(folder, keep_latest_k, async_mode, min_free_gib=0, **hooks)
    for step in steps:
        checkpointer.save(step, state(step))
    checkpointer.wait()
    return checkpointer


REFERENCE_SUMS = {
    "xxh3_64": lambda data: f"{xxhash.xxh3_64(data).intdigest():016x}",
    "crc32": lambda data: f"{zlib.crc32(data):08x}",
}


@pytest.mark.parametrize(
    "algorithm, async_mode", [("xxh3_64", False), ("xxh3_64", True), ("crc32", False)]
)
def test_the_record_holds_size_and_checksum_of_every_file_as_written(
    tmp_path, monkeypatch, algorithm, async_mode
):
    # crc32: what a machine without the xxhash package writes.
    monkeypatch.setattr(integrity, "ALGORITHM", algorithm)
    checkpointer = save(tmp_path, [1], async_mode=async_mode)
    folder = tmp_path / "step-1"
    record = json.loads((folder / RECORD).read_text())
    assert record["algorithm"] == algorithm
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != RECORD)
    assert sorted(record["files"]) == on_disk and ".metadata" in on_disk
    for name, entry in record["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "checksum": REFERENCE_SUMS[algorithm](data)}, name
    assert checkpointer.verified == {1}  # read back after the save
    flip_bytes(folder / "__0_0.distcp")
    assert "__0_0.distcp: checksum" in checkpointer.verify(1).reason


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda f: flip_bytes(f / "__0_0.distcp"), "__0_0.distcp: checksum"),
        (lambda f: (f / "__0_0.distcp").write_bytes(b"x"), "__0_0.distcp: 1 bytes, the record"),
        (lambda f: (f / ".metadata").unlink(), ".metadata: missing"),
        (lambda f: (f / RECORD).write_text("{"), f"{RECORD} is unreadable"),
    ],
    ids=["flipped bytes", "truncated", "missing", "bad record"],
)
def test_verification_names_the_damaged_file_and_what_is_wrong(tmp_path, damage, expected):
    checkpointer = save(tmp_path, [1])
    assert checkpointer.verify(1) is None
    damage(tmp_path / "step-1")
    rejection = checkpointer.verify(1)
    assert rejection.kind == "corrupt" and expected in rejection.reason


def test_an_extra_file_is_reported_not_taken_for_damage(tmp_path, capsys):
    checkpointer = save(tmp_path, [1])
    capsys.readouterr()
    (tmp_path / "step-1" / "README").write_text("notes on this checkpoint\n")
    (tmp_path / "step-1" / "__0_0.distcp~").write_bytes(b"an editor's backup")
    assert checkpointer.verify(1) is None
    assert checkpointer.newest_usable() == (1, [])
    assert (tmp_path / "step-1").is_dir()
    warning = capsys.readouterr().err
    assert "README, __0_0.distcp~ not listed in its checksums.json: ignored" in warning


def test_a_damaged_checkpoint_is_skipped_and_set_aside_never_deleted(tmp_path, capsys):
    checkpointer = save(tmp_path, [1, 2, 3])
    flip_bytes(tmp_path / "step-3" / "__0_0.distcp")
    (tmp_path / "step-2" / "__0_0.distcp").unlink()
    step, rejected = checkpointer.newest_usable()
    assert step == 1 and [(r.step, r.kind) for r in rejected] == [(3, "corrupt"), (2, "corrupt")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-1",
        "step-2.corrupt",
        "step-3.corrupt",
    ]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2
    assert warnings[0].startswith(
        f"[bloomnative] WARNING: checkpoint step-3 is corrupt: "
        f"{tmp_path}/step-3/__0_0.distcp: checksum"
    )
    assert warnings[0].endswith("; skipped, left as step-3.corrupt")
    with pytest.raises(ckpt.BadCheckpointError, match="no complete checkpoint.*step 1"):
        plan_start(tmp_path, VerifiedCheck(checkpointer, None, {}), load_step=3)


def test_when_no_checkpoint_verifies_none_is_renamed(tmp_path):
    checkpointer = save(tmp_path, [1, 2])
    for step in (1, 2):
        flip_bytes(tmp_path / f"step-{step}" / "__0_0.distcp")
    step, rejected = checkpointer.newest_usable()
    assert step is None and [r.step for r in rejected] == [2, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


def test_rotation_keeps_the_newest_verified_checkpoint_while_newer_ones_are_unverified(tmp_path):
    # step-9 was left by an earlier run: complete, but nothing has verified it in this process.
    save(tmp_path / "earlier", [9])
    shutil.copytree(tmp_path / "earlier" / "step-9", tmp_path / "run" / "step-9")
    checkpointer = ckpt.Checkpointer(tmp_path / "run", 1, async_mode=False, min_free_gib=0)
    checkpointer.save(3, state(3))
    checkpointer.wait()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-3", "step-9"]
    checkpointer.save(4, state(4))
    checkpointer.wait()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-4", "step-9"]


def test_a_save_that_reads_back_wrong_is_set_aside_and_the_last_good_one_kept(tmp_path, capsys):
    def disk_corrupts_step_3(step: int) -> None:  # after the record's sums were taken
        if step == 3:
            flip_bytes(tmp_path / "step-3.partial" / "__0_0.distcp")

    checkpointer = save(tmp_path, [1, 2, 3], keep_latest_k=1, before_complete=disk_corrupts_step_3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3.corrupt"]
    assert checkpointer.verified == {1, 2}
    assert "reading it back after the save" in capsys.readouterr().err


def test_verify_tool_prints_one_line_per_file(tmp_path, capsys):
    save(tmp_path, [1, 2])
    assert verify_checkpoint.main([str(tmp_path / "step-2")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [
        ["ok", ".metadata"],
        ["ok", "__0_0.distcp"],
    ]
    assert lines[-1] == f"{tmp_path / 'step-2'}: ok"
    flip_bytes(tmp_path / "step-1" / "__0_0.distcp")
    assert verify_checkpoint.main([str(tmp_path)]) == 1  # every checkpoint in the folder
    out = capsys.readouterr().out
    assert "BAD      __0_0.distcp  checksum" in out
    assert out.splitlines()[-1] == f"{tmp_path / 'step-1'}: BAD (1 of 2 files)"
    assert verify_checkpoint.main([str(tmp_path / "nothing")]) == 2


def test_model_only_checkpoints_carry_a_record_too(tmp_path):
    model = Bloom(BloomArgs(n_layer=1, hidden_size=32, n_head=4, vocab_size=64))
    out = save_native_checkpoint(model, tmp_path / "native")
    assert "bloom_args.json" in json.loads((out / RECORD).read_text())["files"]
    assert verify_checkpoint.main([str(out)]) == 0


def test_bench_checkpoint_runs(tmp_path, capsys):
    """tools/bench_checkpoint.py at a toy size (the figures are in docs/benchmarks.md)."""
    argv = ["--hidden", "64", "--layers", "1", "--vocab", "256", "--reps", "1"]
    result = load_tool("bench_checkpoint").main([*argv, "--dir", str(tmp_path / "bench")])
    assert result["files"] == 2 and set(result["save_s"]) == {"plain", "xxh3_64", "crc32"}
    assert "read back from disk and verify" in capsys.readouterr().out
    assert not (tmp_path / "bench").exists()


def test_without_the_xxhash_package_a_checkpoint_summed_with_it_is_not_read(tmp_path, monkeypatch):
    checkpointer = save(tmp_path, [1])
    monkeypatch.setattr(integrity, "xxhash", None)  # e.g. a GPU image's own Python
    fresh = ckpt.Checkpointer(tmp_path, 0, async_mode=False, min_free_gib=0)
    step, [rejection] = fresh.newest_usable()
    assert step is None and fresh.verified == set()
    assert rejection.kind == "unverified"
    assert "xxhash package is not installed" in rejection.reason
    assert checkpointer.path(1).is_dir()  # not set aside: nothing is known to be wrong with it

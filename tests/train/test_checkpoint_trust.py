"""Nothing in a checkpoint folder runs, and nothing outside it is read (issue 26, item 1).

A hostile (or broken) folder is planted the way an attacker with write access would plant it:
a pickle that would create a marker file, in DCP's `.metadata` or in a non-tensor entry, with
the checksum record rewritten to match; a record naming files outside the folder, a device, a
pipe or a symbolic link. Each is then opened the way a user opens a checkpoint: the tools'
command lines and ./run_train.sh. Afterwards the marker must not exist, the problem must be
named on one line, and nothing may hang.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.checkpoint import integrity, reading
from bloomnative.checkpoint.integrity import RECORD
from bloomnative.checkpoint.run_record import ARGS_FILE, DATA_FILE
from bloomnative.interop import save_native_checkpoint
from bloomnative.model import Bloom, BloomArgs
from training_helpers import (
    REPO,
    TINY_RUN,
    run_train_sh,
    run_training,
    train_env,
    write_word_tokenizer,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """What a planted pickle does when it is unpickled: runs a shell command (here one that
    creates `marker`)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def run_args(dump: Path, corpus: str, tokenizer: Path) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--data.tokenizer={tokenizer}",
        f"--job.dump_folder={dump}",
        "--training.steps=4",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
    ]


@pytest.fixture(scope="module")
def saved_run(synthetic_corpus, tmp_path_factory) -> tuple[Path, list[str]]:
    """(dump folder with checkpoints step-2 and step-4, the run's arguments)."""
    root = tmp_path_factory.mktemp("trusted")
    tokenizer = write_word_tokenizer(root / "tokenizer.json")
    argv = run_args(root / "run", synthetic_corpus, tokenizer)
    run_training(argv)
    return root / "run", argv


@pytest.fixture
def run(saved_run, tmp_path) -> tuple[Path, list[str]]:
    """A copy of `saved_run` to plant things in, and the arguments that resume it."""
    source, argv = saved_run
    dump = tmp_path / "run"
    shutil.copytree(source, dump)
    return dump, [*argv, f"--job.dump_folder={dump}"]


def rewrite_record(folder: Path) -> None:
    """What someone who changes a checkpoint and wants it to verify does: records every file
    as it is now."""
    (folder / RECORD).unlink()
    integrity.write_record(folder, {})


def tool(name: str, *argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / f"{name}.py"), *argv],
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def open_with(how: str, step: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Opens checkpoint folder `step` as a user would: `how` names the tool."""
    if how == "generate":
        return tool(
            "generate", "--checkpoint", str(step), "--prompt", "w1", "--max-new-tokens", "2"
        )
    if how == "to-hf":
        return tool("convert_hf", "to-hf", "--checkpoint", str(step), "--out", str(tmp_path / "hf"))
    return tool("verify_checkpoint", str(step))


@pytest.mark.parametrize("how", ["generate", "to-hf", "verify_checkpoint"])
def test_a_planted_metadata_pickle_with_a_matching_record_runs_nothing_in_the_tools(
    run, tmp_path, how
):
    dump, _ = run
    step = dump / "checkpoints" / "step-4"
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_record(step)
    proc = open_with(how, step, tmp_path)
    assert not marker.exists()
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "refers to posix.system, which checkpoint metadata never holds" in output, output
    assert "Traceback" not in output
    assert not (tmp_path / "hf").exists()


def test_a_planted_metadata_pickle_with_a_matching_record_runs_nothing_on_resume(run, tmp_path):
    """The planted step-4 is set aside as corrupt and the run resumes from step-2."""
    dump, argv = run
    step = dump / "checkpoints" / "step-4"
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_record(step)
    proc = run_train_sh(argv)
    assert not marker.exists()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint step-4 is corrupt" in proc.stderr
    assert "refers to posix.system" in proc.stderr
    assert f"resumed from {dump / 'checkpoints' / 'step-2'} at step 2" in proc.stdout
    assert (dump / "checkpoints" / "step-4.corrupt").is_dir()


@pytest.mark.parametrize("how", ["generate", "to-hf"])
def test_a_changed_file_is_found_by_verification_before_anything_is_unpickled(run, tmp_path, how):
    """Without a matching record the tools stop at the checksum, before the metadata: the
    message is the record's, not the unpickler's."""
    dump, _ = run
    step = dump / "checkpoints" / "step-4"
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    proc = open_with(how, step, tmp_path)
    assert not marker.exists()
    assert proc.returncode != 0
    assert f"{step / '.metadata'}: " in proc.stderr
    assert "the record says" in proc.stderr and "posix.system" not in proc.stderr
    assert "does not match its checksums.json; nothing in it is read" in proc.stderr


def test_a_planted_pickle_in_a_data_entry_runs_nothing_on_resume(run, tmp_path):
    """DCP keeps non-tensor entries (the data loader's skipped windows, the optimizer's
    hyper-parameters) as pickles too: they are read as plain data, so a forged checkpoint whose
    every file matches its record stops the resume with one line instead of running."""
    dump, argv = run
    step = dump / "checkpoints" / "step-4"
    reader = reading.verified_reader(step)
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
        for key, m in reader.metadata.state_dict_metadata.items()
    }
    reading.load(state, reader, no_dist=True)
    marker = tmp_path / "pwned"
    state["data.skipped"] = Payload(marker)
    files = {name: json.loads((step / name).read_text()) for name in (ARGS_FILE, DATA_FILE)}
    forged = tmp_path / "forged"
    ckpt.Checkpointer(forged, 0, async_mode=False, min_free_gib=0).save(4, state, files)
    shutil.rmtree(step)
    shutil.copytree(forged / "step-4", step)
    proc = run_train_sh(argv)
    assert not marker.exists()
    assert proc.returncode != 0
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("checkpoint error:")]
    assert f"{step}: entry 'data.skipped' is not plain data" in line
    assert "posix.system" in line
    assert "Traceback" not in proc.stderr.split("checkpoint error:")[0]


def plant_record_entry(step: Path, name: str) -> None:
    """Adds `name` to the checkpoint's record, as a forged record would list it."""
    record = json.loads((step / RECORD).read_text())
    record["files"][name] = {"bytes": 4096, "checksum": "0" * 16}
    (step / RECORD).write_text(json.dumps(record))


def replace_with(step: Path, name: str, make) -> None:
    """Replaces the recorded file `name` by what `make(path)` creates."""
    (step / name).unlink()
    make(step / name)


OUTSIDE = "which is not a file of this folder"
PLANTS = {
    "parent path": (lambda s: plant_record_entry(s, "../../../../etc/passwd"), OUTSIDE),
    "device": (lambda s: plant_record_entry(s, "/dev/zero"), OUTSIDE),
    "pipe outside": (
        lambda s: (os.mkfifo(s.parent / "outside.fifo"), plant_record_entry(s, "../outside.fifo")),
        OUTSIDE,
    ),
    "link to a device": (
        lambda s: replace_with(s, "__0_0.distcp", lambda p: p.symlink_to("/dev/zero")),
        "a symbolic link, not a file",
    ),
    "pipe inside": (
        lambda s: replace_with(s, "__0_0.distcp", os.mkfifo),
        "not a regular file (a folder, device or pipe)",
    ),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_record_naming_anything_but_a_file_of_its_folder_fails_without_opening_it(run, plant):
    """Opening a pipe or /dev/zero would hang the reader (the timeout fails the test then)."""
    dump, _ = run
    step = dump / "checkpoints" / "step-4"
    make, expected = PLANTS[plant]
    make(step)
    proc = tool("verify_checkpoint", str(step), timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expected in proc.stdout
    if expected != OUTSIDE:
        assert f"BAD      __0_0.distcp  {expected}" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith(f"{step}: BAD")


@pytest.mark.parametrize("plant", ["device", "pipe inside"])
def test_generate_refuses_such_a_record_at_once(run, tmp_path, plant):
    dump, _ = run
    step = dump / "checkpoints" / "step-4"
    make, expected = PLANTS[plant]
    make(step)
    proc = open_with("generate", step, tmp_path)
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith("generate.py: error: ") and expected in line
    if expected != OUTSIDE:
        assert f"{step / '__0_0.distcp'}: {expected}" in line


def test_resume_passes_over_a_record_naming_a_device(run):
    dump, argv = run
    step = dump / "checkpoints" / "step-4"
    PLANTS["device"][0](step)
    proc = run_train_sh(argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"names '/dev/zero', {OUTSIDE}" in proc.stderr
    assert f"resumed from {dump / 'checkpoints' / 'step-2'} at step 2" in proc.stdout


def test_the_metadata_unpickler_admits_what_checkpoints_hold_and_nothing_else(tmp_path):
    """Model-only checkpoints in bf16 and fp32 read through it (training checkpoints of every
    layout do in test_resume_layouts.py and parallel/test_layouts.py, which resume through
    it); a pickle naming any other global is refused before that global is even imported."""
    model = Bloom(BloomArgs(n_layer=1, hidden_size=32, n_head=4, vocab_size=64))
    for dtype in (torch.float32, torch.bfloat16):
        out = save_native_checkpoint(model.to(dtype), tmp_path / str(dtype), overwrite=True)
        assert reading.verified_reader(out).shapes()["model.word_embeddings.weight"] == (64, 32)
    for payload in (Payload(tmp_path / "pwned"), print, eval):
        (out / ".metadata").write_bytes(pickle.dumps(payload))
        rewrite_record(out)
        with pytest.raises(reading.UnsafeCheckpointError, match="never holds"):
            reading.verified_reader(out)
    assert not (tmp_path / "pwned").exists()

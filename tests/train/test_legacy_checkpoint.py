"""A checkpoint written in the format of before the trainer's components owned their state
(commit c242fcc, tests/train/legacy_checkpoint/README.md) still resumes exactly: the losses after
it are those of the run that never stopped, today's and the old trainer's alike."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_spikes import BAD
from test_spikes import run as run_spiking

from bloomnative.checkpoint import reading
from training_helpers import losses_by_step

LEGACY = Path(__file__).resolve().with_name("legacy_checkpoint")


def run(dump: Path, corpus: str) -> subprocess.CompletedProcess:
    """The checkpoint's run (its README): test_spikes.py's with a smaller model and dropout, to
    its end, in `dump`."""
    model = ["--model.n_layer=2", "--model.hidden_size=16", "--model.n_head=2"]
    proc = run_spiking(dump, corpus, BAD, *model, "--model.hidden_dropout=0.1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def entries(checkpoint: Path) -> dict:
    """Every entry of a checkpoint, read whole in this process."""
    reader = reading.verified_reader(checkpoint)
    metadata = reader.metadata.state_dict_metadata
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
        for key, m in metadata.items()
    }
    reading.load(state, reader, no_dist=True)
    return state


@pytest.fixture(scope="module")
def uninterrupted(synthetic_corpus, tmp_path_factory) -> Path:
    """Today's trainer runs the checkpoint's run from the start (and the old trainer's losses
    come out)."""
    dump = tmp_path_factory.mktemp("uninterrupted")
    run(dump, synthetic_corpus)
    old = json.loads((LEGACY / "losses.json").read_text())
    assert losses_by_step(dump) == {int(step): loss for step, loss in old.items()}
    return dump


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("rollback_log", [True, False], ids=["with", "without_rollbacks_json"])
def test_a_checkpoint_of_the_old_format_resumes_as_the_run_that_never_stopped(
    uninterrupted, synthetic_corpus, tmp_path, rollback_log
):
    """Without rollbacks.json the skipped window comes from the checkpoint alone. The state at
    the end (weights, AdamW, data position and windows, learning-rate clock, spike detector,
    RNG) is the uninterrupted run's, entry by entry."""
    old = LEGACY / "checkpoints"
    assert "train.consumed_samples" in reading.verified_reader(old / "step-10").shapes()
    shutil.copytree(old, tmp_path / "checkpoints")
    if not rollback_log:
        (tmp_path / "checkpoints" / "rollbacks.json").unlink()
    proc = run(tmp_path, synthetic_corpus)
    assert "step-10 at step 10" in proc.stdout
    expected = losses_by_step(uninterrupted)
    assert losses_by_step(tmp_path) == {step: expected[step] for step in (11, 12)}
    resumed = entries(tmp_path / "checkpoints" / "step-12")
    reference = entries(uninterrupted / "checkpoints" / "step-12")
    assert resumed.keys() == reference.keys()
    assert "data.consumed_samples" in resumed and "train.consumed_samples" not in resumed
    assert resumed["data.skipped"] == [(48, 80)]
    for key, value in reference.items():
        same = (
            torch.equal(resumed[key], value)
            if isinstance(value, torch.Tensor)
            else (resumed[key] == value)
        )
        assert same, key

"""A checkpoint written in the format of before the trainer's components owned their state
(commit c242fcc, tests/train/legacy_checkpoint/README.md) still resumes exactly: the losses after
it are those of the run that never stopped, today's and the old trainer's alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_spikes import BAD, TRAIN_WITH_SPIKES, spike_argv

from bloomnative.checkpoint.checkpointer import saved_shapes
from shared_world import SharedWorld
from training_helpers import losses_by_step

LEGACY = Path(__file__).resolve().with_name("legacy_checkpoint")


def legacy_run(dump: Path, corpus: str) -> list[str]:
    """The checkpoint's run (its README): test_spikes.py's with a smaller model and dropout, to
    its end, in `dump`."""
    model = ["--model.n_layer=2", "--model.hidden_size=16", "--model.n_head=2"]
    return spike_argv(dump, corpus, *model, "--model.hidden_dropout=0.1")


def entries(checkpoint: Path) -> dict:
    """Every entry of a checkpoint, read whole in this process."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
        for key, m in metadata.items()
    }
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> SharedWorld:
    """One shared world: "uninterrupted", today's trainer running the checkpoint's run from the
    start, and the runs resumed from a copy of the old checkpoints, "resumed_with" and
    "resumed_without" (rollbacks.json deleted); each dump folder is <world.out>/../<name>."""
    out = tmp_path_factory.mktemp("legacy")
    world = SharedWorld(out / "world")
    world.add(
        "uninterrupted", TRAIN_WITH_SPIKES, BAD, legacy_run(out / "uninterrupted", synthetic_corpus)
    )
    for rollback_log in ("with", "without"):
        dump = out / f"resumed_{rollback_log}"
        shutil.copytree(LEGACY / "checkpoints", dump / "checkpoints")
        if rollback_log == "without":
            (dump / "checkpoints" / "rollbacks.json").unlink()
        world.add(dump.name, TRAIN_WITH_SPIKES, BAD, legacy_run(dump, synthetic_corpus))
    return world.run()


@pytest.fixture(scope="module")
def uninterrupted(runs) -> Path:
    """The uninterrupted run's dump folder: the old trainer's losses came out."""
    runs.result("uninterrupted")
    dump = runs.out.parent / "uninterrupted"
    old = json.loads((LEGACY / "losses.json").read_text())
    assert losses_by_step(dump) == {int(step): loss for step, loss in old.items()}
    return dump


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("rollback_log", ["with", "without"])
def test_a_checkpoint_of_the_old_format_resumes_as_the_run_that_never_stopped(
    runs, uninterrupted, rollback_log
):
    """Without rollbacks.json the skipped window comes from the checkpoint alone. The state at
    the end (weights, AdamW, data position and windows, learning-rate clock, spike detector,
    RNG) is the uninterrupted run's, entry by entry."""
    assert "train.consumed_samples" in saved_shapes(LEGACY / "checkpoints" / "step-10")
    name = f"resumed_{rollback_log}"
    proc = runs.result(name)
    assert "step-10 at step 10" in proc.stdout
    dump = runs.out.parent / name
    expected = losses_by_step(uninterrupted)
    assert losses_by_step(dump) == {step: expected[step] for step in (11, 12)}
    resumed = entries(dump / "checkpoints" / "step-12")
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

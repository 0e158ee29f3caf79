"""How a run starts (checkpoint/resume.py), without a training run: the trainer's check, which
verifies each checkpoint, and preflight's, which takes every complete one as loadable, take the
same branch by the same rule; what the trainer refuses, and what it passes over, is said."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bloomnative.checkpoint.checkpointer import BadCheckpointError, Checkpointer
from bloomnative.checkpoint.resume import (
    CompleteCheck,
    Fresh,
    FromHF,
    ModelOnly,
    Resume,
    VerifiedCheck,
    plan_start,
)
from bloomnative.checkpoint.run_record import DATA_FILE
from harness.training import flip_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SEQ_LEN_32 = {"training.seq_len": 32}


def save(folder: Path, step: int, model_only: bool = False) -> Checkpointer:
    """A small checkpoint: a training one (optimizer state, data settings) or a model-only one."""
    state: dict = {"model": {"w": torch.full((4,), float(step))}}
    files = {}
    if not model_only:
        state["optimizer"] = {"state.w.step": torch.tensor(float(step))}
        files[DATA_FILE] = SEQ_LEN_32
    checkpointer = Checkpointer(folder, 0, async_mode=False, min_free_gib=0)
    checkpointer.save(step, state, files)
    checkpointer.wait()
    return checkpointer


def both(folder: Path, data_settings: dict = SEQ_LEN_32, **settings):
    """The plans of the trainer's check (a fresh checkpointer's, as a new run has) and of
    preflight's."""
    checkpointer = Checkpointer(folder, 0, async_mode=False, min_free_gib=0)
    verified = plan_start(folder, VerifiedCheck(checkpointer, None, data_settings), **settings)
    return verified, plan_start(folder, CompleteCheck(), **settings)


def test_without_checkpoints_both_start_from_the_initial_weights(tmp_path):
    assert {plan.start for plan in both(tmp_path)} == {Fresh()}
    assert {plan.start for plan in both(tmp_path, initial_hf="hf")} == {FromHF("hf")}
    save(tmp_path, 2)
    disabled = both(tmp_path, enabled=False, initial_hf="hf")
    assert {plan.start for plan in disabled} == {FromHF("hf")}


def test_a_damaged_newest_checkpoint_is_passed_over_and_preflight_takes_the_same_branch(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    flip_bytes(tmp_path / "step-4" / "__0_0.distcp")
    verified, complete = both(tmp_path)
    assert verified.start == Resume(2) and complete.start == Resume(4)
    [rejection] = verified.passed_over
    assert (rejection.step, rejection.kind) == (4, "corrupt")
    assert (tmp_path / "step-4").is_dir()  # the plan renames nothing: the trainer does


def test_load_step_0_without_step_0_replaces_the_checkpoints_for_both(tmp_path):
    save(tmp_path, 2)
    for plan in both(tmp_path, load_step=0, initial_hf="hf"):
        assert plan.start == FromHF("hf") and plan.replaces_checkpoints


def test_a_model_only_checkpoint_gives_its_weights(tmp_path):
    save(tmp_path, 0, model_only=True)
    verified, complete = both(tmp_path, load_step=0)
    assert verified.start == ModelOnly(0)
    assert complete.start == Resume(0)  # preflight reads nothing to tell them apart


def test_what_the_trainer_refuses_is_said_in_one_line(tmp_path):
    save(tmp_path, 2)
    flip_bytes(tmp_path / "step-2" / "__0_0.distcp")
    with pytest.raises(BadCheckpointError, match="holds 1 checkpoint and none can be loaded"):
        both(tmp_path)
    with pytest.raises(BadCheckpointError, match="step-2 is corrupt: .*no checkpoint in the"):
        both(tmp_path, load_step=2)
    with pytest.raises(BadCheckpointError, match="load_step = 3: no complete checkpoint at"):
        both(tmp_path, load_step=3)


def test_other_data_settings_are_refused_unless_allowed(tmp_path, capsys):
    save(tmp_path, 2)
    changed = {"training.seq_len": 16}
    with pytest.raises(BadCheckpointError, match="training.seq_len: 32 in the checkpoint, 16 now"):
        both(tmp_path, changed)
    verified, _ = both(tmp_path, changed, allow_data_change=True)
    assert verified.start == Resume(2)
    assert "(checkpoint.allow_data_change = true)" in capsys.readouterr().err

"""A checkpoint written in the format of before the trainer's components owned their state
(commit c242fcc, tests/checkpoint/legacy_checkpoint/README.md) still resumes exactly.

Only what this machine computes is compared bit for bit. The committed checkpoint holds the
floats of the machine that wrote it: the same run's step-10 state computed here differs from it
in the last bits of nearly every weight and AdamW moment (the kernels' summation order depends on
the CPU's vector width, the thread count and MKL's code path: on one machine, changing any one of
ATEN_CPU_CAPABILITY, OMP_NUM_THREADS or MKL_CBWR changes those bits), so a run resumed from it
is not bit-equal to one that trained steps 1-10 here. So the proof has three parts, each with
both sides computed here from the same bits:

- the loader gives today's components every committed entry, bit for bit, under the mapping
  of checkpoint/legacy.py;
- the committed state written here in today's format resumes to the very state the old format
  resumes to;
- a run of this machine stopped at step 10 and resumed is the run that never stopped.

The old trainer's losses (losses.json, the writing machine's floats) are compared within a
tolerance."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from bloomnative.checkpoint import reading
from bloomnative.checkpoint.checkpointer import Checkpointer, load_components
from harness.shared_world import SharedWorld
from harness.training import checkpoint_entries, losses_by_step
from scenarios.spike_scenario import BAD, TRAIN_WITH_SPIKES, spike_argv

LEGACY = Path(__file__).resolve().with_name("legacy_checkpoint")
STEP = 10  # the committed checkpoint's
RESUMED_STEPS = (11, 12)

RENAMED = {
    "train.consumed_samples": "data.consumed_samples",
    "train.skipped_samples": "data.skipped",
    "train.scheduled_samples": "lr_clock.applied_samples",
    "train.nonfinite_skipped": "nonfinite.skipped",
}
"""Old key -> today's, as checkpoint/legacy.py's docstring says (its code is not used here);
every other entry keeps its key."""

OLD_TRAINER_REL = 1e-5
"""How far a loss here may be from the old trainer's (losses.json): those are the floats of the
machine that wrote the fixture. On another CPU the kernels sum in another order, and a loss can
differ in its last bits (seen: 1 float32 ulp, rel 1e-7, at step 11 with
ATEN_CPU_CAPABILITY=default). 1e-5 allows 100 times that, and is 12 times less than what a
learning-rate clock one batch ahead after the resume changes (rel 1.2e-4 at step 12); a dropout
state not restored changes the losses by up to rel 5e-4."""


def legacy_run(dump: Path, corpus: str, *extra: str) -> list[str]:
    """The checkpoint's run (its README): test_spikes.py's with a smaller model and dropout, to
    its end, in `dump`."""
    model = ["--model.n_layer=2", "--model.hidden_size=16", "--model.n_head=2"]
    return spike_argv(dump, corpus, *model, "--model.hidden_dropout=0.1", *extra)


def in_todays_format(old: dict) -> dict:
    """The old format's entries under today's keys, as today's components save them: the data
    position an int and its skipped windows a list of (start, end); the rest as they are."""
    new = {}
    for key, value in old.items():
        if key == "train.consumed_samples":
            value = int(value)
        elif key == "train.skipped_samples":
            value = [tuple(window) for window in value.tolist()]
        new[RENAMED.get(key, key)] = value
    return new


def by_component(flat: dict) -> dict[str, dict]:
    """{"model.x.weight": v} -> {"model": {"x.weight": v}}: a checkpoint's entries as the
    components' states they were saved from."""
    nested: dict[str, dict] = {}
    for key, value in flat.items():
        component, _, name = key.partition(".")
        nested.setdefault(component, {})[name] = value
    return nested


def write_in_todays_format(old_checkpoint: Path, folder: Path) -> None:
    """The committed state, converted in this process, saved by today's Checkpointer as
    checkpoint STEP in `folder`. Like the committed one it has no bloom_args.json or
    data_settings.json, so resuming from either differs in the format of the entries only."""
    saver = Checkpointer(folder, keep_latest_k=0, async_mode=False, min_free_gib=0)
    saver.save(STEP, by_component(in_todays_format(checkpoint_entries(old_checkpoint))))
    saver.wait()


def same_bits(a: object, b: object) -> bool:
    """Tensors: the same dtype, shape and bytes (NaN included); other values: equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return type(a) is type(b) and a == b


def differing(a: dict, b: dict) -> list[str]:
    """The keys of `a` whose value is not bit-equal to `b`'s (the key sets must be equal)."""
    assert a.keys() == b.keys()
    return [key for key in a if not same_bits(a[key], b[key])]


def kind(value: object) -> object:
    """What a checkpoint entry is, without its value: a tensor's dtype and shape, else a type."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape))
    return type(value)


class Recorder:
    """One of today's trainer's components as the loader sees it: it asks for the entries of
    `saved` (today's names, dtypes and shapes), each tensor filled with what no checkpoint holds
    (NaN, or its dtype's largest value), and keeps what it is given."""

    def __init__(self, saved: dict):
        self.saved = saved
        self.given: dict | None = None

    def state_dict(self) -> dict:
        def unloaded(value: object) -> object:
            if not isinstance(value, torch.Tensor):
                return None
            fill = math.nan if value.is_floating_point() else torch.iinfo(value.dtype).max
            return torch.full_like(value, fill)

        return {key: unloaded(value) for key, value in self.saved.items()}

    def load_state_dict(self, state: dict) -> None:
        self.given = state


def counter(value: object) -> object:
    """A 0-d integer tensor as the int it holds (the loader gives the old `train.*` counters to
    the components as ints; they fill their own tensors with them); anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        return int(value)
    return value


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> SharedWorld:
    """One shared world, every run the checkpoint's run (test_spikes.py's spiking trainer) to
    step 12, its dump folder <world.out>/../<dump>:

    - "uninterrupted": today's trainer from the start;
    - "stopped" then "restarted" (one dump, "restarted"): the same, stopped at step 10, then
      resumed from its own step-10 checkpoint;
    - "todays_format": resumed from the committed state converted here to today's format;
    - "old_format_with", "old_format_without": resumed from a copy of the committed checkpoints,
      with rollbacks.json and without it (the skipped window then comes from the checkpoint
      alone)."""
    out = tmp_path_factory.mktemp("legacy")
    committed = LEGACY / "checkpoints"
    todays = out / "todays_format" / "checkpoints"
    write_in_todays_format(committed / f"step-{STEP}", todays)
    shutil.copy(committed / "rollbacks.json", todays)
    for rollback_log in ("with", "without"):
        copy = out / f"old_format_{rollback_log}" / "checkpoints"
        shutil.copytree(committed, copy)
        if rollback_log == "without":
            (copy / "rollbacks.json").unlink()

    world = SharedWorld(out / "world")
    scenarios = [
        ("uninterrupted", "uninterrupted", []),
        ("stopped", "restarted", [f"--training.steps={STEP}"]),
        ("restarted", "restarted", []),
        ("todays_format", "todays_format", []),
        ("old_format_with", "old_format_with", []),
        ("old_format_without", "old_format_without", []),
    ]
    for name, dump, extra in scenarios:
        world.add(name, TRAIN_WITH_SPIKES, BAD, legacy_run(out / dump, synthetic_corpus, *extra))
    return world.run()


def dump(runs: SharedWorld, name: str) -> Path:
    """The dump folder of scenario `name`, once it has ended well."""
    runs.result(name)
    return runs.out.parent / name


def resumed_at_step_10(runs: SharedWorld, name: str) -> Path:
    """The dump folder of scenario `name`, which must have resumed from step-10."""
    assert f"step-{STEP} at step {STEP}" in runs.result(name).stdout
    return runs.out.parent / name


def checkpoint(folder: Path, step: int) -> dict:
    return checkpoint_entries(folder / "checkpoints" / f"step-{step}")


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_loader_gives_todays_components_every_committed_entry(runs):
    """Each component of today's trainer (the entries it asks for: those of a checkpoint
    today's trainer wrote) gets from the committed checkpoint exactly the committed values,
    read back here entry by entry, under today's names: weights, AdamW state and
    hyper-parameters, step, spike detector and RNG unchanged, the `train.*` counters as the data
    position and skipped windows, the learning-rate clock and the non-finite count."""
    committed = LEGACY / "checkpoints" / f"step-{STEP}"
    old = checkpoint_entries(committed)
    assert set(RENAMED) <= old.keys() and not old.keys() & RENAMED.values()
    todays = by_component(checkpoint(dump(runs, "uninterrupted"), STEP))
    recorders = {name: Recorder(saved) for name, saved in todays.items()}
    load_components(
        reading.verified_reader(committed), recorders, complete=("model", "optimizer", "train")
    )
    expected = by_component(in_todays_format(old))
    assert recorders.keys() == expected.keys()
    for name, recorder in recorders.items():
        given = {key: counter(value) for key, value in recorder.given.items()}
        want = {key: counter(value) for key, value in expected[name].items()}
        assert differing(given, want) == [], name
    assert expected["data"] == {"consumed_samples": 80, "skipped": [(48, 80)]}


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_committed_state_converted_here_is_in_todays_format(runs):
    """The premise of the next test: the converted checkpoint has the entries, dtypes, shapes
    and value types of the checkpoint today's trainer saves at the same step."""
    converted = checkpoint_entries(
        runs.out.parent / "todays_format" / "checkpoints" / f"step-{STEP}"
    )
    saved_today = checkpoint(dump(runs, "uninterrupted"), STEP)
    assert {k: kind(v) for k, v in converted.items()} == {
        k: kind(v) for k, v in saved_today.items()
    }


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("rollback_log", ["with", "without"])
def test_an_old_format_checkpoint_resumes_as_the_same_state_in_todays_format(runs, rollback_log):
    """Resumed from the committed checkpoint and from the same bits in today's format, steps
    11-12 give the same losses, and the state at the end (weights, AdamW, data position and
    windows, learning-rate clock, spike detector, RNG) is the same, entry by entry, bit for bit.
    Without rollbacks.json the skipped window comes from the checkpoint alone."""
    old = resumed_at_step_10(runs, f"old_format_{rollback_log}")
    todays = resumed_at_step_10(runs, "todays_format")
    assert sorted(losses_by_step(old)) == list(RESUMED_STEPS)
    assert losses_by_step(old) == losses_by_step(todays)
    resumed = checkpoint(old, 12)
    assert "data.consumed_samples" in resumed and "train.consumed_samples" not in resumed
    assert resumed["data.skipped"] == [(48, 80)]
    assert differing(resumed, checkpoint(todays, 12)) == []


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_stopped_here_at_step_10_resumes_as_the_run_that_never_stopped(runs):
    """The same run, from a state made on this machine: stopped at step 10 (after the rollback,
    with the skipped window and dropout on) and resumed, its losses and its state at step 12 are
    the uninterrupted run's, bit for bit. With the previous test: an old-format checkpoint
    resumes as the run that never stopped."""
    runs.result("stopped")
    restarted = resumed_at_step_10(runs, "restarted")
    uninterrupted = dump(runs, "uninterrupted")
    assert losses_by_step(restarted) == losses_by_step(uninterrupted)
    assert differing(checkpoint(restarted, 12), checkpoint(uninterrupted, 12)) == []


@pytest.mark.multiprocess
def test_todays_trainer_gives_the_old_trainers_losses(runs):
    """Today's trainer from the start, and from the committed checkpoint on, gives the losses of
    the old trainer's run (losses.json) within OLD_TRAINER_REL: those were computed on another
    machine, so their last bits are not this machine's."""
    written = json.loads((LEGACY / "losses.json").read_text())
    old = {int(step): loss for step, loss in written.items()}
    assert sorted(old) == list(range(1, 13))
    uninterrupted = losses_by_step(dump(runs, "uninterrupted"))
    assert uninterrupted == pytest.approx(old, rel=OLD_TRAINER_REL, abs=0)
    for rollback_log in ("with", "without"):
        resumed = losses_by_step(dump(runs, f"old_format_{rollback_log}"))
        assert resumed == pytest.approx(
            {step: old[step] for step in RESUMED_STEPS}, rel=OLD_TRAINER_REL, abs=0
        )

"""How a run starts, decided in one place: `plan_start` looks at the checkpoint folder under the
`checkpoint` settings and returns a `StartPlan`: afresh (`Fresh`), resuming a training
checkpoint (`Resume`), or from the weights of a model-only checkpoint (`ModelOnly`,
tools/convert_hf.py to-native) or of a Hugging Face folder (`FromHF`, checkpoint.initial_hf),
with the newer checkpoints it passed over and why. When the run cannot start as configured it
raises BadCheckpointError with the one line the run ends with, and nothing is renamed.

The rules (docs/checkpointing.md, "Fallback rules"):

- checkpoint.enable = false: the folder is not looked at.
- checkpoint.load_step = 0 and no step-0: no checkpoint is loaded, and the folder's are set
  aside (step-<N>.replaced).
- checkpoint.load_step = N: checkpoint N; a missing one, or one that cannot be loaded, is
  refused, naming what to load instead.
- checkpoint.load_step = -1: the newest complete checkpoint that can be loaded, the newer ones
  passed over; a folder holding checkpoints none of which can be loaded is refused.
- With no checkpoint to start from, the weights of checkpoint.initial_hf, else fresh ones.
- A resume with other data settings than the checkpoint's is refused, unless
  checkpoint.allow_data_change (then a warning names them).
- A LoRA run's checkpoint holds the adapters, not the frozen base: a resume loads the base from
  checkpoint.initial_hf first (`Resume.base`), and is refused when those are other weights than
  the checkpoint's record of its base (`base_model.json`).

The trainer executes the plan; preflight asks the same question before any worker exists. They
differ only in how a complete checkpoint is examined, the `CheckpointCheck` they pass: the
trainer's (`VerifiedCheck`) verifies its files, collectively, and that it holds this run's
model, and tells a model-only checkpoint from a training one; preflight's (`CompleteCheck`)
reads nothing and takes every complete checkpoint as loadable, verifying being the workers'
job. A new way to start (an adapter, an imported checkpoint) is another variant of `Start`,
given by a check's `start_from` or by `plan_start`, and executed by the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bloomnative.checkpoint.checkpointer import (
    BadCheckpointError,
    Checkpointer,
    Fits,
    Rejection,
    first_usable,
    is_model_only,
)
from bloomnative.checkpoint.integrity import complete_steps
from bloomnative.checkpoint.run_record import (
    BASE_FILE,
    DATA_FILE,
    DataSettings,
    base_difference,
    data_differences,
    read_json_file,
)
from bloomnative.log import get_logger

_log = get_logger(__name__)


@dataclass(frozen=True)
class Fresh:
    """Initial weights from the seed, at step 0."""


@dataclass(frozen=True)
class Resume:
    """Every component's state from training checkpoint `step` of the folder; when `base` is
    set, after the frozen base from that Hugging Face folder (a LoRA run's checkpoint holds the
    adapters only)."""

    step: int
    base: str = ""


@dataclass(frozen=True)
class ModelOnly:
    """The weights of model-only checkpoint `step` of the folder, at step 0 with a fresh
    optimizer."""

    step: int


@dataclass(frozen=True)
class FromHF:
    """The weights of the Hugging Face folder `path`, at step 0 with a fresh optimizer."""

    path: str


Loadable = Resume | ModelOnly
"""What a checkpoint of the folder can give a run."""
Start = Fresh | Resume | ModelOnly | FromHF


@dataclass(frozen=True)
class StartPlan:
    """How a run starts (`start`) and what happens to the folder's other checkpoints."""

    start: Start
    passed_over: tuple[Rejection, ...] = ()
    """The newer complete checkpoints that cannot be loaded, newest first, and why: set aside
    (step-<N>.<kind>) as the run starts from an older one."""
    replaces_checkpoints: bool = False
    """checkpoint.load_step = 0 with no step-0: the folder's checkpoints are set aside as
    step-<N>.replaced."""


class CheckpointCheck(Protocol):
    """How `plan_start` examines the complete checkpoints of the folder."""

    def rejection(self, step: int) -> Rejection | None:
        """Why checkpoint `step` cannot be loaded into this run, or None."""
        ...

    def start_from(self, step: int) -> Loadable:
        """What the loadable checkpoint `step` gives this run."""
        ...

    def data_changes(self, step: int) -> list[str]:
        """For a loadable training checkpoint: each data setting that differs from this run's,
        in a line ('training.seq_len: 64 in the checkpoint, 32 now')."""
        ...

    def base_change(self, step: int) -> str | None:
        """For a loadable training checkpoint of adapters: how this run's base differs from the
        one it records (`run_record.base_difference`), or None."""
        ...

    def instead(self, folder: Path, steps: list[int]) -> str:
        """What to set checkpoint.load_step to when the checkpoint it names cannot be loaded;
        `steps`: the folder's other complete checkpoints, newest first."""
        ...


class VerifiedCheck:
    """The trainer's check, collective: a checkpoint can be loaded when its files match its
    record (`Checkpointer.usable`, which keeps its reader for the load) and it `fits` this run's
    model; one without optimizer state is model-only. `data_settings`: this run's, as
    `data_settings.json` records them; `base`: a LoRA run's frozen base, as `base_model.json`
    records it (None without adapters)."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        fits: Fits | None,
        data_settings: dict,
        base: dict | None = None,
    ):
        self.checkpointer = checkpointer
        self.fits = fits
        self.data_settings = data_settings
        self.base = base

    def rejection(self, step: int) -> Rejection | None:
        return self.checkpointer.usable(step, self.fits)

    def start_from(self, step: int) -> Loadable:
        reader = self.checkpointer.reader(step)
        if is_model_only(reader):
            return ModelOnly(step)
        if self.base is not None and BASE_FILE in reader.record:  # the adapters only
            return Resume(step, self.base["initial_hf"])
        return Resume(step)

    def data_changes(self, step: int) -> list[str]:
        """Nothing for a checkpoint that records no data settings (saved before they were);
        settings that know how to compare themselves (`DataSettings`) do."""
        reader = self.checkpointer.reader(step)
        saved = read_json_file(reader.folder, reader.record, DATA_FILE)
        if not saved:
            return []
        if isinstance(self.data_settings, DataSettings):
            return self.data_settings.differences(saved)
        return data_differences(saved, self.data_settings)

    def base_change(self, step: int) -> str | None:
        reader = self.checkpointer.reader(step)
        saved = read_json_file(reader.folder, reader.record, BASE_FILE)
        if saved is None or self.base is None:
            return None  # a checkpoint of the whole model, or a run that `fits` refuses
        return base_difference(saved, self.base)

    def instead(self, folder: Path, steps: list[int]) -> str:
        good, _ = first_usable(steps, self.rejection)
        if good is None:
            return (
                "no checkpoint in the folder can be loaded (set checkpoint.load_step = 0 to start "
                "afresh)"
            )
        return (
            f"the newest checkpoint that can be loaded is step {good} (set "
            f"checkpoint.load_step = {good}, or -1 to take the newest usable one)"
        )


class CompleteCheck:
    """Preflight's check, which reads no file: every complete checkpoint is taken to load, as a
    training checkpoint (the workers verify it, and tell a model-only one, before loading)."""

    def rejection(self, step: int) -> Rejection | None:
        return None

    def start_from(self, step: int) -> Loadable:
        return Resume(step)

    def data_changes(self, step: int) -> list[str]:
        return []

    def base_change(self, step: int) -> str | None:
        return None

    def instead(self, folder: Path, steps: list[int]) -> str:
        if not steps:
            return (
                f"{folder} holds no complete checkpoint (set checkpoint.load_step = -1 to start "
                "afresh)"
            )
        return (
            f"the complete checkpoints there are steps {', '.join(map(str, sorted(steps)))} (set "
            "checkpoint.load_step to one of them, or -1 for the newest that verifies)"
        )


def plan_start(
    folder: Path,
    check: CheckpointCheck,
    *,
    enabled: bool = True,
    load_step: int = -1,
    initial_hf: str = "",
    allow_data_change: bool = False,
) -> StartPlan:
    """How a run whose checkpoint folder is `folder` starts, under the `checkpoint` settings of
    these names (`enabled`: checkpoint.enable), by the rules of the module docstring. Raises
    BadCheckpointError when it cannot start as configured. Collective when `check` is."""
    without_checkpoint: Start = FromHF(initial_hf) if initial_hf else Fresh()
    if not enabled:
        return StartPlan(without_checkpoint)
    if load_step == 0 and not _step_folder(folder, 0).is_dir():
        return StartPlan(without_checkpoint, replaces_checkpoints=True)
    passed_over: list[Rejection] = []
    if load_step >= 0:
        _require(folder, load_step, check)
        step = load_step
    else:
        newest, passed_over = first_usable(reversed(complete_steps(folder)), check.rejection)
        if newest is None and passed_over:
            raise BadCheckpointError(_none_can_be_loaded(folder, passed_over))
        if newest is None:
            return StartPlan(without_checkpoint)
        step = newest
    start = check.start_from(step)
    if isinstance(start, Resume):
        differences = check.data_changes(step)
        _check_data_changes(_step_folder(folder, step), differences, allow_data_change)
        if (change := check.base_change(step)) is not None:
            raise BadCheckpointError(
                f"cannot resume from {_step_folder(folder, step)}: {change}; set "
                "checkpoint.initial_hf to the base it was trained on, or start another "
                "job.dump_folder"
            )
    return StartPlan(start, tuple(passed_over))


def _step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def _require(folder: Path, step: int, check: CheckpointCheck) -> None:
    """Raises BadCheckpointError, saying why and what to load instead, unless checkpoint
    `step` (checkpoint.load_step) exists and can be loaded."""
    path = _step_folder(folder, step)
    if not path.is_dir():
        problem = f"no complete checkpoint at {path}"
    elif (rejection := check.rejection(step)) is None:
        return
    else:
        problem = rejection.describe()
    others = [s for s in reversed(complete_steps(folder)) if s != step]
    raise BadCheckpointError(
        f"checkpoint.load_step = {step}: {problem}; {check.instead(folder, others)}"
    )


def _none_can_be_loaded(folder: Path, rejected: list[Rejection]) -> str:
    count = f"{len(rejected)} checkpoint{'s' if len(rejected) > 1 else ''}"
    return (
        f"{folder} holds {count} and none can be loaded: "
        f"{'; '.join(r.describe() for r in rejected)}; nothing was renamed or loaded; set "
        "checkpoint.load_step = 0 to start afresh from step 0 (the checkpoints are then renamed "
        "step-<N>.replaced)"
    )


def _check_data_changes(checkpoint: Path, differences: list[str], allowed: bool) -> None:
    """Refuses to resume `checkpoint` with other data settings than it was trained with, unless
    checkpoint.allow_data_change says to go on (with a warning)."""
    if not differences:
        return
    what = (
        f"resuming from {checkpoint} with other data settings than it was trained with: "
        f"{'; '.join(differences)}"
    )
    if not allowed:
        raise BadCheckpointError(
            f"{what}; the samples after the resume would not continue its data order; restore "
            "the settings, start another job.dump_folder, or set checkpoint.allow_data_change = "
            "true to resume anyway"
        )
    _log.warning(f"{what} (checkpoint.allow_data_change = true)")

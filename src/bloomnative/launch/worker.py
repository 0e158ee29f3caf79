"""`python -m bloomnative.launch.worker [--config FILE] [--section.key=value ...]` (what
run_train.sh launches under torchrun)."""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING

from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.data import IndexedDatasetError, SplitError
from bloomnative.launch.torchrun import exit_with_launcher, launcher_gone, report_final_error
from bloomnative.log import get_logger
from bloomnative.parallel import LayoutError
from bloomnative.planner import PlanError
from bloomnative.train.distributed import exit_process
from bloomnative.train.faults import catch_stop_signals
from bloomnative.train.hang import is_collective_failure

if TYPE_CHECKING:
    from bloomnative.train.trainer import Trainer

_log = get_logger(__name__)


def final_errors() -> dict[type[Exception], str]:
    """The errors a restart cannot fix, each with the label its one line starts with: the
    worker reports them to the launcher (`final_error`), which ends the job with exit 2 instead
    of restarting it into the same error. The user's input (found before any model is built), a
    checkpoint that cannot be used, a dump folder in use, a disk too full for the next save,
    and a run that cannot go on: its steps stay non-finite (training.max_nonfinite_steps), or
    its loss spikes cannot be rolled back (spikes.max_rollbacks, no checkpoint before the spike,
    no data left past the skipped windows, an unreadable rollbacks.json); a restart resumes
    from the same checkpoint, with the same data and seed, into the same end."""
    from bloomnative.checkpoint.checkpointer import BadCheckpointError, DiskSpaceError
    from bloomnative.interop import CheckpointFormatError
    from bloomnative.train.nonfinite import NonFiniteError
    from bloomnative.train.run_lock import DumpFolderInUseError
    from bloomnative.train.spikes import SpikeError

    return {
        ConfigError: "config error",
        LayoutError: "config error",
        PlanError: "config error",
        IndexedDatasetError: "data error",
        SplitError: "data error",
        BadCheckpointError: "checkpoint error",
        CheckpointFormatError: "checkpoint error",
        DiskSpaceError: "checkpoint error",
        DumpFolderInUseError: "error",
        NonFiniteError: "training error",
        SpikeError: "training error",
    }


def final_label(error: BaseException) -> str | None:
    """The label of `error`'s one line if it is final (`final_errors`), else None."""
    for kind, label in final_errors().items():
        if isinstance(error, kind):
            return label
    return None


def main(argv: list[str] | None = None, trainer_class: type[Trainer] | None = None) -> int:
    """Exit codes: 0 trained (or stopped on request, with a checkpoint), 2 an error a restart
    cannot fix (`final_errors`: a configuration or data error, reported before any model is
    built; a dump folder another run is using; a checkpoint that cannot be used: a
    checkpoint.load_step that is missing or cannot be loaded, a folder none of whose checkpoints
    can be, other data settings than the checkpoint's, a checkpoint.initial_hf folder that
    cannot be read; a disk without room for the next save; too many non-finite steps in a row;
    loss spikes that cannot be rolled back), in one line, 1 a checkpoint that could not be
    written (one line: the cause, the disk and its free space) or any other failure (its
    traceback printed). Under bloomnative.launch.torchrun an exit 2 is final (the job is not
    restarted) and its one line is printed by the launcher, once; and the process ends when the
    launcher does.

    `trainer_class`: a subclass of Trainer to run instead, through the trainer's extension
    points (tests/scenarios/ does)."""
    catch_stop_signals()
    exit_with_launcher()
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        return final_error(f"config error: {e}")
    from bloomnative.train.trainer import Trainer

    try:
        trainer = (trainer_class or Trainer)(config)
        trainer.run()
        if trainer.rank == 0 and config.validation.sample_tokens:
            print_sample(config)
    except Exception as e:
        return failure(e)
    return 0


def failure(error: Exception) -> int:
    """The exit code of a run that raised `error` (see `main`), once its report is printed or
    handed to the launcher."""
    from bloomnative.checkpoint.checkpointer import CheckpointError

    if (label := final_label(error)) is not None:
        return final_error(f"{label}: {error}")
    if isinstance(error, CheckpointError):  # a save that failed: the message says where and why
        print(f"{save_failure_label(error)}: {error}", file=sys.stderr)
        return 1
    if launcher_gone():  # a peer stopped with it; the watchdog says so and ends this one
        return 1
    # A failed rank leaves at once, so that torchrun sees it and stops (or restarts) the job:
    # the peers it was exchanging with fail in turn instead of waiting for it until
    # job.collective_timeout_s, and nothing here waits on them (process-group teardown,
    # interpreter finalization with gloo's threads: see exit_process).
    traceback.print_exception(error)
    return 1


def save_failure_label(error: Exception) -> str:
    """How a save that raised `error` is reported: a peer lost while the ranks wrote together (a
    collective's failure, train/hang.py) is not a failure of the checkpoint or its disk."""
    cause = error.__cause__
    lost = cause is not None and is_collective_failure(cause)
    return "lost a peer while saving" if lost else "checkpoint error"


def final_error(line: str) -> int:
    """Reports an error of the user's input (to the launcher, else on stderr); returns 2."""
    if not report_final_error(line):
        print(line, file=sys.stderr)
    return 2


def print_sample(config: Config) -> None:
    """The end-of-training sample, read back from the final checkpoint (whatever the layout)."""
    if not config.checkpoint.enable:
        _log.info("no sample: it is read from the final checkpoint and checkpoint.enable = false")
        return
    from bloomnative.generate import print_final_sample

    v = config.validation
    print_final_sample(config.job.dump_folder, v.sample_prompt, v.sample_tokens, config.job.seed)


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process

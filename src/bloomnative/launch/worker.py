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

# The errors of the user's input: restarting the job cannot fix them (the launcher does not).
_CONFIG_ERRORS = (ConfigError, LayoutError, PlanError)
_DATA_ERRORS = (IndexedDatasetError, SplitError)


def main(argv: list[str] | None = None, trainer_class: type[Trainer] | None = None) -> int:
    """Exit codes: 0 trained (or stopped on request, with a checkpoint), 2 configuration or data
    error (reported before any model is built), a dump folder another run is using, or a
    checkpoint that cannot be used (a checkpoint.load_step that is missing or cannot be loaded,
    a folder none of whose checkpoints can be, other data settings than the checkpoint's, a
    checkpoint.initial_hf folder that cannot be read), a disk without room for the next
    checkpoint, 1 a checkpoint that could not be written
    (one line: the cause, the disk and its free space) or any other failure (its traceback
    printed). Under bloomnative.launch.torchrun an exit 2 is final (the job is not restarted) and
    its one line is printed by the launcher, once; and the process ends when the launcher does.

    `trainer_class`: a subclass of Trainer to run instead, through the trainer's extension
    points (tests/scenarios/ does)."""
    catch_stop_signals()
    exit_with_launcher()
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        return final_error(f"config error: {e}")
    from bloomnative.checkpoint.checkpointer import (
        BadCheckpointError,
        CheckpointError,
        DiskSpaceError,
    )
    from bloomnative.interop import CheckpointFormatError
    from bloomnative.train.run_lock import DumpFolderInUseError
    from bloomnative.train.trainer import Trainer

    try:
        trainer = (trainer_class or Trainer)(config)
        trainer.run()
        if trainer.rank == 0 and config.validation.sample_tokens:
            print_sample(config)
    except _CONFIG_ERRORS as e:  # found before any model is built
        return final_error(f"config error: {e}")
    except _DATA_ERRORS as e:
        return final_error(f"data error: {e}")
    except (BadCheckpointError, CheckpointFormatError, DiskSpaceError) as e:
        return final_error(f"checkpoint error: {e}")
    except DumpFolderInUseError as e:
        return final_error(f"error: {e}")
    except CheckpointError as e:  # a save that failed: the message says where and why
        print(f"{save_failure_label(e)}: {e}", file=sys.stderr)
        return 1
    except Exception:
        if launcher_gone():  # a peer stopped with it; the watchdog says so and ends this one
            return 1
        # A failed rank leaves at once, so that torchrun sees it and stops (or restarts) the
        # job: the peers it was exchanging with fail in turn instead of waiting for it until
        # job.collective_timeout_s, and nothing here waits on them (process-group teardown,
        # interpreter finalization with gloo's threads: see exit_process).
        traceback.print_exc()
        return 1
    return 0


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

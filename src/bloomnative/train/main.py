"""`python -m bloomnative.train.main [--config FILE] [--section.key=value ...]` (what
run_train.sh launches under torchrun)."""

from __future__ import annotations

import sys
import traceback

from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.data import IndexedDatasetError
from bloomnative.log import get_logger
from bloomnative.parallel import LayoutError
from bloomnative.planner import PlanError
from bloomnative.train.distributed import exit_process
from bloomnative.train.faults import catch_stop_signals

_log = get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 trained (or stopped on request, with a checkpoint), 2 configuration or data
    error (reported before any model is built), a dump folder another run is using, or a
    resume that cannot go on (a checkpoint.load_step that is missing or cannot be loaded, a
    folder none of whose checkpoints can be, other data settings than the checkpoint's), 1 a
    checkpoint that could not be written (one line: the cause, the disk and its free space) or
    any other failure (its traceback printed)."""
    catch_stop_signals()
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from bloomnative.checkpoint.checkpointer import BadCheckpointError, CheckpointError
    from bloomnative.train.run_lock import DumpFolderInUseError
    from bloomnative.train.trainer import Trainer

    try:
        trainer = Trainer(config)
        trainer.run()
        if trainer.rank == 0 and config.validation.sample_tokens:
            print_sample(config)
    except (ConfigError, LayoutError, PlanError) as e:  # found before any model is built
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except IndexedDatasetError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except BadCheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    except DumpFolderInUseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a save that failed: the message says where and why
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 1
    except Exception:
        # A failed rank leaves at once, so that torchrun sees it and stops (or restarts) the
        # job: the peers it was exchanging with fail in turn instead of waiting for it until
        # job.collective_timeout_s, and nothing here waits on them (process-group teardown,
        # interpreter finalization with gloo's threads: see exit_process).
        traceback.print_exc()
        return 1
    return 0


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

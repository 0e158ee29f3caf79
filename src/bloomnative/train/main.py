"""`python -m bloomnative.train.main [--config FILE] [--section.key=value ...]` (what
run_train.sh launches under torchrun)."""

from __future__ import annotations

import sys

from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.data import IndexedDatasetError
from bloomnative.parallel import LayoutError
from bloomnative.parallel.memory_estimate import PlanError
from bloomnative.train.distributed import exit_process


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 trained (or stopped on request, with a checkpoint), 2 configuration or data
    error (reported before any model is built); other failures raise."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from bloomnative.train.trainer import Trainer

    try:
        trainer = Trainer(config)
    except (ConfigError, LayoutError, PlanError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except IndexedDatasetError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    trainer.run()
    if trainer.rank == 0 and config.validation.sample_tokens:
        print_sample(config)
    return 0


def print_sample(config: Config) -> None:
    """The end-of-training sample, read back from the final checkpoint (whatever the layout)."""
    if not config.checkpoint.enable:
        print(
            "[bloomnative] no sample: it is read from the final checkpoint and "
            "checkpoint.enable = false",
            flush=True,
        )
        return
    from bloomnative.generate import print_final_sample

    v = config.validation
    print_final_sample(config.job.dump_folder, v.sample_prompt, v.sample_tokens, config.job.seed)


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process

"""`python -m bloomnative.train.main [--config FILE] [--section.key=value ...]` (what
run_train.sh launches under torchrun)."""

from __future__ import annotations

import sys

from bloomnative.config import ConfigError, parse_args


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:  # before any process group or model exists
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from bloomnative.train.trainer import run

    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())

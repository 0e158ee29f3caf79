"""The training job: `Trainer(parse_args(argv)).run()` is what `./run_train.sh` runs on every
rank (the config dataclasses, one per TOML section, are in `bloomnative.config`).
`exit_process` ends a process that used torch.distributed without the interpreter-shutdown race
of gloo's threads (see its docstring)."""

from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.train.distributed import exit_process


def __getattr__(name: str):
    # The trainer imports every package of bloomnative: loaded on first use, so that importing
    # one module of this package (`bloomnative.train.distributed`, as the tools do) stays light.
    if name == "Trainer":
        from bloomnative.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "Trainer", "exit_process", "parse_args"]

"""The training job: `Trainer(parse_args(argv)).run()` is what `./run_train.sh` runs on every
rank (the config dataclasses, one per TOML section, are in `bloomnative.config`).
`exit_process` ends a process that used torch.distributed without the interpreter-shutdown race
of gloo's threads (see its docstring)."""

import importlib

# Each name is loaded on first use: the config and the trainer import torch and every package
# of bloomnative, and importing one module of this package must stay light (the launcher checks
# its variables before anything else, `bloomnative.train.distributed` serves the tools).
_HOMES = {
    "Config": "bloomnative.config",
    "ConfigError": "bloomnative.config",
    "parse_args": "bloomnative.config",
    "exit_process": "bloomnative.train.distributed",
    "Trainer": "bloomnative.train.trainer",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = ["Config", "ConfigError", "Trainer", "exit_process", "parse_args"]

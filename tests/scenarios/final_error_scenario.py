"""A trainer that raises a given error as it starts, run by `bloomnative.launch.worker.main`:
`raise_at_start(error, argv)`, a scenario of a shared world (tests/harness/shared_world.py).
`error` is `module:Class`; the error's message is "planted <Class>"."""

from __future__ import annotations

import importlib

from bloomnative.config import Config
from bloomnative.launch.worker import main
from bloomnative.train.trainer import Trainer


def raise_at_start(error: str, argv: list[str]) -> int:
    module, _, name = error.partition(":")
    kind = getattr(importlib.import_module(module), name)

    class Raising(Trainer):
        def __init__(self, config: Config):
            raise kind(f"planted {name}")

    return main(argv, trainer_class=Raising)

"""The command-line parsing the tools share: a parser whose errors are one line, and argument
types. Each type parses one flag's text or raises ArgumentTypeError saying what would be valid,
so a bad flag is one error line naming it, exit code 2: never a traceback, and never a NaN or
an infinity passed on as a number."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def whole_number(least: int = 0) -> Callable[[str], int]:
    """A whole number >= `least` (>= 0), in plain decimal digits."""

    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {least}")
        return int(text)

    return parse


def number(least: float, *, above: bool = False, most: float = math.inf) -> Callable[[str], float]:
    """A finite number >= `least` (> `least` with `above`) and <= `most`."""
    bounds = f"{'>' if above else '>='} {least:g}" + (
        f" and <= {most:g}" if most < math.inf else ""
    )

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low_ok = value > least if above else value >= least
        if not (math.isfinite(value) and low_ok and value <= most):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number {bounds}")
        return value

    return parse


def output_file(text: str) -> str:
    """A file to write: '-' (stdout), or a path whose folder exists."""
    folder = Path(text).parent
    if text != "-" and not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} does not exist")
    return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (no usage block): "prog: error: ... (see
    --help)", exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

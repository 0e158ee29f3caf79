"""bloomnative's one logger: Python's `logging` under the name "bloomnative", set up once per
process, aware of the distributed rank.

A module logs through `_log = get_logger(__name__)`: `_log.info(...)`, `_log.warning(...)`,
`_log.debug(...)`. What a process then shows:

- on the console, the records of the shown ranks (rank 0 unless `BLOOMNATIVE_LOG_RANKS` says
  otherwise) at the level and above: INFO and DEBUG on stdout, WARNING and above on stderr (a
  process can send everything to stderr, as the launcher does). A line reads
  "[bloomnative] message", "[bloomnative] WARNING: message", or with other ranks than rank 0
  shown "[bloomnative rank 3] message". A record logged with `extra=ON_EVERY_RANK` is shown
  whatever its rank (an event only that rank sees, an out-of-memory for one); one logged with
  `extra=BARE` is the message alone (the metric rows);
- in files, with `BLOOMNATIVE_LOG_DIR`, every rank's records at the level, whatever the shown
  ranks, each rank in `<dir>/rank-<N>.log`, with times.

The rank is torch.distributed's once the process has joined a process group, else the RANK
torchrun gives its workers (0 outside torchrun).

The environment, read when logging is set up:

    BLOOMNATIVE_LOG_LEVEL   debug, info (the default), warning or error
    BLOOMNATIVE_LOG_RANKS   0 (the default), all, or a comma-separated list of ranks: 0,3
    BLOOMNATIVE_LOG_DIR     a folder for per-rank log files (none by default)

Set-up: a program's entry point calls `setup_logging` (the launcher does, and refuses a
malformed variable before any worker starts); otherwise the first record a process logs sets
logging up from the environment (with a warning, and the defaults, if a variable is malformed).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

ROOT = "bloomnative"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
ON_EVERY_RANK = {"every_rank": True}
"""`extra=` of a record shown on the console whatever its rank."""
BARE = {"bare": True}
"""`extra=` of a record printed without the "[bloomnative] " tag."""


class LogSettingError(ValueError):
    """A malformed BLOOMNATIVE_LOG_* variable, named with what would be valid."""


@dataclass(frozen=True)
class LogSettings:
    level: int = logging.INFO
    shown_ranks: frozenset[int] | None = frozenset({0})
    """Ranks whose records reach the console; None: every rank."""
    folder: Path | None = None
    """Where each rank writes rank-<N>.log; None: no files."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> LogSettings:
        level = env.get("BLOOMNATIVE_LOG_LEVEL", "") or "info"
        if level.lower() not in LEVELS:
            raise LogSettingError(
                f"BLOOMNATIVE_LOG_LEVEL = {level!r}: use one of {', '.join(LEVELS)}"
            )
        ranks = env.get("BLOOMNATIVE_LOG_RANKS", "") or "0"
        shown = None if ranks == "all" else _rank_list(ranks)
        folder = env.get("BLOOMNATIVE_LOG_DIR", "")
        return cls(LEVELS[level.lower()], shown, Path(folder) if folder else None)


def _rank_list(text: str) -> frozenset[int]:
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        ranks = frozenset()
    if not ranks or min(ranks) < 0:
        raise LogSettingError(
            f"BLOOMNATIVE_LOG_RANKS = {text!r}: use all, or ranks separated by commas (0,3)"
        )
    return ranks


def current_rank() -> int:
    """This process's rank: torch.distributed's if it has joined a process group (looked up
    without importing torch, which a process that never imported it cannot have done), else
    torchrun's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (pass `__name__`; a module run as `__main__` logs under
    "bloomnative.__main__")."""
    return logging.getLogger(name if name.split(".")[0] == ROOT else f"{ROOT}.{name}")


def setup_logging(
    settings: LogSettings | None = None, *, tag: str = ROOT, all_to_stderr: bool = False
) -> None:
    """Sets this process's logging up, replacing an earlier set-up: `settings` (default: from
    the environment, raising LogSettingError on a malformed variable), console lines tagged
    "[`tag`]", and with `all_to_stderr` every console line on stderr."""
    settings = settings or LogSettings.from_env()
    console = _Console(all_to_stderr)
    console.addFilter(_ShownRanks(settings.shown_ranks))
    console.setFormatter(_ConsoleFormat(tag, with_rank=settings.shown_ranks != {0}))
    handlers: list[logging.Handler] = [console]
    if settings.folder is not None:
        to_file = _RankFile(settings.folder)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(to_file)
    with _SET_UP:
        # A new list: the stand-in's caller may be iterating over the old one.
        replaced, _root.handlers = _root.handlers, handlers
        _root.setLevel(settings.level)
    for handler in replaced:
        handler.close()


class _ShownRanks(logging.Filter):
    def __init__(self, ranks: frozenset[int] | None):
        super().__init__()
        self.ranks = ranks

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            self.ranks is None
            or getattr(record, "every_rank", False)
            or current_rank() in self.ranks
        )


class _ConsoleFormat(logging.Formatter):
    def __init__(self, tag: str, with_rank: bool):
        super().__init__()
        self.tag = tag
        self.with_rank = with_rank

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if getattr(record, "bare", False):
            return message
        tag = f"{self.tag} rank {current_rank()}" if self.with_rank else self.tag
        label = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return f"[{tag}] {label}{message}"


class _Console(logging.StreamHandler):
    """stdout below WARNING, stderr from WARNING up (or stderr for all), looked up per record,
    so that a replaced sys.stdout (pytest's capture, a redirect) is the one written to."""

    def __init__(self, all_to_stderr: bool):
        super().__init__()
        self.all_to_stderr = all_to_stderr

    def emit(self, record: logging.LogRecord) -> None:
        use_stderr = self.all_to_stderr or record.levelno >= logging.WARNING
        self.stream: TextIO = sys.stderr if use_stderr else sys.stdout
        super().emit(record)


class _RankFile(logging.Handler):
    """`<folder>/rank-<N>.log`, opened (appending) at the first record, when the rank is known."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder
        self._file: TextIO | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._file is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                path = self.folder / f"rank-{current_rank()}.log"
                self._file = path.open("a", buffering=1)  # line-buffered: a crash keeps the lines
            self._file.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


class _SetUpOnFirstRecord(logging.Handler):
    """Stands in until logging is set up: the first record sets it up from the environment and
    is then handled as the set-up says."""

    def handle(self, record: logging.LogRecord) -> bool:
        problem = None
        with _SET_UP:
            waiting = self in _root.handlers
        if waiting:
            try:
                setup_logging()
            except LogSettingError as e:
                setup_logging(LogSettings())
                problem = f"{e}; logging with the defaults"
        if record.levelno >= _root.level:
            _root.handle(record)
        if problem:
            _root.warning(problem)
        return True


_SET_UP = threading.RLock()
_root = logging.getLogger(ROOT)
_root.propagate = False  # a program's own root handlers do not print these lines twice
_root.setLevel(logging.DEBUG)  # until set up: every record reaches the stand-in
_root.addHandler(_SetUpOnFirstRecord())

"""Tokenize raw documents into MMIDIDX datasets (the logic behind tools/preprocess_data.py).

Inputs:

* JSON lines (``.jsonl``, ``.json``, ``.ndjson``, optionally ``.gz``): one document per line,
  a JSON object whose ``json_keys`` hold the text. Blank lines are ignored.
* Anything else is plain UTF-8 text (optionally ``.gz``): **each file is one document**.

Each JSON key goes to its own dataset ``<output_prefix>_<key>_document.{bin,idx}`` (Megatron's
naming), one sequence per document, with the EOD token appended when ``append_eod`` is set.

Pairs for multitask fine-tuning (``data.format = "mtf"``): with the keys ``inputs`` and
``targets``, every record becomes sequence ``i`` of both datasets, so the two always hold the
same number; a record with an empty side is a bad line. ``append_eod`` and ``prepend_space``
then apply to the targets only: xP3 was tokenized that way with Megatron-DeepSpeed's tool
(inputs plain; targets with ``--append-eod --prepend-space``). A record may instead hold chat
``messages``, mapped to a pair by ``chat_pairs.pair_from_messages``.

Work is cut into chunks of lines that worker processes tokenize; results are consumed in input
order, so the output is byte-identical for any number of workers. Only a bounded window of
chunks is in flight, so memory stays flat however large the input is.

On a terminal, one progress line is kept up to date: documents, tokens, tokens per second,
the share of the input read and the time left. Nothing is shown when the output is not a
terminal (a log file gets the final summary only).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult
from typing import TextIO

import numpy as np

from bloomnative.data.chat_pairs import pair_from_messages
from bloomnative.data.indexed_builder import IndexedDatasetBuilder
from bloomnative.data.indexed_format import idx_path, optimal_token_dtype
from bloomnative.data.pair_dataset import PAIR_SIDES
from bloomnative.data.tokenizer import load_tokenizer

_JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")
_CHUNK_RECORDS = 256
_CHUNK_BYTES = 1 << 20
# How often a wait for the workers asks `stop_requested`.
_STOP_POLL_S = 0.1
_MAX_BAD_LINES_SHOWN = 20


@dataclass(frozen=True)
class PreprocessConfig:
    """What to tokenize and where to write it; mirrors the tool's command-line flags."""

    inputs: tuple[str, ...]
    tokenizer: str
    output_prefix: str
    json_keys: tuple[str, ...] = ("text",)
    workers: int = 1
    append_eod: bool = False
    """Append the EOD token to every non-empty text (for pairs: to every target)."""
    prepend_space: bool = False
    """Tokenize " " + text (for pairs: for every target), as Megatron-DeepSpeed's
    --prepend-space did for xP3's targets, which follow their inputs without a space."""
    eod_token: str | None = None
    skip_bad_lines: bool = False
    log_interval: float = 0.5
    """Seconds between updates of the progress line (shown on a terminal only)."""


@dataclass
class PreprocessSummary:
    """Counts of one run."""

    documents: int = 0
    tokens: int = 0
    empty_documents: int = 0
    bad_lines: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)

    def describe(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens "
            f"({self.empty_documents:,} empty, {self.bad_lines:,} bad lines skipped) "
            f"from {self.input_bytes / 1e6:,.1f} MB in {self.seconds:.1f} s "
            f"({rate:,.0f} tokens/s) -> {', '.join(self.outputs)}"
        )


class BadLineError(ValueError):
    """An input line that cannot be used (invalid JSON or UTF-8, missing or non-text key)."""


class PreprocessStopped(Exception):
    """`preprocess`'s `stop_requested` asked it to stop: its workers ended, nothing written."""


def writes_pairs(json_keys: tuple[str, ...]) -> bool:
    """Whether these keys make pair datasets: exactly ``inputs`` and ``targets``."""
    return sorted(json_keys) == sorted(PAIR_SIDES)


def output_prefix_for(output_prefix: str, json_key: str) -> str:
    """Megatron's output name for one JSON key: ``<output_prefix>_<key>_document``."""
    return f"{output_prefix}_{json_key}_document"


def preprocess(
    config: PreprocessConfig,
    log: Callable[[str], None] | None = None,
    progress_stream: TextIO | None = None,
    stop_requested: Callable[[], bool] | None = None,
) -> PreprocessSummary:
    """Tokenize ``config.inputs`` into one MMIDIDX dataset per JSON key.

    Args:
        config: inputs, tokenizer, outputs and options.
        log: receives bad-line messages; by default they go to stderr.
        progress_stream: where the progress line goes (default stderr), only if it is a
            terminal.
        stop_requested: asked once per chunk of input and every 0.1 s while waiting for the
            workers; once it returns True, the run stops (a signal seen at these points, not
            raised from a handler at any point: that could land inside multiprocessing's or
            logging's own code and be lost there, leaving the pool running).

    Raises:
        BadLineError: a bad line without ``skip_bad_lines``; nothing is written in that case.
        PreprocessStopped: ``stop_requested`` returned True; the worker pool has ended and
            nothing is written.
    """
    if config.workers < 1:
        raise ValueError(f"workers must be at least 1, got {config.workers}")
    if not config.json_keys:
        raise ValueError("json_keys is empty; give at least one key, e.g. text")
    for path in config.inputs:
        if os.path.isdir(path):
            raise ValueError(f"input {path!r} is a folder; give the files in it")
        if not os.path.exists(path):
            raise FileNotFoundError(f"input file {path!r} does not exist")
    pairs = writes_pairs(config.json_keys)
    if pairs:
        plain = [path for path in config.inputs if not is_json_lines(path)]
        if plain:
            raise ValueError(
                f"{plain[0]} is read as plain text (one document), but pairs (--json-keys "
                "inputs targets) come from JSON lines: .jsonl / .json / .ndjson (optionally .gz)"
            )
    # A named pipe's size is known only once it is read: then the progress shows no share.
    sizes = [os.path.getsize(path) for path in config.inputs if os.path.isfile(path)]
    total_bytes = sum(sizes) if len(sizes) == len(config.inputs) else None
    progress = _Progress(progress_stream or sys.stderr, config.log_interval, total_bytes)
    log = progress.interrupting(log or _print_to_stderr)
    tokenizer = load_tokenizer(config.tokenizer, config.eod_token)  # fail early, in this process
    dtype = optimal_token_dtype(tokenizer.vocab_size)
    # Pairs take the EOD and the space on their targets only, as xP3's tokenization did.
    decorated = ("targets",) if pairs else tuple(config.json_keys)
    encoder_args = _EncoderArgs(
        tokenizer_path=config.tokenizer,
        eod_token=config.eod_token,
        json_keys=tuple(config.json_keys),
        append_eod=tuple(config.append_eod and key in decorated for key in config.json_keys),
        prepend_space=tuple(config.prepend_space and key in decorated for key in config.json_keys),
        pairs=pairs,
        dtype=dtype.str,
    )
    summary = PreprocessSummary()
    builders: list[IndexedDatasetBuilder] = []
    encoded = _encode_in_order(
        _chunks(_read_records(config.inputs)),
        encoder_args,
        config.workers,
        stop_requested or (lambda: False),
    )
    try:
        for key in config.json_keys:
            prefix = output_prefix_for(config.output_prefix, key)
            builders.append(IndexedDatasetBuilder(prefix, dtype=dtype))
        with contextlib.closing(encoded):  # stops the worker pool on an error
            for results in encoded:
                _consume(results, builders, config, summary, log)
                progress.maybe_show(summary, results[-1].position)
        progress.finish(summary)
    except BaseException:
        progress.finish(summary)
        for builder in builders:
            builder.abort()
        raise
    _finalize_together(builders)
    summary.seconds = progress.elapsed()
    summary.outputs = [builder.prefix for builder in builders]
    return summary


def _finalize_together(builders: list[IndexedDatasetBuilder]) -> None:
    """Move every dataset into place. The old indexes of all of them go first: an interruption
    between two datasets' renames leaves a missing index, never a new dataset next to an old
    one of another key (for pairs: inputs and targets that do not belong together)."""
    if len(builders) > 1:
        for builder in builders:
            with contextlib.suppress(FileNotFoundError):
                os.remove(idx_path(builder.prefix))
    for builder in builders:
        builder.finalize()


def _consume(
    results: list[_Encoded],
    builders: list[IndexedDatasetBuilder],
    config: PreprocessConfig,
    summary: PreprocessSummary,
    log: Callable[[str], None],
) -> None:
    for result in results:
        summary.input_bytes += result.nbytes
        if result.error is None:
            _add_document(builders, result.tokens, summary)
            continue
        where = f"{config.inputs[result.input_index]}:{result.line}"
        if not config.skip_bad_lines:
            raise BadLineError(
                f"{where}: {result.error}; fix the line or pass --skip-bad-lines "
                "to skip such lines (nothing was written)"
            )
        summary.bad_lines += 1
        if summary.bad_lines <= _MAX_BAD_LINES_SHOWN:
            log(f"[preprocess] skipping {where}: {result.error}")


def _add_document(
    builders: list[IndexedDatasetBuilder], tokens: list[np.ndarray], summary: PreprocessSummary
) -> None:
    if all(len(t) == 0 for t in tokens):
        summary.empty_documents += 1
    for builder, key_tokens in zip(builders, tokens, strict=True):
        # Like Megatron, an empty text ends a document that has no sequence.
        if len(key_tokens):
            builder.add_item(key_tokens)
        builder.end_document()
        summary.tokens += len(key_tokens)
    summary.documents += 1


# -- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    input_index: int
    line: int  # 1-based line of a JSON-lines file; 1 for a plain-text file
    raw: bytes
    is_json: bool
    position: int  # bytes of the input files (as stored, compressed or not) read so far


def is_json_lines(path: str) -> bool:
    """Whether ``path`` is read as JSON lines (by extension, ignoring a trailing ``.gz``)."""
    name = path[:-3] if path.endswith(".gz") else path
    return name.endswith(_JSON_LINES_SUFFIXES)


def _read_records(paths: Iterable[str]) -> Iterator[_Record]:
    before = 0  # size of the files already read
    for index, path in enumerate(paths):
        with open(path, "rb") as raw:
            # The position is measured on the stored file, so a .gz input has one too (a pipe
            # has none: its progress shows no share).
            where = raw.tell if raw.seekable() else lambda: 0
            stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            if not is_json_lines(path):
                text = stream.read()
                yield _Record(index, 1, text, is_json=False, position=before + where())
            else:
                for line_number, line in enumerate(stream, start=1):
                    if line.strip():
                        yield _Record(index, line_number, line, True, before + where())
        before += os.path.getsize(path)


def _chunks(records: Iterator[_Record]) -> Iterator[list[_Record]]:
    chunk: list[_Record] = []
    size = 0
    for record in records:
        chunk.append(record)
        size += len(record.raw)
        if len(chunk) >= _CHUNK_RECORDS or size >= _CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# -- encoding (runs in the worker processes) ------------------------------------------------------


@dataclass(frozen=True)
class _EncoderArgs:
    tokenizer_path: str
    eod_token: str | None
    json_keys: tuple[str, ...]
    append_eod: tuple[bool, ...]  # per key
    prepend_space: tuple[bool, ...]  # per key
    pairs: bool
    dtype: str


@dataclass(frozen=True)
class _Encoded:
    input_index: int
    line: int
    nbytes: int
    position: int
    tokens: list[np.ndarray]  # one array per JSON key; empty when error is set
    error: str | None = None


class _Encoder:
    """Turns a chunk of raw records into token arrays, or an error message per bad record."""

    def __init__(self, args: _EncoderArgs) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.tokenizer_path, args.eod_token)
        self.dtype = np.dtype(args.dtype)

    def __call__(self, chunk: list[_Record]) -> list[_Encoded]:
        return [self._encode(record) for record in chunk]

    def _encode(self, record: _Record) -> _Encoded:
        try:
            texts = self._texts(record)
        except BadLineError as error:
            return self._bad(record, str(error))
        tokens = []
        for key, text, eod, space in zip(
            self.args.json_keys, texts, self.args.append_eod, self.args.prepend_space, strict=True
        ):
            ids = self.tokenizer.encode(" " + text if space else text)
            if self.args.pairs and not (text and ids):
                return self._bad(record, f"key {key!r} is empty; a pair needs input and target")
            if ids and eod:
                ids.append(self.tokenizer.eod_id)
            tokens.append(np.asarray(ids, dtype=self.dtype))
        return _Encoded(record.input_index, record.line, len(record.raw), record.position, tokens)

    def _bad(self, record: _Record, error: str) -> _Encoded:
        nbytes = len(record.raw)
        return _Encoded(record.input_index, record.line, nbytes, record.position, [], error)

    def _texts(self, record: _Record) -> list[str]:
        try:
            text = record.raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadLineError(f"not valid UTF-8 at byte {error.start}") from None
        if not record.is_json:
            return [text] * len(self.args.json_keys)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            raise BadLineError(f"invalid JSON: {error.msg} at column {error.colno}") from None
        if not isinstance(obj, dict):
            raise BadLineError(f"expected a JSON object, got {type(obj).__name__}")
        if self.args.pairs and "messages" in obj and not any(k in obj for k in PAIR_SIDES):
            try:
                pair = dict(zip(PAIR_SIDES, pair_from_messages(obj["messages"]), strict=True))
            except ValueError as error:
                raise BadLineError(str(error)) from None
            return [pair[key] for key in self.args.json_keys]
        texts = []
        for key in self.args.json_keys:
            if key not in obj:
                chat = " (or 'messages', a chat)" if self.args.pairs else ""
                raise BadLineError(f"missing key {key!r}{chat} (keys present: {sorted(obj)[:10]})")
            if not isinstance(obj[key], str):
                raise BadLineError(
                    f"key {key!r} holds a {type(obj[key]).__name__}, expected a string"
                )
            texts.append(obj[key])
        return texts


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(args: _EncoderArgs) -> None:
    global _WORKER_ENCODER
    # The pool ends its workers with SIGTERM: they take it as its default, whatever handler or
    # mask (preprocess_data.py holds SIGTERM pending) the parent had.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # One thread per worker: the Rust tokenizer would otherwise spread each encode over every
    # core, and N workers would fight over the cores N times over.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = _Encoder(args)


def _encode_in_worker(chunk: list[_Record]) -> list[_Encoded]:
    assert _WORKER_ENCODER is not None, "worker used before _init_worker"
    return _WORKER_ENCODER(chunk)


def _encode_in_order(
    chunks: Iterator[list[_Record]],
    args: _EncoderArgs,
    workers: int,
    stop_requested: Callable[[], bool],
) -> Generator[list[_Encoded], None, None]:
    """Encoded chunks in input order; at most ``4 * workers`` chunks in flight. Even one
    worker is a separate process, so ``workers`` is the number of cores used. Raises
    PreprocessStopped (the pool then ends) once `stop_requested` returns True."""
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(args,)) as pool:
        # Pool.imap would read the whole input ahead; a window of async calls bounds memory.
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 4 * workers:
                yield _result(pending.popleft(), stop_requested)
        while pending:
            yield _result(pending.popleft(), stop_requested)


def _result(pending: AsyncResult, stop_requested: Callable[[], bool]) -> list[_Encoded]:
    while not stop_requested():
        pending.wait(_STOP_POLL_S)
        if pending.ready():
            return pending.get()
    raise PreprocessStopped("stopped on request; nothing was written")


# -- progress ----------------------------------------------------------------------------------


class _Progress:
    """One progress line, rewritten in place, when `stream` is a terminal; nothing otherwise."""

    def __init__(self, stream: TextIO, interval: float, total_bytes: int | None) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.interval = interval
        self.total_bytes = total_bytes
        self.start = time.perf_counter()
        self.last_shown: float | None = None
        self.position = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def maybe_show(self, summary: PreprocessSummary, position: int) -> None:
        self.position = position
        now = time.perf_counter()
        if self.enabled and (self.last_shown is None or now - self.last_shown >= self.interval):
            self.last_shown = now
            self.stream.write("\r" + self.describe(summary, now - self.start) + "\x1b[K")
            self.stream.flush()

    def describe(self, summary: PreprocessSummary, seconds: float) -> str:
        rate = summary.tokens / seconds if seconds > 0 else 0.0
        line = (
            f"[preprocess] {summary.documents:,} docs, {summary.tokens:,} tokens | "
            f"{rate:,.0f} tokens/s"
        )
        if self.total_bytes is None:  # a pipe among the inputs
            return line
        done = self.position / self.total_bytes if self.total_bytes else 1.0
        eta = seconds * (1 - done) / done if done > 0 else float("inf")
        return f"{line} | {100 * done:.1f}% | ETA {_duration(eta)}"

    def finish(self, summary: PreprocessSummary) -> None:
        """Shows the final state and ends the line, so what follows starts on a new one."""
        if self.enabled and self.last_shown is not None:
            self.stream.write("\r" + self.describe(summary, self.elapsed()) + "\x1b[K\n")
            self.stream.flush()
            self.last_shown = None

    def interrupting(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, but first clearing the progress line so a message does not land inside it."""

        def log_on_a_clean_line(message: str) -> None:
            if self.enabled and self.last_shown is not None:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            log(message)

        return log_on_a_clean_line


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

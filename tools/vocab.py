#!/usr/bin/env python
"""Trim or extend the vocabulary of a Hugging Face BLOOM folder (docs/continuing.md).

  trim    keep the tokens a corpus uses at least --keep-min-count times (and every byte-level and
          special token, so any text still encodes); the embedding and tied head keep their rows
  extend  add the tokens of a file, each new row the mean of the rows of the pieces the old
          tokenizer cut it into
  remap-data  an indexed dataset tokenized with the original tokenizer, in a trim's ids

The output folder loads in transformers and as checkpoint.initial_hf; vocab_mapping.json in it
gives the original row of each new row. The logic lives in bloomnative.interop.vocabulary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cli_args import ArgumentParser, whole_number

from bloomnative.data import IndexedDatasetError
from bloomnative.interop import CheckpointFormatError
from bloomnative.interop.vocabulary import (
    PAD_TO_MULTIPLE,
    VocabularyError,
    extend_hf_folder,
    is_dataset_prefix,
    read_new_tokens,
    remap_indexed_dataset,
    trim_hf_folder,
)

CORPUS_HELP = """\
corpus files, as tools/preprocess_data.py reads them: .jsonl / .json / .ndjson (optionally .gz)
hold one JSON object per line with the text under --json-key; any other file is one document.
Or indexed dataset prefixes (no .bin/.idx), tokenized with the --model's tokenizer: counted as
they are"""
PAD_HELP = f"""\
pad the vocabulary to a multiple of this (default {PAD_TO_MULTIPLE}, Megatron's: every tensor
parallel degree dividing it divides the vocabulary); the padding rows are no token"""


def log(message: str) -> None:
    print(f"[vocab] {message}", file=sys.stderr, flush=True)


def existing_file(text: str) -> Path:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return Path(text)


def corpus_entry(text: str) -> Path:
    """A corpus file, or the prefix of an indexed dataset."""
    if not (Path(text).is_file() or is_dataset_prefix(text)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a file nor a dataset prefix (with .bin and .idx)"
        )
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vocab.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    trim = commands.add_parser("trim", help="keep the tokens a corpus uses")
    extend = commands.add_parser("extend", help="add tokens, each row the mean of its pieces'")
    for command in (trim, extend):
        command.add_argument("--model", required=True, type=Path, help="Hugging Face BLOOM folder")
        command.add_argument("--out", required=True, type=Path, help="folder to write")
        command.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
        command.add_argument(
            "--pad-to-multiple", type=whole_number(1), default=PAD_TO_MULTIPLE, help=PAD_HELP
        )
    trim.add_argument(
        "--corpus", required=True, nargs="+", type=corpus_entry, metavar="FILE", help=CORPUS_HELP
    )
    trim.add_argument("--keep-min-count", required=True, type=whole_number(1), metavar="N")
    trim.add_argument("--json-key", default="text", help="the text's key in JSON lines")
    extend.add_argument(
        "--tokens", required=True, type=existing_file, help="one token per line, as typed"
    )
    remap = commands.add_parser("remap-data", help="an indexed dataset in a trim's ids")
    remap.add_argument("--model", required=True, type=Path, help="the trim's output folder")
    remap.add_argument(
        "--original", required=True, type=Path, help="the folder the trim was made from"
    )
    remap.add_argument("--data", required=True, help="dataset prefix (no .bin/.idx)")
    remap.add_argument("--out-prefix", required=True, help="writes <out-prefix>.bin/.idx")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 2 a bad argument or input (one line naming it)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        if args.command == "trim":
            summary = trim_hf_folder(
                args.model,
                args.corpus,
                args.keep_min_count,
                args.out,
                args.pad_to_multiple,
                args.json_key,
                args.overwrite,
            )
            log(
                f"vocab_size {summary.original_vocab_size} -> {summary.vocab_size}: "
                f"{summary.by_count} tokens used >= {args.keep_min_count} times, "
                f"{summary.for_encoding} byte-level/special, {summary.for_reachability} kept "
                f"for their merges, {summary.padding} padding rows"
            )
        elif args.command == "extend":
            tokens = read_new_tokens(args.tokens)
            extend_hf_folder(args.model, tokens, args.out, args.pad_to_multiple, args.overwrite)
            log(f"added {len(tokens)} tokens")
        else:
            again = remap_indexed_dataset(args.data, args.model, args.original, args.out_prefix)
            log(f"{again} sequences held dropped tokens and were encoded again")
    except (VocabularyError, CheckpointFormatError, IndexedDatasetError, OSError) as e:
        log(f"error: {e}")
        return 2
    written = args.out_prefix if args.command == "remap-data" else args.out
    log(f"wrote {written} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

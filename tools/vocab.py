#!/usr/bin/env python
"""Trim or extend the vocabulary of a Hugging Face BLOOM folder or of a training checkpoint
(docs/continuing.md).

  trim    keep the tokens a corpus uses at least --keep-min-count times (and every byte-level and
          special token, so any text still encodes); the embedding and tied head keep their rows
  extend  add the tokens of a file, each new row the mean of the rows of the pieces the old
          tokenizer cut it into
  remap-data  an indexed dataset tokenized with the original tokenizer, in a trim's ids

From a Hugging Face folder, the output folder loads in transformers and as
checkpoint.initial_hf; vocab_mapping.json in it gives the original row of each new row. From a
training checkpoint (<dump>/checkpoints/step-N, with --tokenizer the run's tokenizer.json), --out
is a dump folder: <out>/checkpoints/step-N holds the weights and AdamW's moments with the new
rows (an added row's moments zero) and vocab_mapping.json, <out>/tokenizer the new tokenizer,
and ./run_train.sh --job.dump_folder=<out> --model.vocab_size=<new size> resumes from it. The
logic lives in bloomnative.interop.vocabulary and vocabulary_checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

from cli_args import ArgumentParser, whole_number

from bloomnative.data import IndexedDatasetError
from bloomnative.interop import CheckpointFormatError
from bloomnative.interop.vocabulary import (
    MAPPING_FILE,
    PAD_TO_MULTIPLE,
    VocabularyError,
    extend_hf_folder,
    is_dataset_prefix,
    read_new_tokens,
    remap_indexed_dataset,
    trim_hf_folder,
)
from bloomnative.interop.vocabulary_checkpoint import (
    TOKENIZER_DIR,
    extend_checkpoint,
    is_checkpoint,
    trim_checkpoint,
)

CORPUS_HELP = """\
corpus files, as tools/preprocess_data.py reads them: .jsonl / .json / .ndjson (optionally .gz)
hold one JSON object per line with the text under --json-key; any other file is one document.
Or indexed dataset prefixes (no .bin/.idx), tokenized with the --model's tokenizer: counted as
they are"""
MODEL_HELP = """\
a Hugging Face BLOOM folder, or a training checkpoint (<dump>/checkpoints/step-N; give
--tokenizer)"""
OUT_HELP = """\
the folder to write; for a checkpoint, a dump folder: <out>/checkpoints/step-N and
<out>/tokenizer"""
TOKENIZER_HELP = """\
with a checkpoint as --model: the tokenizer.json its run trained with (data.tokenizer), or a
folder holding it"""
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


def check_tokenizer_argument(args: argparse.Namespace) -> None:
    """--tokenizer is given exactly when --model is a training checkpoint."""
    checkpoint = is_checkpoint(args.model)
    if checkpoint and not args.tokenizer:
        raise VocabularyError(
            f"--model {args.model} is a training checkpoint: give --tokenizer, the "
            "tokenizer.json its run trained with (its data.tokenizer)"
        )
    if args.tokenizer and not checkpoint:
        raise VocabularyError(
            f"--tokenizer is for a training checkpoint as --model, and {args.model} is not one "
            "(a Hugging Face folder's tokenizer.json is its own)"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vocab.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    trim = commands.add_parser("trim", help="keep the tokens a corpus uses")
    extend = commands.add_parser("extend", help="add tokens, each row the mean of its pieces'")
    for command in (trim, extend):
        command.add_argument("--model", required=True, type=Path, help=MODEL_HELP)
        command.add_argument("--tokenizer", type=Path, help=TOKENIZER_HELP)
        command.add_argument("--out", required=True, type=Path, help=OUT_HELP)
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
    remap.add_argument(
        "--model",
        required=True,
        type=Path,
        help="the trim's output folder (of a checkpoint's trim: <out>/tokenizer)",
    )
    remap.add_argument(
        "--original",
        required=True,
        type=Path,
        help="the folder the trim was made from, or the original tokenizer.json",
    )
    remap.add_argument("--data", required=True, help="dataset prefix (no .bin/.idx)")
    remap.add_argument("--out-prefix", required=True, help="writes <out-prefix>.bin/.idx")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 2 a bad argument or input (one line naming it)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        if args.command in ("trim", "extend"):
            check_tokenizer_argument(args)
        if args.command == "trim":
            trim = (
                partial(trim_checkpoint, args.model, args.tokenizer)
                if args.tokenizer
                else partial(trim_hf_folder, args.model)
            )
            summary = trim(
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
            extend = (
                partial(extend_checkpoint, args.model, args.tokenizer)
                if args.tokenizer
                else partial(extend_hf_folder, args.model)
            )
            extend(tokens, args.out, args.pad_to_multiple, args.overwrite)
            log(f"added {len(tokens)} tokens")
        else:
            again = remap_indexed_dataset(args.data, args.model, args.original, args.out_prefix)
            log(f"{again} sequences held dropped tokens and were encoded again")
    except (VocabularyError, CheckpointFormatError, IndexedDatasetError, OSError) as e:
        log(f"error: {e}")
        return 2
    written = args.out_prefix if args.command == "remap-data" else args.out
    log(f"wrote {written} in {time.perf_counter() - start:.1f} s")
    if args.command != "remap-data" and args.tokenizer:
        tokenizer = args.out / TOKENIZER_DIR
        size = len(json.loads((tokenizer / MAPPING_FILE).read_text())["old_id"])
        log(
            f"resume with ./run_train.sh --job.dump_folder={args.out} --model.vocab_size={size} "
            f"--data.tokenizer={tokenizer / 'tokenizer.json'} and the data in the new ids"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

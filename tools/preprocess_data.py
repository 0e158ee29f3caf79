#!/usr/bin/env python3
"""Tokenize documents into Megatron MMIDIDX datasets (<prefix>_<key>_document.{bin,idx}).

    python tools/preprocess_data.py --input corpus.jsonl.gz --json-keys text \\
        --tokenizer tokenizer.json --output-prefix data/corpus --workers 8 --append-eod

(input, target) pairs for data.format = "mtf" (xP3's conventions: EOD and space on targets):

    python tools/preprocess_data.py --input pairs.jsonl --json-keys inputs targets \\
        --tokenizer tokenizer.json --output-prefix data/xp3 --append-eod --prepend-space

The logic lives in bloomnative.data.preprocess; this is its command line.
"""

from __future__ import annotations

import argparse
import sys

from bloomnative.data.preprocess import (
    BadLineError,
    PreprocessConfig,
    preprocess,
)

INPUT_HELP = """\
input files. By extension: .jsonl / .json / .ndjson (optionally .gz) are JSON lines, one
document per line, a JSON object holding --json-keys; blank lines are ignored. Any other file
(e.g. .txt, .txt.gz) is plain UTF-8 text and the WHOLE FILE IS ONE DOCUMENT (split large text
files into one file per document, or convert them to JSON lines)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE", help=INPUT_HELP)
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="JSON keys to tokenize, one output dataset each (default: text). Exactly "
        '"inputs targets" writes pairs for data.format = "mtf": both datasets get one sequence '
        "per record (a record with an empty side is a bad line), and a record may hold chat "
        '"messages" instead (docs/data.md: the last message, the assistant\'s, is the target)',
    )
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizers tokenizer.json")
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="writes <output-prefix>_<key>_document.bin/.idx for each key",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="tokenizer processes (output does not depend on it)"
    )
    parser.add_argument(
        "--append-eod",
        action="store_true",
        help="append the EOD token to every document (pairs: to every target)",
    )
    parser.add_argument(
        "--prepend-space",
        action="store_true",
        help='tokenize " " + text (pairs: for every target, as xP3\'s targets were tokenized)',
    )
    parser.add_argument(
        "--eod-token",
        default=None,
        help='EOD token (default: the first of "<|endoftext|>", "</s>", "<eos>", '
        '"<|end_of_text|>" in the vocabulary)',
    )
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip lines with invalid JSON / UTF-8 or a missing key (counted in the summary); "
        "without it the first bad line stops the run and nothing is written",
    )
    parser.add_argument(
        "--log-interval",
        type=float,
        default=0.5,
        help="seconds between updates of the progress line (documents, tokens/s, ETA), which is "
        "shown only when stderr is a terminal",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = PreprocessConfig(
        inputs=tuple(args.input),
        tokenizer=args.tokenizer,
        output_prefix=args.output_prefix,
        json_keys=tuple(args.json_keys),
        workers=args.workers,
        append_eod=args.append_eod,
        prepend_space=args.prepend_space,
        eod_token=args.eod_token,
        skip_bad_lines=args.skip_bad_lines,
        log_interval=args.log_interval,
    )
    try:
        summary = preprocess(config)
    except (BadLineError, FileNotFoundError, ValueError) as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 1
    print(f"[preprocess] done: {summary.describe()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

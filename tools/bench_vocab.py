#!/usr/bin/env python
"""Memory and step time of one BLOOM shape with its full vocabulary and a trimmed one, side by
side in one run (docs/continuing.md, "The vocabulary"; the figures in docs/benchmarks.md).

    PYTHONPATH=src python tools/bench_vocab.py [--layers 24 --hidden 1024 --heads 16
        --vocab 250880] (--trimmed-vocab N | --tokenizer TOKENIZER --corpus FILE...
        [--keep-min-count N]) [--seq 256] [--steps 3] [--dtype bf16] [--work DIR] [--json OUT]

The defaults are BLOOM-560m's shape. The trimmed size is given (--trimmed-vocab), or the one
tools/vocab.py trim gives: the rows an embedding of --vocab rows keeps for --corpus with the
tokenizer --tokenizer (BLOOM's tokenizer.json for BLOOM's figures), padded to a multiple of 128.
Each size is trained as tools/bench_finetune.py's full fine-tune (its random base written as a
Hugging Face folder, the real trainer in a process of its own, micro and global batch 1, a
corpus of random ids below the trimmed size, so both runs read the same tokens). Reported per
size: the parameter count, the planner's allocated peak and device need for the run
(bloomnative.planner, on CPU), the median step time after the first, the trainer's peak
resident set while training (`mem_peak_gib`) and the process's peak resident set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench_finetune import environment, run_mode, summarize, trainer_argv, write_base, write_corpus
from cli_args import ArgumentParser, whole_number

from bloomnative import planner
from bloomnative.config import parse_args as parse_config
from bloomnative.interop.vocabulary import VocabularyError, plan_trim, tokenizer_file
from bloomnative.train.resolved import resolve_run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=whole_number(1), default=24)
    parser.add_argument("--hidden", type=whole_number(1), default=1024)
    parser.add_argument("--heads", type=whole_number(1), default=16)
    parser.add_argument("--vocab", type=whole_number(1), default=250880, help="the full size")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--trimmed-vocab", type=whole_number(1), help="the trimmed size")
    size.add_argument("--tokenizer", type=Path, help="trim with this tokenizer.json (or folder)")
    parser.add_argument("--corpus", nargs="+", type=Path, help="with --tokenizer: what to keep")
    parser.add_argument("--keep-min-count", type=whole_number(1), default=1)
    parser.add_argument("--seq", type=whole_number(1), default=256, help="sequence length")
    parser.add_argument("--steps", type=whole_number(2), default=3, help="steps, the first untimed")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--work", help="folder for the bases, the corpus and the runs (temporary)")
    parser.add_argument("--json", dest="json_path", help="write the report here ('-': stdout)")
    args = parser.parse_args(argv)
    if args.tokenizer and not args.corpus:
        parser.error("--tokenizer needs --corpus: the files whose tokens the trim keeps")
    return args


def trimmed_size(args: argparse.Namespace) -> int:
    """--trimmed-vocab, or the rows tools/vocab.py trim keeps of --vocab for --corpus."""
    if args.trimmed_vocab:
        return args.trimmed_vocab
    plan, _ = plan_trim(
        tokenizer_file(args.tokenizer), args.vocab, args.corpus, args.keep_min_count
    )
    return len(plan.old_rows)


def planned(argv: list[str]) -> dict:
    """The planner's estimate of the trainer run `argv` on one CPU process."""
    run = resolve_run(parse_config(argv), 1, "cpu")
    estimate = planner.estimate(
        run.model_args,
        run.planner_layout(),
        run.planner_workload(),
        planner.Overhead.for_device("cpu"),
        "cpu",
    )
    return {
        "params": run.model_args.num_params(),
        "planned_allocated_gib": estimate.worst.allocated_peak / planner.GiB,
        "planned_device_gib": estimate.worst.device_bytes / planner.GiB,
    }


def format_table(runs: list[dict]) -> str:
    lines = [
        f"{'vocab':>8} {'params':>12} {'planned peak':>13} {'median step':>12} "
        f"{'mem_peak_gib':>13} {'process peak':>13}"
    ]
    for r in runs:
        lines.append(
            f"{r['vocab']:>8} {r['params']:>12,} {r['planned_allocated_gib']:>9.2f} GiB "
            f"{r['median_step_s']:>10.2f} s {r['mem_peak_gib']:>9.2f} GiB "
            f"{r['process_peak_rss_gib']:>9.2f} GiB"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trimmed = trimmed_size(args)
    except (VocabularyError, OSError) as e:
        print(f"bench_vocab: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        corpus = write_corpus(work / "corpus", trimmed, args.seq)
        runs = []
        for vocab in (args.vocab, trimmed):
            sized = argparse.Namespace(**{**vars(args), "vocab": vocab})
            base = work / f"base_{vocab}"
            write_base(sized, base)
            dump = work / f"run_{vocab}"
            argv_run = trainer_argv(sized, "full", base, corpus, dump)
            peak = run_mode(["-m", "bloomnative.train.main", *argv_run], work / f"{vocab}.log")
            runs.append(
                {"vocab": vocab, **planned(argv_run), **summarize("full", dump, args.seq, peak)}
            )
    print(format_table(runs))
    if args.json_path:
        report = {"environment": environment(), "args": vars(args) | {"trimmed": trimmed}}
        text = json.dumps({**report, "runs": runs}, indent=2, default=str)
        if args.json_path == "-":
            print(text)
        else:
            Path(args.json_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

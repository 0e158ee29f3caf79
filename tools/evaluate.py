#!/usr/bin/env python3
"""Score a checkpoint on lm-evaluation-harness tasks; prints the harness's table and writes its
results JSON under the dump folder's eval/ (eval/step-N.json).

    python tools/evaluate.py --checkpoint outputs/debug --tasks lambada_openai,piqa --limit 100

--checkpoint is what tools/generate.py takes: a dump folder (its newest checkpoint), a
checkpoints/step-N folder saved under any parallel layout, or a Hugging Face folder (results in
its eval/results.json). --tasks names tasks, groups or tags of the harness's registry or of
--include-path, a folder of task YAMLs (local tasks reading JSONL files: docs/evaluation.md).
--log-samples also writes each item's requests and answers to eval/step-N.samples.jsonl. The
model is loaded whole into this process (no torchrun): bloomnative.evaluation.BloomnativeLM.
Needs the eval extra (pip install 'bloomnative[eval]'). Tasks on the Hugging Face Hub need the
network; set HF_DATASETS_OFFLINE=1 where there is none.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cli_args import ArgumentParser, whole_number

# Run from a checkout without installing: the package lives in ../src.
from bloomnative.evaluation.harness_model import DTYPES, BloomnativeLM
from bloomnative.evaluation.results_files import results_path, write_results
from bloomnative.evaluation.task_names import TaskError, task_manager
from bloomnative.interop import CheckpointFormatError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="evaluate.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="dump folder, step-N folder or HF folder"
    )
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument("--include-path", type=Path, help="a folder of task YAMLs")
    parser.add_argument(
        "--limit", type=whole_number(1), help="score the first N items of each task"
    )
    parser.add_argument(
        "--num-fewshot", type=whole_number(0), help="examples in each prompt (task default)"
    )
    parser.add_argument("--log-samples", action="store_true", help="also write each item's record")
    parser.add_argument(
        "--batch-size", type=whole_number(1), default=8, help="sequences per forward"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="auto", help='"auto" (CUDA if present), "cpu", "cuda"')
    parser.add_argument(
        "--output", type=Path, help="results file (default: <dump>/eval/step-N.json)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 scored and wrote the results, 2 a bad argument, task or checkpoint (one
    line)."""
    import lm_eval
    from lm_eval.utils import make_table

    args = parse_args(argv)
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    started = time.perf_counter()
    try:
        manager = task_manager(names, args.include_path)
        output = args.output or results_path(args.checkpoint)
        model = BloomnativeLM(
            args.checkpoint, dtype=args.dtype, batch_size=args.batch_size, device=args.device
        )
    except (TaskError, CheckpointFormatError, OSError, ValueError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    limit = f", first {args.limit} items each" if args.limit else ""
    print(
        f"evaluate.py: {args.checkpoint} on {model.device} ({args.dtype}): "
        f"{', '.join(names)}{limit}",
        file=sys.stderr,
        flush=True,
    )
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=names,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        log_samples=args.log_samples,
        task_manager=manager,
    )
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    written = write_results(results, output)
    print(
        f"evaluate.py: wrote {', '.join(map(str, written))} "
        f"in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

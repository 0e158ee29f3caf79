#!/usr/bin/env python3
"""Time an evaluation with the bloomnative harness model beside the harness's own hf model on
the same checkpoint exported to Hugging Face (tools/convert_hf.py to-hf), on the same tasks:

    python tools/bench_eval.py --checkpoint outputs/debug --hf exports/debug \\
        --tasks pydocs_choice,pydocs_text,pydocs_qa --include-path examples/evaluation

Prints the one-off costs of a process (lm_eval's task index, loading each model), then each
model's time per task (the best of --repeat runs, the models taking turns; the first run also
builds the datasets' caches), and whether the two models' scores agree (to 1e-6 relative).
Exit code 1 when they do not.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from cli_args import ArgumentParser, whole_number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="bench_eval.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, type=Path, help="what evaluate.py takes")
    parser.add_argument("--hf", required=True, type=Path, help="its Hugging Face export")
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument("--include-path", type=Path, help="a folder of task YAMLs")
    parser.add_argument("--limit", type=whole_number(1), help="items per task")
    parser.add_argument("--batch-size", type=whole_number(1), default=8)
    parser.add_argument("--repeat", type=whole_number(1), default=2)
    parser.add_argument("--device", default="cpu", help='"cpu" or "cuda"')
    return parser.parse_args(argv)


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def scores(results: dict, task: str) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in results["results"][task].items()
        if "," in name and "stderr" not in name
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    (lm_eval, HFLM, BloomnativeLM, task_manager), imported = timed(_imports)
    names = args.tasks.split(",")
    manager, indexed = timed(lambda: task_manager(names, args.include_path))
    print(f"import lm_eval and bloomnative.evaluation: {imported:.2f} s")
    print(f"task index (lm_eval's registry + --include-path): {indexed:.2f} s")
    models = {
        "bloomnative": lambda: BloomnativeLM(
            args.checkpoint, batch_size=args.batch_size, device=args.device
        ),
        "hf": lambda: HFLM(
            pretrained=str(args.hf), dtype="float32", batch_size=args.batch_size, device=args.device
        ),
    }
    loaded = {}
    for name, make in models.items():
        loaded[name], seconds = timed(make)
        print(f"{name}: load {seconds:.2f} s")
    found: dict[str, dict[str, dict[str, float]]] = {name: {} for name in models}
    for task in names:
        # The models take turns, so a load on the machine that comes and goes slows both alike.
        best = dict.fromkeys(models, math.inf)
        for _ in range(args.repeat):
            for name, model in loaded.items():
                results, seconds = timed(
                    lambda m=model, t=task: lm_eval.simple_evaluate(
                        model=m, tasks=[t], limit=args.limit, task_manager=manager
                    )
                )
                found[name][task] = scores(results, task)
                best[name] = min(best[name], seconds)
        print(f"{task}: " + ", ".join(f"{name} {s:.2f} s" for name, s in best.items()))
    agree = all(
        math.isclose(value, found["hf"][task][metric], rel_tol=1e-6)
        for task, metrics in found["bloomnative"].items()
        for metric, value in metrics.items()
    )
    print(f"scores agree: {agree}: {found['bloomnative']}")
    return 0 if agree else 1


def _imports():
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from bloomnative.evaluation import BloomnativeLM
    from bloomnative.evaluation.task_names import task_manager

    return lm_eval, HFLM, BloomnativeLM, task_manager


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bloomnative.evaluation.score_checkpoint CHECKPOINT OUTPUT SETTINGS`: the process a
training run's rank 0 starts to score a checkpoint it has just saved (train/downstream.py).
SETTINGS is the run's [downstream] section as JSON; the harness's results JSON goes to OUTPUT.
Exit codes: 0 scored, 2 a task or checkpoint the harness cannot use (one line on stderr)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lm_eval

from bloomnative.evaluation.harness_model import BloomnativeLM
from bloomnative.evaluation.results_files import write_results
from bloomnative.evaluation.task_names import TaskError, task_manager
from bloomnative.interop import CheckpointFormatError


def main(argv: list[str]) -> int:
    checkpoint, output, settings = Path(argv[0]), Path(argv[1]), json.loads(argv[2])
    started = time.perf_counter()
    try:
        manager = task_manager(settings["tasks"], settings["include_path"] or None)
        model = BloomnativeLM(
            checkpoint,
            dtype=settings["dtype"],
            batch_size=settings["batch_size"],
            device=settings["device"],
        )
    except (TaskError, CheckpointFormatError, OSError, ValueError) as e:
        print(f"score_checkpoint: {e}", file=sys.stderr)
        return 2
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=settings["tasks"],
        num_fewshot=settings["num_fewshot"],
        limit=settings["limit"],
        log_samples=False,
        task_manager=manager,
    )
    write_results(results, output)
    print(
        f"score_checkpoint: {checkpoint} in {time.perf_counter() - started:.1f} s", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

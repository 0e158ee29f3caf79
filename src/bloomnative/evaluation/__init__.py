"""Downstream evaluation with lm-evaluation-harness (the optional `eval` extra): `BloomnativeLM`,
the harness model "bloomnative" that scores a checkpoint in one process (`harness_model`),
`python -m bloomnative.evaluation` (the harness's command line with that model registered), the
task-name checks and results files tools/evaluate.py uses (`task_names`, `results_files`), and
the process in which a training run scores its checkpoints (`score_checkpoint`, started by
bloomnative.train.downstream)."""

from bloomnative.evaluation.harness_model import BloomnativeLM

__all__ = ["BloomnativeLM"]

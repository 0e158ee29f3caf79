"""Downstream evaluation with lm-evaluation-harness (the optional `eval` extra): `BloomnativeLM`,
the harness model "bloomnative" that scores a checkpoint in one process (`harness_model`),
`python -m bloomnative.evaluation` (the harness's command line with that model registered), and
what tools/evaluate.py runs (`run`)."""

from bloomnative.evaluation.harness_model import BloomnativeLM

__all__ = ["BloomnativeLM"]

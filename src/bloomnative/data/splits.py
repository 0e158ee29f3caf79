"""Train/valid/test document ranges from a split string such as ``"969,30,1"``.

The rule is Megatron's ``get_train_valid_test_split_``: normalise the weights, round each share
of the document count, then shift the boundaries so the last one lands on the count.
"""

from __future__ import annotations

import math

SPLIT_NAMES = ("train", "valid", "test")


class SplitError(ValueError):
    """A split string, or a split that leaves data a run needs without documents or tokens."""


def parse_split(split: str) -> tuple[float, float, float]:
    """Normalised train/valid/test shares of ``"969,30,1"`` (``/`` also separates; missing
    trailing parts are 0)."""
    text = str(split).strip()
    parts = [p.strip() for p in text.replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3 or any(p == "" for p in parts):
        raise SplitError(
            f"split {split!r} must be up to three comma-separated non-negative numbers "
            '(train,valid,test), e.g. "969,30,1"'
        )
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise SplitError(
            f'split {split!r} has a part that is not a number; expected e.g. "969,30,1"'
        ) from None
    if not all(0 <= w < math.inf for w in weights) or sum(weights) <= 0:
        raise SplitError(f"split {split!r} needs finite non-negative parts with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return (weights[0] / total, weights[1] / total, weights[2] / total)


def split_boundaries(split: str, num_documents: int) -> tuple[int, int, int, int]:
    """Document boundaries ``(0, train_end, valid_end, num_documents)`` of a split string."""
    shares = parse_split(split)
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return (bounds[0], bounds[1], bounds[2], bounds[3])


def fraction_range(start: float, end: float, num_documents: int) -> tuple[int, int]:
    """Documents ``[round(start * n), round(end * n))`` of a BigScience-style range ``0:0.95``."""
    return int(round(start * num_documents)), int(round(end * num_documents))

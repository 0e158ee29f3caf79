"""Parse a data blend: Megatron's weighted prefix list plus BigScience's per-dataset ranges.

Grammar (whitespace-separated tokens; a list of strings is joined first)::

    blend  := PREFIX | (WEIGHT PREFIX)+
    PREFIX := path[:START:END]

* ``WEIGHT`` is a positive number (``0.3``, ``2``, ``1e-3``); weights are normalised to sum 1
  and kept as exact fractions, so ``"0.3 a 0.7 b"`` means exactly 3/10 and 7/10.
* ``path`` is a dataset prefix, the path without ``.bin``/``.idx``.
* ``:START:END`` (both in [0, 1], START < END) keeps only that fraction of the dataset's
  documents, as BigScience's ``train-weighted-split-paths`` did (``0:0.95`` / ``0.95:1``);
  the train/valid/test split is then taken inside that range.

Examples: ``"data/en_text_document"``, ``["0.3", "data/a", "0.7", "data/b"]``,
``"0.5 data/a:0:0.9 0.5 data/b"``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

_RANGE = re.compile(r"^(?P<path>.+):(?P<start>\d*\.?\d+):(?P<end>\d*\.?\d+)$")


@dataclass(frozen=True)
class BlendEntry:
    """One dataset of a blend."""

    weight: Fraction
    """Normalised weight (the entries of a blend sum to exactly 1)."""
    prefix: str
    """Dataset prefix (path without .bin/.idx)."""
    doc_range: tuple[float, float] = (0.0, 1.0)
    """Fraction of the dataset's documents this entry uses."""


def parse_blend(
    blend: str | Sequence[str], weights: Sequence[float] | None = None
) -> list[BlendEntry]:
    """Parse a blend string or list (see the module docstring for the syntax), or, with
    `weights`, a list of prefixes and their weights given apart (one weight per prefix)."""
    tokens = _tokens(blend)
    if not tokens:
        raise ValueError('data blend is empty; give a dataset prefix, e.g. "data/x_text_document"')
    if weights is not None:
        if len(weights) != len(tokens):
            raise ValueError(
                f"data blend: {len(weights)} weights {list(weights)} for {len(tokens)} dataset "
                f"prefixes {tokens}; give one weight per prefix"
            )
        tokens = [str(item) for pair in zip(weights, tokens, strict=True) for item in pair]
    if len(tokens) == 1:
        pairs = [(Fraction(1), tokens[0])]
    else:
        if len(tokens) % 2:
            raise ValueError(
                f"data blend {' '.join(tokens)!r} has {len(tokens)} items; with several datasets "
                'it must alternate weight and prefix, e.g. "0.3 data/a 0.7 data/b"'
            )
        pairs = [(_weight(tokens[i], tokens), tokens[i + 1]) for i in range(0, len(tokens), 2)]
    total = sum(weight for weight, _ in pairs)
    entries = []
    for weight, spec in pairs:
        prefix, doc_range = _prefix_and_range(spec)
        entries.append(BlendEntry(weight / total, prefix, doc_range))
    return entries


def _tokens(blend: str | Sequence[str]) -> list[str]:
    if isinstance(blend, str):
        return blend.split()
    return [token for item in blend for token in str(item).split()]


def _weight(token: str, tokens: list[str]) -> Fraction:
    try:
        weight = Fraction(token)
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"data blend {' '.join(tokens)!r}: expected a weight, got {token!r}; with several "
            'datasets the blend alternates weight and prefix, e.g. "0.3 data/a 0.7 data/b"'
        ) from None
    if weight <= 0:
        raise ValueError(f"data blend weight {token!r} must be positive")
    return weight


def _prefix_and_range(spec: str) -> tuple[str, tuple[float, float]]:
    match = _RANGE.match(spec)
    if match is None:
        prefix, doc_range = spec, (0.0, 1.0)
    else:
        prefix = match["path"]
        doc_range = (float(match["start"]), float(match["end"]))
        if not 0.0 <= doc_range[0] < doc_range[1] <= 1.0:
            raise ValueError(
                f"document range of {spec!r} must be START:END with 0 <= START < END <= 1, "
                "e.g. data/a:0:0.95"
            )
    for extension in (".bin", ".idx"):
        if prefix.endswith(extension):
            raise ValueError(
                f"data blend entry {spec!r} names a file; give the prefix without the "
                f"extension: {prefix[: -len(extension)]!r}"
            )
    return prefix, doc_range

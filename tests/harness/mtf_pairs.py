"""Pair datasets for the multitask fine-tuning tests, with tokens that tell where they came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.indexed_data import write_documents


def write_pairs(prefix: Path, inputs: list, targets: list, vocab_size: int = 1000) -> str:
    """``<prefix>_inputs_document`` and ``<prefix>_targets_document``; returns the pair prefix."""
    write_documents(Path(f"{prefix}_inputs_document"), [np.asarray(t) for t in inputs], vocab_size)
    write_documents(
        Path(f"{prefix}_targets_document"), [np.asarray(t) for t in targets], vocab_size
    )
    return str(prefix)


def labelled_pairs(lengths: list[tuple[int, int]]) -> tuple[list, list]:
    """Pair ``i`` of (input, target) lengths: every token of it is ``i`` (so a packed sample
    says which pairs it holds)."""
    inputs = [np.full(n_in, i) for i, (n_in, _) in enumerate(lengths)]
    targets = [np.full(n_tgt, i) for i, (_, n_tgt) in enumerate(lengths)]
    return inputs, targets


def random_pair_lengths(count: int, seed: int, longest: int) -> list[tuple[int, int]]:
    """Inputs of 1..longest tokens and targets of 1..longest // 2 tokens."""
    rng = np.random.default_rng(seed)
    return [
        (int(rng.integers(1, longest + 1)), int(rng.integers(1, longest // 2 + 1)))
        for _ in range(count)
    ]

"""Helpers shared by the data tests: small on-disk datasets with known tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bloomnative.data import IndexedDatasetBuilder


def write_documents(prefix: Path, documents: list[np.ndarray], vocab_size: int = 1000) -> str:
    """Write one sequence per document; returns the prefix as a string."""
    with IndexedDatasetBuilder(str(prefix), vocab_size=vocab_size) as builder:
        for tokens in documents:
            builder.add_document(tokens)
    return str(prefix)


def random_documents(
    count: int, seed: int, max_len: int = 50, vocab_size: int = 1000
) -> list[np.ndarray]:
    """Documents of 0..max_len random tokens (empty ones included)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, rng.integers(0, max_len + 1)) for _ in range(count)]

"""Fixtures of the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.indexed_data import random_documents, write_documents


@pytest.fixture
def small_corpus(tmp_path: Path) -> str:
    """200 random documents (about 5,000 tokens) at <tmp>/corpus."""
    return write_documents(tmp_path / "corpus", random_documents(200, seed=1))

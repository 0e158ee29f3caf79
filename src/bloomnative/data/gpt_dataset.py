"""A GPT pretraining dataset: shuffled samples of ``seq_len + 1`` tokens over a document range."""

from __future__ import annotations

import os

import numpy as np

from bloomnative.data.index_cache import cached_arrays
from bloomnative.data.indexed_dataset import IndexedDataset
from bloomnative.data.indexed_format import bin_path, idx_path
from bloomnative.data.sample_index import SampleIndex, build_sample_index

# Bump when build_sample_index changes what it returns, so stale caches are not reused.
SAMPLE_INDEX_VERSION = 1


class GPTDataset:
    """Samples of ``seq_len + 1`` tokens over documents ``[first, stop)`` of an indexed dataset.

    ``ds[i]`` is the ``i``-th sample in the shuffled order, an int64 array whose first
    ``seq_len`` tokens are the model input and last ``seq_len`` the labels.

    Args:
        indexed: the tokens.
        documents: ``(first, stop)`` sequence range of this split.
        seq_len: model sequence length.
        num_samples: samples needed (0: one epoch); the dataset may hold more (whole epochs).
        seed: shuffle seed.
        cache_dir: where the index arrays are cached (``None``: built in memory).
        name: for messages, e.g. ``"train"``.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: tuple[int, int],
        seq_len: int,
        num_samples: int,
        seed: int,
        cache_dir: str | None = None,
        name: str = "",
    ) -> None:
        self.indexed = indexed
        self.documents = (int(documents[0]), int(documents[1]))
        self.seq_len = int(seq_len)
        self.name = name
        first, stop = self.documents
        if not 0 <= first < stop <= len(indexed):
            raise ValueError(
                f"{name or 'dataset'}: document range [{first}, {stop}) is empty or outside "
                f"{indexed.prefix!r}, which has {len(indexed)} documents"
            )
        description = self._description(num_samples, seed)

        def build() -> dict[str, np.ndarray]:
            return build_sample_index(
                indexed.sequence_lengths, np.arange(first, stop), seq_len, num_samples, seed
            ).as_arrays()

        self.index = SampleIndex(**cached_arrays(cache_dir, description, build))

    def _description(self, num_samples: int, seed: int) -> dict:
        # Everything the arrays depend on. The file sizes and index mtime stand in for the
        # content: a re-tokenized dataset gets a new mtime and so a fresh index.
        bin_file, idx_file = bin_path(self.indexed.prefix), idx_path(self.indexed.prefix)
        return {
            "kind": "gpt_sample_index",
            "version": SAMPLE_INDEX_VERSION,
            "dataset": os.path.abspath(self.indexed.prefix),
            "bin_bytes": os.path.getsize(bin_file),
            "idx_bytes": os.path.getsize(idx_file),
            "idx_mtime_ns": os.stat(idx_file).st_mtime_ns,
            "documents": list(self.documents),
            "seq_len": self.seq_len,
            "num_samples": int(num_samples),
            "seed": int(seed),
        }

    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {self!r}")
        sample = int(self.index.sample_order[i])
        (first_doc, first_offset), (last_doc, last_offset) = self.index.sample_starts[
            sample : sample + 2
        ].tolist()
        order = self.index.document_order
        if first_doc == last_doc:
            tokens = self.indexed.get(
                int(order[first_doc]), first_offset, last_offset - first_offset + 1
            )
            return tokens.astype(np.int64)
        parts = [self.indexed.get(int(order[first_doc]), first_offset)]
        parts.extend(self.indexed.get(int(doc)) for doc in order[first_doc + 1 : last_doc])
        parts.append(self.indexed.get(int(order[last_doc]), 0, last_offset + 1))
        return np.concatenate(parts, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.name or 'split'} of {self.indexed.prefix!r}: documents "
            f"[{self.documents[0]}, {self.documents[1]}), {len(self)} samples of "
            f"{self.seq_len} + 1 tokens)"
        )

"""Packed multitask fine-tuning samples: (input, target) pairs packed into ``seq_len + 1`` tokens,
as Megatron-DeepSpeed's ``DecoderPackedMTFDataset`` packs them (the BLOOMZ recipe)."""

from __future__ import annotations

import os

import numpy as np

from bloomnative.data.index_cache import cached_arrays
from bloomnative.data.packing import PackingIndex, build_packing_index
from bloomnative.data.pair_dataset import PairDataset
from bloomnative.log import get_logger

_log = get_logger(__name__)

# Bump when build_packing_index changes what it returns, so stale caches are not reused.
PACKING_INDEX_VERSION = 1


class MTFDataset:
    """Packed samples over pairs ``[first, stop)`` of a ``PairDataset``.

    ``ds[k]`` is packed sample ``k`` (samples keep the packing order: the pairs were shuffled),
    a dict of three numpy arrays of ``seq_len + 1`` entries:

    * ``tokens`` (int64): each pair's input tokens then its target tokens, pair after pair, then
      ``pad_id`` to the end;
    * ``segment_ids`` (int64): ``j`` on the tokens of the sample's ``j``-th pair (from 1), 0 on
      padding;
    * ``is_inputs`` (bool): True on input tokens, False on target tokens and padding.

    Pairs longer than ``seq_len + 1`` tokens are never used; their number is logged as a warning
    and kept in ``skipped_pairs``.

    Args:
        pairs: the pairs.
        documents: ``(first, stop)`` pair range of this split.
        seq_len: model sequence length; a sample holds ``seq_len + 1`` tokens.
        num_samples: the dataset holds more than this many samples (0: at least one; whole
            epochs of pairs are packed until it does).
        seed: shuffle seed.
        pad_id: the token that fills a sample after its last pair.
        cache_dir: where the packing index is cached (``None``: built in memory).
        name: for messages, e.g. ``"train"``.
    """

    def __init__(
        self,
        pairs: PairDataset,
        documents: tuple[int, int],
        seq_len: int,
        num_samples: int,
        seed: int,
        pad_id: int,
        cache_dir: str | None = None,
        name: str = "",
    ) -> None:
        self.pairs = pairs
        self.documents = (int(documents[0]), int(documents[1]))
        self.seq_len = int(seq_len)
        self.pad_id = int(pad_id)
        self.name = name
        first, stop = self.documents
        if not 0 <= first < stop <= len(pairs):
            raise ValueError(
                f"{name or 'dataset'}: pair range [{first}, {stop}) is empty or outside "
                f"{pairs.prefix!r}, which has {len(pairs)} pairs"
            )
        capacity = self.seq_len + 1
        lengths = pairs.pair_lengths(first, stop)
        self.skipped_pairs = int(np.count_nonzero(lengths > capacity))
        if self.skipped_pairs:
            _log.warning(
                "%s: %d of the %d pairs of %r [%d, %d) are longer than a sample of %d tokens "
                "(the longest has %d) and are skipped",
                name or "dataset",
                self.skipped_pairs,
                stop - first,
                pairs.prefix,
                first,
                stop,
                capacity,
                int(lengths.max()),
            )

        def build() -> dict[str, np.ndarray]:
            return build_packing_index(lengths, capacity, num_samples, seed).as_arrays()

        arrays = cached_arrays(cache_dir, self._description(num_samples, seed), build)
        self.index = PackingIndex(**arrays)

    def _description(self, num_samples: int, seed: int) -> dict:
        # Everything the arrays depend on; sizes and index mtimes stand in for the content.
        files = self.pairs.files()
        return {
            "kind": "mtf_packing_index",
            "version": PACKING_INDEX_VERSION,
            "dataset": os.path.abspath(self.pairs.prefix),
            "file_bytes": [os.path.getsize(f) for f in files],
            "idx_mtime_ns": [os.stat(f).st_mtime_ns for f in files if f.endswith(".idx")],
            "documents": list(self.documents),
            "capacity": self.seq_len + 1,
            "num_samples": int(num_samples),
            "seed": int(seed),
        }

    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        if not 0 <= k < len(self):
            raise IndexError(f"sample {k} out of range for {self!r}")
        start, end = self.index.sample_bounds[k].tolist()
        capacity = self.seq_len + 1
        tokens = np.full(capacity, self.pad_id, dtype=np.int64)
        segment_ids = np.zeros(capacity, dtype=np.int64)
        is_inputs = np.zeros(capacity, dtype=bool)
        at = 0
        first = self.documents[0]
        for segment, position in enumerate(self.index.pair_order[start:end].tolist(), start=1):
            pair = first + position
            inputs, targets = self.pairs.inputs[pair], self.pairs.targets[pair]
            stop = at + len(inputs) + len(targets)
            tokens[at : at + len(inputs)] = inputs
            tokens[at + len(inputs) : stop] = targets
            segment_ids[at:stop] = segment
            is_inputs[at : at + len(inputs)] = True
            at = stop
        return {"tokens": tokens, "segment_ids": segment_ids, "is_inputs": is_inputs}

    def __repr__(self) -> str:
        return (
            f"MTFDataset({self.name or 'split'} of {self.pairs.prefix!r}: pairs "
            f"[{self.documents[0]}, {self.documents[1]}), {len(self)} packed samples of "
            f"{self.seq_len} + 1 tokens)"
        )

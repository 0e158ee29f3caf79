"""The packing index of (input, target) pairs: which pairs make up packed sample ``k``.

The rule is Megatron-DeepSpeed's ``DecoderPackedMTFDataset`` (``_build_index_mappings`` and
``_build_sample_idx``), the one BLOOMZ was fine-tuned with; for the same pair lengths, capacity,
sample count and seed the arrays are the same:

* The pairs are laid out epoch after epoch into one stream, each epoch a fresh permutation of
  ``range(num_pairs)``: ``np.random.RandomState(seed)`` shuffles ``np.arange(num_pairs)``
  once per epoch.
* Greedy packing along the stream: a row takes pairs while their tokens (input + target) fit
  in ``capacity``; the first pair that does not fit closes the row, which becomes a sample, and
  opens the next one. A pair is never split. A row left open at the end of an epoch continues
  into the next epoch.
* A pair longer than ``capacity`` can never fit: it closes the row it meets and is skipped.
* Epochs are added until more than ``num_samples`` rows have closed; the row still open then
  is not a sample. Samples keep the stream order (the pairs were shuffled, not the samples).

Megatron-DeepSpeed builds this with a Python loop over every pair. Here the end of the row
that starts at each position is found for all positions at once (a cumulative sum and a
``searchsorted``), and only the rows' starts are walked, one step per sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackingIndex:
    """The two arrays that define packed samples."""

    pair_order: np.ndarray
    """The stream: pair positions (``0 .. num_pairs - 1``), one permutation per epoch."""
    sample_bounds: np.ndarray
    """``[num_samples, 2]``: sample ``k`` holds the pairs ``pair_order[start:end]``."""

    @property
    def num_samples(self) -> int:
        return len(self.sample_bounds)

    def as_arrays(self) -> dict[str, np.ndarray]:
        return {"pair_order": self.pair_order, "sample_bounds": self.sample_bounds}


def require_a_fitting_pair(pair_lengths: np.ndarray, capacity: int, which: str = "") -> None:
    """Raises ValueError unless a pair of `pair_lengths` fits a sample of `capacity` tokens:
    with none, no sample can be made. `which`: the pairs, for the message (" of ...")."""
    lengths = np.asarray(pair_lengths, dtype=np.int64)
    if np.any((lengths >= 1) & (lengths <= capacity)):
        return
    longest, shortest = (int(lengths.max()), int(lengths.min())) if len(lengths) else (0, 0)
    raise ValueError(
        f"none of the {len(lengths)} pairs{which} fits a sample of {capacity} tokens (the "
        f"longest has {longest}, the shortest {shortest}): nothing to pack; use a longer "
        "training.seq_len or shorter pairs"
    )


def build_packing_index(
    pair_lengths: np.ndarray, capacity: int, num_samples: int, seed: int
) -> PackingIndex:
    """Pack pairs into samples of at most ``capacity`` tokens.

    Args:
        pair_lengths: tokens of each pair (input + target), by pair position.
        capacity: tokens per sample (``seq_len + 1``: a sample's inputs and labels).
        num_samples: the index holds more than this many samples (0: at least one).
        seed: seed of the epoch shuffles.

    Raises:
        ValueError: no pair fits a sample, so no sample can ever be made.
    """
    lengths = np.asarray(pair_lengths, dtype=np.int64)
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 token, got {capacity}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be non-negative, got {num_samples}")
    require_a_fitting_pair(lengths, capacity)
    orders: list[np.ndarray] = []
    bounds: list[np.ndarray] = []
    closed = 0
    open_start = 0  # stream position of the open row's first pair
    open_lengths = np.empty(0, dtype=np.int64)  # lengths of the stream from open_start on
    for order in _epoch_orders(len(lengths), seed):
        orders.append(order)
        window = np.concatenate([open_lengths, lengths[order]])
        rows, next_start = close_rows(window, capacity)
        bounds.append(rows + open_start)
        closed += len(rows)
        open_lengths = window[next_start:]
        open_start += next_start
        if closed > num_samples:
            break
    pair_order = np.concatenate(orders)
    sample_bounds = np.concatenate(bounds).astype(np.int64, copy=False)
    return PackingIndex(pair_order, sample_bounds.reshape(-1, 2))


def close_rows(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """The rows that close within a stream of pair lengths, packed greedily from position 0.

    Returns ``(rows, next_start)``: ``rows`` is ``[n, 2]``, the ``[start, end)`` positions of
    each closed row (a row closes when the pair at ``end`` does not fit); ``next_start`` is
    where the row still open at the end of the stream starts (``len(lengths)`` when none is).
    """
    size = len(lengths)
    ends = np.concatenate([[0], np.cumsum(lengths)])
    # The row starting at s holds s .. e - 1 for the largest e with ends[e] - ends[s] <= capacity.
    row_end = np.searchsorted(ends, ends[:-1] + capacity, side="right") - 1
    # Rows start only at a pair that fits; longer pairs are skipped: next_fit[p] is the first
    # fitting position >= p (size if none).
    positions = np.arange(size + 1, dtype=np.int64)
    positions[:-1][lengths > capacity] = size
    next_fit = np.minimum.accumulate(positions[::-1])[::-1]
    rows = []
    start = int(next_fit[0])
    while start < size:
        end = int(row_end[start])
        if end >= size:  # the stream ended before the row closed
            break
        rows.append((start, end))
        start = int(next_fit[end])
    return np.array(rows, dtype=np.int64).reshape(-1, 2), start


def _epoch_orders(num_pairs: int, seed: int) -> Iterator[np.ndarray]:
    rng = np.random.RandomState(seed)
    while True:
        order = np.arange(num_pairs, dtype=np.int64)
        rng.shuffle(order)
        yield order

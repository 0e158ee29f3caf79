"""The GPT sample index: which tokens make up sample ``i``, built with vectorised numpy.

The documents of a split are laid end to end into one token stream, epoch after epoch, each
epoch in a fresh random document order. Sample ``k`` is the ``seq_len + 1`` tokens starting at
stream position ``k * seq_len``: consecutive samples share one token (the last label of one is
the first input of the next) and freely cross document boundaries, as in Megatron's GPT
dataset. Samples are then served in a shuffled order.

Epochs and shuffling follow Megatron's ``_build_index_mappings``:

* as many epochs as needed to cover ``num_samples`` (``num_samples = 0`` means one epoch);
* ``np.random.RandomState(seed)`` drives every shuffle;
* when the last epoch is needed for less than 80% of its samples, the samples of the earlier
  epochs are shuffled among themselves and the last epoch's separately (``separate_last_epoch``),
  so the run sees every earlier sample before a random part of the last epoch.

One deliberate difference: Megatron shuffles the documents of all full epochs as one pool, so a
document can appear twice in a row of the stream and miss another "epoch"; here each epoch is its
own permutation, so every document appears exactly once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Megatron's rule: a last epoch used below this fraction is shuffled on its own.
SEPARATE_LAST_EPOCH_FRACTION = 0.80
# Entries of document_order (epochs x documents) beyond which a request is surely a mistake.
MAX_DOCUMENT_ORDER = 2**31


@dataclass(frozen=True)
class SampleIndex:
    """The three arrays that define a GPT dataset's samples."""

    document_order: np.ndarray
    """Dataset sequence ids in stream order, all epochs concatenated."""
    sample_starts: np.ndarray
    """``[num_samples + 1, 2]``: the (position in ``document_order``, token offset) of stream
    token ``k * seq_len``; sample ``k`` runs from entry ``k`` to entry ``k + 1`` inclusive."""
    sample_order: np.ndarray
    """The order in which samples are served: a permutation of ``range(num_samples)``."""

    @property
    def num_samples(self) -> int:
        return len(self.sample_order)

    def as_arrays(self) -> dict[str, np.ndarray]:
        return {
            "document_order": self.document_order,
            "sample_starts": self.sample_starts,
            "sample_order": self.sample_order,
        }


def num_epochs_for(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Fewest epochs whose token stream holds ``num_samples`` samples of ``seq_len + 1`` tokens
    (overlapping by one), i.e. the smallest ``e`` with ``(e * tokens - 1) // seq_len >= n``."""
    needed_tokens = num_samples * seq_len + 1
    return max(1, -(-needed_tokens // tokens_per_epoch))


def build_sample_index(
    sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int, seed: int
) -> SampleIndex:
    """Build the index over ``documents`` (sequence ids into ``sizes``).

    Args:
        sizes: tokens of every sequence of the dataset (``IndexedDataset.sequence_lengths``).
        documents: the sequence ids of this split, e.g. ``np.arange(start, stop)``.
        seq_len: tokens of model input per sample; each sample holds ``seq_len + 1``.
        num_samples: samples needed (0: one epoch). The index covers whole epochs, so it can
            hold more samples than requested.
        seed: seed of the shuffles.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be non-negative, got {num_samples}")
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"the {len(documents)} documents hold no tokens; nothing to sample")
    num_epochs = num_epochs_for(tokens_per_epoch, seq_len, num_samples)
    if num_epochs * len(documents) > MAX_DOCUMENT_ORDER:
        raise ValueError(
            f"{num_samples} samples of {seq_len} + 1 tokens need {num_epochs} epochs over "
            f"{len(documents)} documents ({tokens_per_epoch} tokens each epoch), more than an "
            "index can hold; ask for fewer samples or give this split more documents"
        )
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_len
    rng = np.random.RandomState(seed)

    document_order = _document_order(documents, num_epochs, rng)
    sample_starts = _sample_starts(sizes, document_order, seq_len, total_samples)
    first_block = _separately_shuffled_prefix(
        tokens_per_epoch, seq_len, num_samples, num_epochs, total_samples
    )
    sample_order = _sample_order(first_block, total_samples, rng)
    return SampleIndex(document_order, sample_starts, sample_order)


def _document_order(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState):
    order = np.empty(num_epochs * len(documents), dtype=_index_dtype(documents.max(initial=0)))
    for epoch in range(num_epochs):
        epoch_order = order[epoch * len(documents) : (epoch + 1) * len(documents)]
        epoch_order[:] = documents
        rng.shuffle(epoch_order)
    return order


def _sample_starts(
    sizes: np.ndarray, document_order: np.ndarray, seq_len: int, total_samples: int
) -> np.ndarray:
    lengths = sizes[document_order].astype(np.int64)
    doc_ends = np.cumsum(lengths)
    positions = np.arange(total_samples + 1, dtype=np.int64) * seq_len
    # The document holding stream token p is the first whose end lies beyond p; "right" skips
    # empty documents, so every entry points at a real token.
    doc_positions = np.searchsorted(doc_ends, positions, side="right")
    offsets = positions - (doc_ends[doc_positions] - lengths[doc_positions])
    starts = np.empty((total_samples + 1, 2), dtype=_index_dtype(len(document_order)))
    starts[:, 0] = doc_positions
    starts[:, 1] = offsets
    return starts


def _separately_shuffled_prefix(
    tokens_per_epoch: int, seq_len: int, num_samples: int, num_epochs: int, total_samples: int
) -> int:
    """How many leading samples are shuffled as one block (all of them unless the last epoch
    is shuffled separately)."""
    if num_epochs == 1:
        return total_samples
    from_earlier_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len
    needed_from_last = num_samples - from_earlier_epochs
    samples_per_epoch = (tokens_per_epoch - 1) // seq_len
    if needed_from_last < int(SEPARATE_LAST_EPOCH_FRACTION * samples_per_epoch):
        return from_earlier_epochs
    return total_samples


def _sample_order(first_block: int, total_samples: int, rng: np.random.RandomState) -> np.ndarray:
    order = np.arange(total_samples, dtype=_index_dtype(total_samples))
    rng.shuffle(order[:first_block])
    rng.shuffle(order[first_block:])
    return order


def _index_dtype(largest: int) -> np.dtype:
    return np.dtype(np.int32) if largest < np.iinfo(np.int32).max else np.dtype(np.int64)

"""From a blend and a split string to the train, valid and test datasets the trainer reads."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from bloomnative.data.blend_spec import BlendEntry, parse_blend
from bloomnative.data.blended_dataset import BlendedDataset
from bloomnative.data.gpt_dataset import GPTDataset
from bloomnative.data.indexed_dataset import IndexedDataset
from bloomnative.data.splits import SPLIT_NAMES, SplitError, fraction_range, split_boundaries

Dataset = GPTDataset | BlendedDataset


def build_gpt_datasets(
    blend: str | list[str],
    split: str,
    seq_len: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    valid_seq_len: int | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test datasets of ``seq_len + 1``-token samples.

    Each dataset of the blend is cut into train/valid/test document ranges by ``split``
    (inside its own ``:START:END`` range when it has one); a split of several datasets is
    their weighted blend.

    Args:
        blend: see ``bloomnative.data.blend_spec`` (``"path"`` or ``"0.3 a 0.7 b:0:0.9"``), or
            a list of prefixes whose weights are ``weights``.
        split: train,valid,test proportions of each dataset's documents, e.g. ``"969,30,1"``.
        seq_len: training sequence length.
        seed: shuffle seed.
        num_samples: samples needed per split (0: one epoch of that split).
        cache_dir: where index arrays are cached (``None``/``""``: built in memory). With a
            cache under ``torch.distributed`` the call is collective over the default group
            (rank 0 builds, the others wait at a barrier): call it on every rank.
        valid_seq_len: sequence length of the valid and test splits (default ``seq_len``),
            e.g. longer, to check ALiBi's extrapolation.
        weights: one positive weight per prefix of ``blend`` (normalised to sum 1), instead of
            weights written into the blend.

    Returns:
        ``(train, valid, test)``; a split without documents is ``None``.

    Raises:
        FileNotFoundError: a prefix of the blend has no .bin/.idx.
        SplitError: a split that is asked for samples has no documents (or they hold no
            tokens), or the split string is malformed.
    """
    entries, indexed = _open_blend(blend, num_samples, weights)
    lengths = (seq_len, valid_seq_len or seq_len, valid_seq_len or seq_len)
    return tuple(  # type: ignore[return-value]
        _build_split(entries, indexed, split, i, lengths[i], seed, num_samples[i], cache_dir)
        for i in range(3)
    )


def check_gpt_datasets(
    blend: str | list[str],
    split: str,
    num_samples: tuple[int, int, int],
    weights: Sequence[float] | None = None,
) -> tuple[int, int, int]:
    """Every check of `build_gpt_datasets` that does not build an index (what preflight runs):
    the blend's files, the split string, and that each split asked for samples has documents
    holding tokens in every dataset of the blend. Returns the tokens of each split (train,
    valid, test). Raises as `build_gpt_datasets` does."""
    entries, indexed = _open_blend(blend, num_samples, weights)
    tokens = []
    for i in range(3):
        ranges = _split_ranges(entries, indexed, split, i, num_samples[i])
        tokens.append(
            0
            if ranges is None
            else sum(
                int(indexed[e.prefix].sequence_lengths[first:stop].sum(dtype=np.int64))
                for e, (first, stop) in zip(entries, ranges, strict=True)
            )
        )
    return tokens[0], tokens[1], tokens[2]


def _open_blend(
    blend: str | list[str], num_samples: tuple[int, int, int], weights: Sequence[float] | None
) -> tuple[list[BlendEntry], dict[str, IndexedDataset]]:
    if len(num_samples) != 3:
        raise ValueError(
            f"num_samples needs one count per split (train, valid, test), got {num_samples}"
        )
    entries = parse_blend(blend, weights)
    return entries, {entry.prefix: IndexedDataset(entry.prefix) for entry in entries}


def _split_ranges(
    entries: list[BlendEntry],
    indexed: dict[str, IndexedDataset],
    split: str,
    split_index: int,
    num_samples: int,
) -> list[tuple[int, int]] | None:
    """Each dataset's document range of one split; None for a split without documents that no
    samples are asked of. Raises SplitError for a split asked for samples without documents, a
    split empty in some datasets of the blend only, and documents without tokens."""
    name = SPLIT_NAMES[split_index]
    ranges = [
        _document_range(entry, indexed[entry.prefix], split, split_index) for entry in entries
    ]
    empty = [
        entry.prefix for entry, (first, stop) in zip(entries, ranges, strict=True) if first >= stop
    ]
    if len(empty) == len(entries):
        if num_samples > 0:
            raise SplitError(
                f"the {name} split is empty: split {split!r} gives it no documents of "
                f"{_describe(entries, indexed)}, but {num_samples} {name} samples were asked "
                f'for; give {name} a larger share of the split (e.g. "949,50,1") or ask for '
                f"no {name} samples"
            )
        return None
    if empty:
        raise SplitError(
            f"the {name} split of {empty} is empty under split {split!r} while other datasets "
            f"of the blend have {name} documents; give {name} a larger share or drop them"
        )
    for entry, (first, stop) in zip(entries, ranges, strict=True):
        if not indexed[entry.prefix].sequence_lengths[first:stop].any():
            raise SplitError(
                f"the {name} split of {entry.prefix!r} (documents [{first}, {stop}) under split "
                f"{split!r}) holds no tokens; nothing to sample"
            )
    return ranges


def _build_split(
    entries: list[BlendEntry],
    indexed: dict[str, IndexedDataset],
    split: str,
    split_index: int,
    seq_len: int,
    seed: int,
    num_samples: int,
    cache_dir: str | None,
) -> Dataset | None:
    name = SPLIT_NAMES[split_index]
    ranges = _split_ranges(entries, indexed, split, split_index, num_samples)
    if ranges is None:
        return None
    if len(entries) == 1:
        return GPTDataset(
            indexed[entries[0].prefix], ranges[0], seq_len, num_samples, seed, cache_dir, name
        )
    # Each component needs at most ceil(weight * n) samples: the blend order keeps every
    # count within one sample of its share.
    components = [
        GPTDataset(
            indexed[entry.prefix],
            doc_range,
            seq_len,
            math.ceil(entry.weight * num_samples),
            seed,
            cache_dir,
            name,
        )
        for entry, doc_range in zip(entries, ranges, strict=True)
    ]
    weights = [entry.weight for entry in entries]
    if num_samples == 0:  # one pass: as long as no component runs out
        num_samples = min(math.floor(len(c) / w) for c, w in zip(components, weights, strict=True))
    return BlendedDataset(components, weights, num_samples, cache_dir)


def _document_range(
    entry: BlendEntry, dataset: IndexedDataset, split: str, split_index: int
) -> tuple[int, int]:
    first, stop = fraction_range(*entry.doc_range, len(dataset))
    bounds = split_boundaries(split, stop - first)
    return first + bounds[split_index], first + bounds[split_index + 1]


def _describe(entries: Sequence[BlendEntry], indexed: dict[str, IndexedDataset]) -> str:
    return ", ".join(
        f"{entry.prefix!r} ({len(indexed[entry.prefix])} documents)" for entry in entries
    )

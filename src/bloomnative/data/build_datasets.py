"""From a blend and a split string to the train, valid and test datasets the trainer reads."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from bloomnative.data.blend_spec import BlendEntry, parse_blend
from bloomnative.data.blended_dataset import BLEND_ARRAYS, BlendedDataset
from bloomnative.data.gpt_dataset import GPTDataset
from bloomnative.data.indexed_dataset import IndexedDataset, check_tokens, holds_token
from bloomnative.data.mtf_dataset import MTFDataset
from bloomnative.data.packing import PackingIndex, require_a_fitting_pair
from bloomnative.data.pair_dataset import PairDataset
from bloomnative.data.sample_index import SampleIndex
from bloomnative.data.splits import SPLIT_NAMES, SplitError, fraction_range, split_boundaries

Dataset = GPTDataset | MTFDataset | BlendedDataset
MakeComponent = Callable[[BlendEntry, tuple[int, int], int, str], GPTDataset | MTFDataset]
"""(blend entry, document range, samples, split name) -> that entry's dataset for the split."""


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

    def make(entry: BlendEntry, documents: tuple[int, int], samples: int, name: str):
        _require_tokens(entry, indexed[entry.prefix], documents, split, name)
        length = lengths[SPLIT_NAMES.index(name)]
        return GPTDataset(indexed[entry.prefix], documents, length, samples, seed, cache_dir, name)

    counts = {prefix: len(dataset) for prefix, dataset in indexed.items()}
    return _build_splits(entries, counts, split, num_samples, make, cache_dir)


@dataclass(frozen=True)
class BlendCheck:
    """What `check_gpt_datasets` or `check_mtf_datasets` checked, for preflight's log."""

    tokens: int
    """Tokens of the blend's datasets, each counted once."""
    splits: tuple[int, int, int]
    """Per split (train, valid, test): its tokens, or its pairs for packed pairs (`unit`)."""
    unit: str
    """What `splits` counts: "tokens" or "pairs"."""
    maps: int = 0
    """The memory maps a process holds once it has built these datasets with a cache: each
    non-empty `.bin` and `.idx`, and each cached index array of every split (`blend_maps`)."""
    without_eod: tuple[str, ...] = ()
    """With an `eod_id`: the prefixes of the blend none of whose tokens is that id."""


def check_gpt_datasets(
    blend: str | list[str],
    split: str,
    num_samples: tuple[int, int, int],
    weights: Sequence[float] | None = None,
    vocab_size: int | None = None,
    eod_id: int | None = None,
) -> BlendCheck:
    """Every check of `build_gpt_datasets` that does not build an index (what preflight runs):
    the blend's files, with `vocab_size` every token id of each (`check_tokens`), the split
    string, and that each split asked for samples has documents holding tokens in every dataset
    of the blend; with `eod_id`, which datasets hold no such token (`BlendCheck.without_eod`,
    `holds_token`). Raises as `build_gpt_datasets` does, and IndexedDatasetError for a token id
    outside the vocabulary."""
    entries, indexed = _open_blend(blend, num_samples, weights)
    tokens = sum(check_tokens(dataset, vocab_size).num_tokens for dataset in indexed.values())
    without_eod = tuple(
        prefix
        for prefix, dataset in indexed.items()
        if eod_id is not None and not holds_token(dataset, eod_id)
    )
    counts = {prefix: len(dataset) for prefix, dataset in indexed.items()}
    splits, built = [], 0
    for i, name in enumerate(SPLIT_NAMES):
        ranges = _split_ranges(entries, counts, split, i, num_samples[i])
        built += ranges is not None
        splits.append(
            0
            if ranges is None
            else sum(
                _require_tokens(entry, indexed[entry.prefix], documents, split, name)
                for entry, documents in zip(entries, ranges, strict=True)
            )
        )
    maps = blend_maps(list(indexed.values()), len(entries), built, len(fields(SampleIndex)))
    return BlendCheck(tokens, (splits[0], splits[1], splits[2]), "tokens", maps, without_eod)


def build_mtf_datasets(
    prefixes: str | list[str],
    split: str,
    seq_len: int,
    seed: int,
    num_samples: tuple[int, int, int],
    weights: Sequence[float] | None = None,
    cache_dir: str | None = None,
    *,
    pad_id: int,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test datasets of packed (input, target) pairs, ``seq_len + 1`` tokens
    each (``MTFDataset``: dicts of ``tokens``, ``segment_ids``, ``is_inputs``).

    Each prefix names a pair of datasets, ``<prefix>_inputs_document`` and
    ``<prefix>_targets_document``. Blends, ``:START:END`` ranges and splits cut the pairs as
    ``build_gpt_datasets`` cuts documents.

    Args:
        prefixes: pair prefixes, as ``build_gpt_datasets``' ``blend`` (weights written in, or
            given apart as ``weights``).
        split: train,valid,test proportions of each prefix's pairs, e.g. ``"969,30,1"``.
        seq_len: training sequence length.
        seed: shuffle seed.
        num_samples: samples needed per split (0: at least one).
        weights: one positive weight per prefix.
        cache_dir: where packing indices are cached (``None``/``""``: built in memory); with a
            cache under ``torch.distributed`` the call is collective, as for ``build_gpt_datasets``.
        pad_id: the token that fills each sample after its last pair (``data.pad_token``).

    Returns:
        ``(train, valid, test)``; a split without pairs is ``None``.

    Raises:
        IndexedDatasetError: a pair's datasets are missing, malformed or of unequal length.
        SplitError: a split that is asked for samples has no pairs, or the split string is
            malformed.
        ValueError: no pair fits a sample.
    """
    _require_three(num_samples)
    entries = parse_blend(prefixes, weights)
    pairs = {entry.prefix: PairDataset(entry.prefix) for entry in entries}

    def make(entry: BlendEntry, documents: tuple[int, int], samples: int, name: str):
        return MTFDataset(
            pairs[entry.prefix], documents, seq_len, samples, seed, pad_id, cache_dir, name
        )

    counts = {prefix: len(dataset) for prefix, dataset in pairs.items()}
    return _build_splits(entries, counts, split, num_samples, make, cache_dir)


def check_mtf_datasets(
    prefixes: str | list[str],
    split: str,
    seq_len: int,
    num_samples: tuple[int, int, int],
    weights: Sequence[float] | None = None,
    vocab_size: int | None = None,
) -> BlendCheck:
    """The checks of `build_mtf_datasets` without packing (what preflight runs): both datasets of
    each prefix, with `vocab_size` every token id of each (`PairDataset.check_tokens`), the split
    string, that each split asked for samples has pairs in every prefix of the blend, and that
    each prefix's pairs of each split it packs hold one that fits a sample of `seq_len + 1`
    tokens. Raises as `build_mtf_datasets` does, and IndexedDatasetError for a token id outside
    the vocabulary."""
    _require_three(num_samples)
    entries = parse_blend(prefixes, weights)
    datasets = {entry.prefix: PairDataset(entry.prefix) for entry in entries}
    tokens = sum(dataset.check_tokens(vocab_size) for dataset in datasets.values())
    counts = {prefix: len(dataset) for prefix, dataset in datasets.items()}
    pairs, built = [], 0
    for i, name in enumerate(SPLIT_NAMES):
        ranges = _split_ranges(entries, counts, split, i, num_samples[i])
        if ranges is None:  # no pairs, none asked for
            pairs.append(0)
            continue
        built += 1
        for entry, (first, stop) in zip(entries, ranges, strict=True):
            lengths = datasets[entry.prefix].pair_lengths(first, stop)
            which = f" of {entry.prefix!r} [{first}, {stop}) (the {name} split)"
            require_a_fitting_pair(lengths, seq_len + 1, which)
        pairs.append(sum(stop - first for first, stop in ranges))
    sides = [side for dataset in datasets.values() for side in (dataset.inputs, dataset.targets)]
    maps = blend_maps(sides, len(entries), built, len(fields(PackingIndex)))
    return BlendCheck(tokens, (pairs[0], pairs[1], pairs[2]), "pairs", maps)


def blend_maps(
    indexed: Sequence[IndexedDataset], components: int, splits: int, index_arrays: int
) -> int:
    """The memory maps that building `splits` splits of a blend of `components` entries holds
    with a cache, once the `indexed` datasets it reads are open: a `.idx` and a non-empty `.bin`
    each (no file descriptor: `file_map.py`); per split, `index_arrays` cached arrays per
    component and, for a blend of several, the blend order's. What preflight checks against
    the kernel's limit (`vm.max_map_count`); a test compares it with the maps counted."""
    files = sum(1 + (dataset.num_tokens > 0) for dataset in indexed)
    per_split = components * index_arrays + (len(BLEND_ARRAYS) if components > 1 else 0)
    return files + splits * per_split


def _require_three(num_samples: tuple[int, int, int]) -> None:
    if len(num_samples) != 3:
        raise ValueError(
            f"num_samples needs one count per split (train, valid, test), got {num_samples}"
        )


def _open_blend(
    blend: str | list[str], num_samples: tuple[int, int, int], weights: Sequence[float] | None
) -> tuple[list[BlendEntry], dict[str, IndexedDataset]]:
    _require_three(num_samples)
    entries = parse_blend(blend, weights)
    return entries, {entry.prefix: IndexedDataset(entry.prefix) for entry in entries}


def _require_tokens(
    entry: BlendEntry, dataset: IndexedDataset, documents: tuple[int, int], split: str, name: str
) -> int:
    """The tokens of `documents` of `dataset`; SplitError when there are none to sample."""
    first, stop = documents
    tokens = int(dataset.sequence_lengths[first:stop].sum(dtype=np.int64))
    if tokens == 0:
        raise SplitError(
            f"the {name} split of {entry.prefix!r} (documents [{first}, {stop}) under split "
            f"{split!r}) holds no tokens; nothing to sample"
        )
    return tokens


def _build_splits(
    entries: list[BlendEntry],
    counts: dict[str, int],
    split: str,
    num_samples: tuple[int, int, int],
    make: MakeComponent,
    cache_dir: str | None,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    return tuple(  # type: ignore[return-value]
        _build_split(entries, counts, split, i, num_samples[i], make, cache_dir) for i in range(3)
    )


def _split_ranges(
    entries: list[BlendEntry],
    counts: dict[str, int],
    split: str,
    split_index: int,
    num_samples: int,
) -> list[tuple[int, int]] | None:
    """Each dataset's document range of one split; None for a split without documents that no
    samples are asked of. Raises SplitError for a split asked for samples without documents and
    a split empty in some datasets of the blend only."""
    name = SPLIT_NAMES[split_index]
    ranges = [_document_range(entry, counts[entry.prefix], split, split_index) for entry in entries]
    empty = [
        entry.prefix for entry, (first, stop) in zip(entries, ranges, strict=True) if first >= stop
    ]
    if len(empty) == len(entries):
        if num_samples > 0:
            raise SplitError(
                f"the {name} split is empty: split {split!r} gives it no documents of "
                f"{_describe(entries, counts)}, but {num_samples} {name} samples were asked "
                f'for; give {name} a larger share of the split (e.g. "949,50,1") or ask for '
                f"no {name} samples"
            )
        return None
    if empty:
        raise SplitError(
            f"the {name} split of {empty} is empty under split {split!r} while other datasets "
            f"of the blend have {name} documents; give {name} a larger share or drop them"
        )
    return ranges


def _build_split(
    entries: list[BlendEntry],
    counts: dict[str, int],
    split: str,
    split_index: int,
    num_samples: int,
    make: MakeComponent,
    cache_dir: str | None,
) -> Dataset | None:
    name = SPLIT_NAMES[split_index]
    ranges = _split_ranges(entries, counts, split, split_index, num_samples)
    if ranges is None:
        return None
    if len(entries) == 1:
        return make(entries[0], ranges[0], num_samples, name)
    # Each component needs at most ceil(weight * n) samples: the blend order keeps every
    # count within one sample of its share.
    components = [
        make(entry, doc_range, math.ceil(entry.weight * num_samples), name)
        for entry, doc_range in zip(entries, ranges, strict=True)
    ]
    weights = [entry.weight for entry in entries]
    if num_samples == 0:  # one pass: as long as no component runs out
        num_samples = min(math.floor(len(c) / w) for c, w in zip(components, weights, strict=True))
    return BlendedDataset(components, weights, num_samples, cache_dir)


def _document_range(
    entry: BlendEntry, num_documents: int, split: str, split_index: int
) -> tuple[int, int]:
    first, stop = fraction_range(*entry.doc_range, num_documents)
    bounds = split_boundaries(split, stop - first)
    return first + bounds[split_index], first + bounds[split_index + 1]


def _describe(entries: Sequence[BlendEntry], counts: dict[str, int]) -> str:
    return ", ".join(f"{entry.prefix!r} ({counts[entry.prefix]} documents)" for entry in entries)

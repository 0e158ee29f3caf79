"""Read a Megatron MMIDIDX dataset (``<prefix>.bin`` + ``<prefix>.idx``) through memory maps.

Everything that can be checked cheaply is checked when the dataset is opened, so a truncated,
corrupt or mismatched pair fails at start-up with the file and the problem named, not hours
later with a garbage batch. The checks are O(1) or vectorised passes over the index.
"""

from __future__ import annotations

import os

import numpy as np

from bloomnative.data.file_map import map_file
from bloomnative.data.indexed_format import (
    DTYPE_CODES,
    HEADER,
    MAGIC,
    VERSION,
    bin_path,
    idx_path,
    index_file_size,
    sequence_pointers,
)

# The magic of Megatron's older non-mmap ("lazy"/"cached") index format.
_LEGACY_MAGIC = b"TNTIDX\x00\x00"
# Sequences whose pointers are checked at a time when a dataset is opened.
_POINTER_CHUNK = 1 << 22


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that cannot be used; the message names the file and what is wrong."""


class IndexedDataset:
    """A memory-mapped MMIDIDX dataset: ``len(ds)`` sequences, ``ds[i]`` a numpy view (no copy).

    Args:
        prefix: path without extension; ``<prefix>.bin`` and ``<prefix>.idx`` must both exist.

    Raises:
        FileNotFoundError: a file of the pair is missing.
        IndexedDatasetError: the pair is truncated, corrupt or does not belong together.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = str(prefix)
        self._open()

    # -- opening and validation ------------------------------------------------------------

    def _open(self) -> None:
        idx_file, bin_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx_file, bin_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"indexed dataset file {path!r} does not exist; a dataset prefix "
                    f"{self.prefix!r} needs both {idx_file!r} and {bin_file!r} "
                    "(give the path without .bin/.idx)"
                )
        idx_size = os.path.getsize(idx_file)
        if idx_size < HEADER.size:
            raise IndexedDatasetError(
                f"{idx_file}: truncated: {idx_size} bytes, the header alone needs {HEADER.size}"
            )
        idx_map = map_file(idx_file)
        magic, version, code, num_sequences, doc_index_length = HEADER.unpack_from(idx_map.data, 0)
        if magic != MAGIC:
            hint = (
                " (this is Megatron's older 'lazy'/'cached' TNTIDX format; re-run preprocessing "
                "with the mmap implementation)"
                if magic.startswith(_LEGACY_MAGIC)
                else ""
            )
            raise IndexedDatasetError(
                f"{idx_file}: bad magic {magic!r}, expected {MAGIC!r}: not an MMIDIDX index{hint}"
            )
        if version != VERSION:
            raise IndexedDatasetError(
                f"{idx_file}: unsupported version {version}, only version {VERSION} exists"
            )
        if code not in DTYPE_CODES:
            valid = ", ".join(f"{c} ({d})" for c, d in DTYPE_CODES.items())
            raise IndexedDatasetError(f"{idx_file}: unknown dtype code {code}; valid: {valid}")
        self.dtype: np.dtype = DTYPE_CODES[code]

        expected = index_file_size(num_sequences, doc_index_length)
        if idx_size != expected:
            raise IndexedDatasetError(
                f"{idx_file}: {_describe_size_mismatch(idx_size, expected, num_sequences)}; "
                f"the header declares {num_sequences} sequences and {doc_index_length} "
                f"document-index entries, which take exactly {expected} bytes"
            )
        offset = HEADER.size
        self._sizes = np.frombuffer(idx_map, np.int32, num_sequences, offset)
        offset += self._sizes.nbytes
        self._pointers = np.frombuffer(idx_map, np.int64, num_sequences, offset)
        offset += self._pointers.nbytes
        self._doc_index = np.frombuffer(idx_map, np.int64, doc_index_length, offset)
        self._validate_index(idx_file)

        bin_size = os.path.getsize(bin_file)
        self._validate_bin_size(bin_file, bin_size)
        # Mapped with no file descriptor kept open (file_map.py), so a blend of thousands of
        # datasets fits the usual limit of 1,024 open files.
        self._tokens = map_file(bin_file).view(self.dtype)

    def _validate_index(self, idx_file: str) -> None:
        n, docs = len(self._sizes), self._doc_index
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n:
            first = int(docs[0]) if len(docs) else None
            last = int(docs[-1]) if len(docs) else None
            raise IndexedDatasetError(
                f"{idx_file}: corrupt document index: it must start with 0 and end with the "
                f"sequence count {n}, found first={first} last={last} ({len(docs)} entries)"
            )
        if len(docs) > 1 and np.any(np.diff(docs) < 0):
            raise IndexedDatasetError(f"{idx_file}: corrupt document index: not non-decreasing")
        if n and self._sizes.min() < 0:
            bad = int(np.argmin(self._sizes))
            raise IndexedDatasetError(
                f"{idx_file}: corrupt sequence lengths: sequence {bad} has length "
                f"{int(self._sizes[bad])}"
            )

    def _validate_bin_size(self, bin_file: str, bin_size: int) -> None:
        itemsize = self.dtype.itemsize
        total_bytes = int(self._sizes.sum(dtype=np.int64)) * itemsize
        if bin_size != total_bytes:
            raise IndexedDatasetError(
                f"{bin_file}: {bin_size} bytes, but {idx_path(self.prefix)} describes "
                f"{total_bytes // itemsize} tokens of {self.dtype} = {total_bytes} bytes: "
                "the .bin is truncated or the pair does not belong together"
            )
        # Each sequence starts where the ones before it end: a pointer off that (a size
        # rewritten, a pointer damaged) would serve a sequence cut short by the end of the .bin
        # or overlapping its neighbour. Compared a slice at a time, so memory stays flat.
        end = 0
        for start in range(0, len(self._sizes), _POINTER_CHUNK):
            sizes = self._sizes[start : start + _POINTER_CHUNK]
            expected = end + sequence_pointers(sizes, itemsize)
            mismatch = np.flatnonzero(self._pointers[start : start + len(sizes)] != expected)
            if len(mismatch):
                i = start + int(mismatch[0])
                raise IndexedDatasetError(
                    f"{idx_path(self.prefix)}: corrupt sequence pointers: sequence {i} starts "
                    f"at byte {int(self._pointers[i])}, but the sizes before it add up to byte "
                    f"{int(expected[i - start])}"
                )
            end = int(expected[-1]) + int(sizes[-1]) * itemsize

    # -- access ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        """Sequence ``index`` as a read-only numpy view; a contiguous slice gives a list of them."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an IndexedDataset must be contiguous, got {index}")
            return [self.get(i) for i in range(start, stop)]
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end if no length)."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sequence {index} out of range for {self.prefix!r} ({n} sequences)")
        index = int(index) % n
        size = int(self._sizes[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {index} "
                f"of {self.prefix!r}, which has {size} tokens"
            )
        start = int(self._pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 tokens per sequence (a read-only view of the .idx)."""
        return self._sizes

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of each sequence in the .bin."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 first sequence of each document, starting with 0 and ending with ``len(self)``."""
        return self._doc_index

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole dataset."""
        return len(self._tokens)

    def __getstate__(self) -> dict:
        # Memory maps do not pickle; a copy in another process re-opens (and re-checks) the files.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}: {len(self)} sequences, "
            f"{len(self._doc_index) - 1} documents, {self.num_tokens} tokens of {self.dtype})"
        )


def check_indexed_dataset(
    prefix: str, vocab_size: int | None = None, chunk_tokens: int = 1 << 26
) -> IndexedDataset:
    """Opens ``prefix`` and checks everything a training run will rely on (`check_tokens`);
    returns the dataset.

    Raises:
        FileNotFoundError: a file of the pair is missing.
        IndexedDatasetError: one line naming the file and what is wrong with it.
    """
    return check_tokens(IndexedDataset(prefix), vocab_size, chunk_tokens)


def check_tokens(
    dataset: IndexedDataset, vocab_size: int | None = None, chunk_tokens: int = 1 << 26
) -> IndexedDataset:
    """Checks the tokens of an opened dataset; returns it.

    Beyond the checks that opening made (header, dtype code, both file sizes against the sizes,
    document index, sequence pointers the running sum of the sizes), this checks that the tokens
    are integers and, with ``vocab_size``, reads the whole token stream: every token id is in
    ``[0, vocab_size)``. The .bin is read once, ``chunk_tokens`` at a time (memory stays
    flat); a uint8/uint16 stream whose largest value fits the vocabulary is not read at all.

    Raises:
        IndexedDatasetError: one line naming the file and what is wrong with it.
    """
    idx_file, bin_file = idx_path(dataset.prefix), bin_path(dataset.prefix)
    if dataset.dtype.kind not in "iu":
        raise IndexedDatasetError(
            f"{idx_file}: token dtype {dataset.dtype} is not an integer type; token ids are "
            "stored as integers (dtype codes 1-5 and 8)"
        )
    pointers = dataset.sequence_pointers
    if vocab_size is None:
        return dataset
    if dataset.dtype.kind == "u" and np.iinfo(dataset.dtype).max < vocab_size:
        return dataset  # every value the dtype can hold is a valid id
    tokens = dataset._tokens
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start : start + chunk_tokens]
        low = int(chunk.min()) if dataset.dtype.kind == "i" else 0
        if low < 0 or int(chunk.max()) >= vocab_size:
            offset = start + int(np.argmax((chunk < 0) | (chunk >= vocab_size)))
            bad = int(tokens[offset])
            sequence = int(np.searchsorted(pointers, offset * dataset.dtype.itemsize, "right")) - 1
            raise IndexedDatasetError(
                f"{bin_file}: token id {bad} (sequence {sequence}, token {offset} of the file) "
                f"is outside the vocabulary [0, {vocab_size}): the data was tokenized with "
                "another tokenizer, or the vocabulary is too small"
            )
    return dataset


def holds_token(dataset: IndexedDataset, token_id: int, chunk_tokens: int = 1 << 26) -> bool:
    """Whether any token of `dataset` is `token_id`. The stream is read until the first one: 65,536
    tokens, then `chunk_tokens` at a time (a dataset with an EOD after every document is
    answered from its first documents; one without is read to its end)."""
    tokens = dataset._tokens
    kind = np.iinfo(dataset.dtype) if dataset.dtype.kind in "iu" else None
    if kind is not None and not kind.min <= token_id <= kind.max:
        return False
    start, size = 0, min(1 << 16, chunk_tokens)
    while start < len(tokens):
        if np.any(tokens[start : start + size] == token_id):
            return True
        start, size = start + size, chunk_tokens
    return False


def token_counts(dataset: IndexedDataset, size: int, chunk_tokens: int = 1 << 26) -> np.ndarray:
    """How often each id occurs in `dataset`, a vector of `size` counts (ids >= `size` are an
    IndexedDatasetError naming the largest); read `chunk_tokens` at a time."""
    tokens = dataset._tokens
    counts = np.zeros(size, dtype=np.int64)
    for start in range(0, len(tokens), chunk_tokens):
        chunk = np.asarray(tokens[start : start + chunk_tokens], dtype=np.int64)
        if chunk.size and (chunk.min() < 0 or chunk.max() >= size):
            raise IndexedDatasetError(
                f"{bin_path(dataset.prefix)}: token ids {chunk.min()}..{chunk.max()} are outside "
                f"[0, {size})"
            )
        counts += np.bincount(chunk, minlength=size)
    return counts


def _describe_size_mismatch(actual: int, expected: int, num_sequences: int) -> str:
    if actual < expected:
        return f"truncated: {actual} bytes"
    if actual - expected == num_sequences:
        return (
            f"{actual} bytes, {num_sequences} more than expected: a multimodal index with "
            "per-sequence modes, which bloomnative does not read"
        )
    return f"{actual - expected} unexpected trailing bytes ({actual} bytes)"

"""Megatron's MMIDIDX on-disk format: the constants and dtype codes shared by reader and writer.

A dataset is a pair of files that share a prefix:

``<prefix>.bin``
    The token stream: every sequence's tokens back to back, in the token dtype, no header.

``<prefix>.idx``, all integers little-endian::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version, always 1
    u8        dtype code of the tokens (see ``DTYPE_CODES``)
    u64       sequence count N
    u64       document-index length D (number of documents + 1)
    N x i32   sequence lengths, in tokens
    N x i64   sequence pointers, in bytes from the start of the .bin
    D x i64   document index: the first sequence of each document, starting with 0 and
              ending with N (Megatron writes ``[0]`` then appends N after every document)

This is the layout written and read by Megatron-LM (``megatron/core/datasets/indexed_dataset.py``)
and Megatron-DeepSpeed (``megatron/data/indexed_dataset.py``, the ``mmap`` implementation).
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1

# magic, version, dtype code, sequence count, document-index length: 34 bytes, no padding.
HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}

# Megatron's DType.optimal_dtype: uint16 below this many token ids, int32 from here on.
UINT16_VOCAB_LIMIT = 65_500


def dtype_code(dtype: np.dtype | type) -> int:
    """The MMIDIDX code of a token dtype; raises ValueError for a dtype the format cannot hold."""
    dtype = np.dtype(dtype)
    for code, known in DTYPE_CODES.items():
        if known == dtype:
            return code
    valid = ", ".join(str(d) for d in DTYPE_CODES.values())
    raise ValueError(f"token dtype {dtype} has no MMIDIDX code; valid dtypes: {valid}")


def optimal_token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65,500 ids, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < UINT16_VOCAB_LIMIT else np.dtype(np.int32)


def sequence_pointers(sizes: np.ndarray, itemsize: int) -> np.ndarray:
    """The .idx pointers: each sequence's byte offset in the .bin (int64), the sizes before it
    times the token size."""
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    return pointers * itemsize


def write_index(stream, sizes: np.ndarray, doc_index: np.ndarray, dtype: np.dtype) -> None:
    """Writes a .idx file to `stream`: header, sizes (int32), pointers (int64) and document
    index (int64), little-endian."""
    stream.write(HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(sizes), len(doc_index)))
    stream.write(sizes.astype("<i4", copy=False).tobytes())
    pointers = sequence_pointers(sizes, np.dtype(dtype).itemsize)
    stream.write(pointers.astype("<i8", copy=False).tobytes())
    stream.write(doc_index.astype("<i8", copy=False).tobytes())


def index_file_size(num_sequences: int, document_index_length: int) -> int:
    """The exact size in bytes of a well-formed .idx file with these counts."""
    return HEADER.size + num_sequences * (4 + 8) + document_index_length * 8


def idx_path(prefix: str) -> str:
    """The index file of a dataset prefix (``data/corpus_text_document`` -> ``...idx``)."""
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    """The token file of a dataset prefix."""
    return prefix + ".bin"

"""Write a Megatron MMIDIDX dataset, atomically: nothing appears under the final names until
``finalize`` succeeds, so a crash or an error never leaves a half-written dataset behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from array import array
from types import TracebackType

import numpy as np

from bloomnative.data.indexed_dataset import IndexedDataset
from bloomnative.data.indexed_format import (
    bin_path,
    dtype_code,
    idx_path,
    optimal_token_dtype,
    write_index,
)

_INT32_MAX = np.iinfo(np.int32).max
# The in-memory index arrays are reinterpreted as int32 / int64 by numpy when written.
assert array("i").itemsize == 4 and array("q").itemsize == 8


class IndexedDatasetBuilder:
    """Append sequences and documents, then ``finalize()`` into ``<prefix>.bin`` / ``.idx``.

    Usable as a context manager: leaving the block normally finalizes, leaving it with an
    exception aborts (the temporary files are removed and an existing dataset is untouched)::

        with IndexedDatasetBuilder("out/corpus_text_document", vocab_size=50_257) as builder:
            for tokens in documents:
                builder.add_document(tokens)

    Args:
        prefix: output path without extension.
        dtype: token dtype; by default chosen from ``vocab_size`` the way Megatron does
            (uint16 below 65,500 ids, else int32), or int32 without a vocabulary size.
        vocab_size: number of token ids, used to pick the dtype when none is given.
    """

    def __init__(
        self,
        prefix: str,
        dtype: np.dtype | type | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.prefix = str(prefix)
        if dtype is None:
            dtype = optimal_token_dtype(vocab_size) if vocab_size else np.int32
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # rejects a dtype the format cannot store, before any file exists
        self._sizes = array("i")  # int32 sequence lengths
        self._doc_index = array("q", [0])  # int64 first sequence of each document
        directory = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(directory, exist_ok=True)
        name = os.path.basename(self.prefix)
        fd, self._tmp_bin = tempfile.mkstemp(prefix=f".{name}.", suffix=".bin.tmp", dir=directory)
        self._bin = os.fdopen(fd, "wb", buffering=1 << 20)
        self._closed = False

    # -- appending -----------------------------------------------------------------------------

    def add_item(self, tokens: np.ndarray | list[int]) -> None:
        """Append one sequence (it joins the current document until ``end_document``)."""
        self._check_open()
        array_ = self._as_token_array(tokens)
        if array_.size > _INT32_MAX:
            raise ValueError(f"a sequence of {array_.size} tokens does not fit the int32 length")
        self._bin.write(array_.tobytes(order="C"))
        self._sizes.append(array_.size)

    def end_document(self) -> None:
        """Close the current document (the sequences added since the previous one)."""
        self._check_open()
        self._doc_index.append(len(self._sizes))

    def add_document(
        self, tokens: np.ndarray | list[int], lengths: list[int] | None = None
    ) -> None:
        """Append a whole document: one sequence, or several when ``lengths`` splits it."""
        if lengths is None:
            self.add_item(tokens)
        else:
            array_ = self._as_token_array(tokens)
            if sum(lengths) != array_.size:
                raise ValueError(
                    f"lengths {lengths} add up to {sum(lengths)}, the document has {array_.size}"
                )
            for part in np.split(array_, np.cumsum(lengths)[:-1]):
                self.add_item(part)
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every document of another MMIDIDX dataset (Megatron's merge)."""
        self._check_open()
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {prefix!r}: its tokens are {other.dtype}, this builder writes "
                f"{self.dtype}; merge datasets of the same dtype"
            )
        offset = len(self._sizes)
        self._sizes.frombytes(other.sequence_lengths.astype(np.int32).tobytes())
        self._doc_index.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())
        self._bin.flush()
        with open(bin_path(prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, length=16 << 20)

    # -- finishing -------------------------------------------------------------------------------

    def finalize(self) -> None:
        """Write the index and move both files to their final names.

        An existing ``.idx`` is removed before the new ``.bin`` replaces the old one, so an
        interruption between the two renames leaves a missing index (an error at open time),
        never a stale index paired with new tokens.
        """
        self._check_open()
        if self._doc_index[-1] != len(self._sizes):
            # Sequences added with add_item but never closed: they form the last document.
            self._doc_index.append(len(self._sizes))
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        directory = os.path.dirname(self._tmp_bin)
        fd, tmp_idx = tempfile.mkstemp(
            prefix=f".{os.path.basename(self.prefix)}.", suffix=".idx.tmp", dir=directory
        )
        try:
            with os.fdopen(fd, "wb") as idx:
                self._write_index(idx)
                idx.flush()
                os.fsync(idx.fileno())
            for path in (self._tmp_bin, tmp_idx):
                _make_readable(path)
            final_idx = idx_path(self.prefix)
            if os.path.exists(final_idx):
                os.remove(final_idx)
            os.replace(self._tmp_bin, bin_path(self.prefix))
            os.replace(tmp_idx, final_idx)
        except BaseException:
            _remove_quietly(tmp_idx)
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Drop everything written so far; an existing dataset under the prefix is untouched."""
        if not self._bin.closed:
            self._bin.close()
        _remove_quietly(self._tmp_bin)
        self._closed = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def __del__(self) -> None:
        # A builder dropped without finalize() must not leave its temporary file behind.
        if not getattr(self, "_closed", True):
            self.abort()

    @property
    def num_sequences(self) -> int:
        return len(self._sizes)

    @property
    def num_documents(self) -> int:
        return len(self._doc_index) - 1

    # -- internals ---------------------------------------------------------------------------------

    def _write_index(self, stream) -> None:
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if self._sizes else np.empty(0, np.int32)
        write_index(stream, sizes, np.frombuffer(self._doc_index, dtype=np.int64), self.dtype)

    def _as_token_array(self, tokens: np.ndarray | list[int]) -> np.ndarray:
        source = np.asarray(tokens)
        if source.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {source.shape}")
        if source.dtype == self.dtype:
            return source
        if source.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = source.min(), source.max()
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids span [{low}, {high}], which {self.dtype} cannot hold "
                    f"([{info.min}, {info.max}]); build with a wider dtype (int32 for "
                    "vocabularies of 65,500 ids or more)"
                )
        return source.astype(self.dtype)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the builder for {self.prefix!r} is already finalized or aborted")


def _make_readable(path: str) -> None:
    """Give a temporary file (created 0600) the permissions a plain ``open`` would have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass

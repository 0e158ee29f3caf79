"""The MMIDIDX format: exact bytes, round trips, Megatron interoperability, and corrupt files
failing at open time with the file and the problem named."""

from __future__ import annotations

import os
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from bloomnative.data import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    optimal_token_dtype,
)

FIXTURES = Path(__file__).parent / "fixtures"
SPEC_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}

# Documents of sequences, as Megatron's builder writes them in fixtures/README.md.
FIXTURE_DOCUMENTS = {
    "uint16": [[[65001, 65002, 65003]], [[7], [8, 9]], [[10, 11], [12, 13, 14]], [[0, 65004]]],
    "int32": [[[250001, 250002, 250003]], [[7], [8, 9]], [[10, 11], [12, 13, 14]], [[0, 250004]]],
}


# -- an independent implementation of the format, straight from docs/data.md's table ----------


def spec_idx_bytes(sizes: list[int], doc_index: list[int], code: int) -> bytes:
    """The .idx bytes of the format definition, built with struct/numpy only."""
    itemsize = np.dtype(SPEC_DTYPES[code]).itemsize
    pointers = [0]
    for size in sizes[:-1]:
        pointers.append(pointers[-1] + size * itemsize)
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(sizes))
        + struct.pack("<Q", len(doc_index))
        + np.array(sizes, dtype="<i4").tobytes()
        + np.array(pointers[: len(sizes)], dtype="<i8").tobytes()
        + np.array(doc_index, dtype="<i8").tobytes()
    )


def spec_write(prefix: Path, documents: list[list[list[int]]], code: int) -> None:
    sizes = [len(seq) for doc in documents for seq in doc]
    doc_index = [0]
    for doc in documents:
        doc_index.append(doc_index[-1] + len(doc))
    tokens = [t for doc in documents for seq in doc for t in seq]
    Path(f"{prefix}.bin").write_bytes(np.array(tokens, dtype=SPEC_DTYPES[code]).tobytes())
    Path(f"{prefix}.idx").write_bytes(spec_idx_bytes(sizes, doc_index, code))


def spec_read(prefix: Path) -> tuple[int, list[list[list[int]]]]:
    """A minimal reader following the format definition: (dtype code, documents)."""
    idx = Path(f"{prefix}.idx").read_bytes()
    magic, version, code, n, d = struct.unpack_from("<9sQBQQ", idx, 0)
    assert (magic, version) == (b"MMIDIDX\x00\x00", 1)
    sizes = np.frombuffer(idx, "<i4", n, 34)
    pointers = np.frombuffer(idx, "<i8", n, 34 + 4 * n)
    doc_index = np.frombuffer(idx, "<i8", d, 34 + 12 * n)
    data = Path(f"{prefix}.bin").read_bytes()
    sequences = [
        np.frombuffer(data, SPEC_DTYPES[code], int(s), int(p)).tolist()
        for s, p in zip(sizes, pointers, strict=True)
    ]
    documents = [sequences[a:b] for a, b in zip(doc_index[:-1], doc_index[1:], strict=True)]
    return code, documents


def write_with_builder(prefix: Path, documents: list[list[list[int]]], **kwargs) -> None:
    with IndexedDatasetBuilder(str(prefix), **kwargs) as builder:
        for doc in documents:
            for sequence in doc:
                builder.add_item(sequence)
            builder.end_document()


def read_documents(dataset: IndexedDataset) -> list[list[list[int]]]:
    index = dataset.document_indices
    return [
        [dataset[i].tolist() for i in range(a, b)]
        for a, b in zip(index[:-1], index[1:], strict=True)
    ]


# -- exact bytes and round trips ---------------------------------------------------------------


@pytest.mark.parametrize(("vocab_size", "code"), [(8192, 8), (65_499, 8), (250_880, 4)])
def test_writer_produces_the_exact_bytes_of_the_format_definition(tmp_path, vocab_size, code):
    documents = [[[1, 2, 3]], [[vocab_size - 1], [5, 6]], [[7, 8, 9, 10]]]
    write_with_builder(tmp_path / "d", documents, vocab_size=vocab_size)
    sizes = [3, 1, 2, 4]
    assert (tmp_path / "d.idx").read_bytes() == spec_idx_bytes(sizes, [0, 1, 3, 4], code)
    tokens = [1, 2, 3, vocab_size - 1, 5, 6, 7, 8, 9, 10]
    expected_bin = np.array(tokens, dtype=SPEC_DTYPES[code]).tobytes()
    assert (tmp_path / "d.bin").read_bytes() == expected_bin


def test_token_dtype_is_uint16_below_65500_ids_and_int32_from_there():
    assert optimal_token_dtype(65_499) == np.uint16
    assert optimal_token_dtype(65_500) == np.int32
    assert optimal_token_dtype(250_880) == np.int32


@pytest.mark.parametrize("vocab_size", [50_257, 250_880])
def test_round_trip_preserves_tokens_sequences_and_documents(tmp_path, vocab_size):
    rng = np.random.default_rng(0)
    documents = [
        [
            rng.integers(0, vocab_size, rng.integers(0, 40)).tolist()
            for _ in range(rng.integers(1, 4))
        ]
        for _ in range(50)
    ]
    write_with_builder(tmp_path / "d", documents, vocab_size=vocab_size)
    dataset = IndexedDataset(str(tmp_path / "d"))
    assert dataset.dtype == optimal_token_dtype(vocab_size)
    assert len(dataset) == sum(len(doc) for doc in documents)
    assert read_documents(dataset) == documents
    assert dataset.num_tokens == sum(len(s) for doc in documents for s in doc)


def test_items_are_views_of_the_memory_map_and_get_slices_a_sequence(tmp_path):
    write_with_builder(tmp_path / "d", [[[1, 2, 3, 4, 5]], [[6, 7]]], vocab_size=100)
    dataset = IndexedDataset(str(tmp_path / "d"))
    item = dataset[0]
    assert not item.flags.owndata and not item.flags.writeable  # a read-only view, no copy
    assert dataset.get(0, 1, 3).tolist() == [2, 3, 4]
    assert dataset.get(0, 3).tolist() == [4, 5]
    assert dataset[-1].tolist() == [6, 7]
    assert [x.tolist() for x in dataset[0:2]] == [[1, 2, 3, 4, 5], [6, 7]]
    with pytest.raises(IndexError, match="out of range"):
        dataset.get(1, 1, 5)
    with pytest.raises(IndexError, match="2 sequences"):
        dataset[2]


def test_dataset_pickles_by_reopening_its_files(tmp_path):
    write_with_builder(tmp_path / "d", [[[1, 2]], [[3]]], vocab_size=100)
    copy = pickle.loads(pickle.dumps(IndexedDataset(str(tmp_path / "d"))))
    assert read_documents(copy) == [[[1, 2]], [[3]]]


def test_multi_sequence_documents_via_add_document_lengths(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "d"), vocab_size=100) as builder:
        builder.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
        builder.add_document([6])
    dataset = IndexedDataset(str(tmp_path / "d"))
    assert dataset.document_indices.tolist() == [0, 2, 3]
    assert read_documents(dataset) == [[[1, 2], [3, 4, 5]], [[6]]]


# -- Megatron interoperability -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["uint16", "int32"])
def test_files_written_by_megatron_load_unchanged(name):
    dataset = IndexedDataset(str(FIXTURES / f"megatron_{name}"))
    assert dataset.dtype == np.dtype(name)
    assert read_documents(dataset) == FIXTURE_DOCUMENTS[name]


@pytest.mark.parametrize("name", ["uint16", "int32"])
def test_our_writer_reproduces_megatron_files_byte_for_byte(tmp_path, name):
    vocab_size = 65_499 if name == "uint16" else 250_880
    write_with_builder(tmp_path / "d", FIXTURE_DOCUMENTS[name], vocab_size=vocab_size)
    for ext in (".idx", ".bin"):
        ours = (tmp_path / f"d{ext}").read_bytes()
        assert ours == (FIXTURES / f"megatron_{name}{ext}").read_bytes()


def test_an_independent_spec_reader_loads_our_files(tmp_path):
    documents = [[[3, 1, 4]], [[1, 5], [9]], [[]], [[2, 6, 5, 3]]]
    write_with_builder(tmp_path / "d", documents, vocab_size=10)
    assert spec_read(tmp_path / "d") == (8, documents)


def test_megatron_reader_loads_our_files(tmp_path):
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    documents = [[[3, 1, 4]], [[1, 5], [9]], [[2, 6, 5, 3]]]
    write_with_builder(tmp_path / "d", documents, vocab_size=250_880)
    dataset = megatron.IndexedDataset(str(tmp_path / "d"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        [3, 1, 4],
        [1, 5],
        [9],
        [2, 6, 5, 3],
    ]
    assert dataset.document_indices.tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize("code", sorted(SPEC_DTYPES))
def test_reader_accepts_every_megatron_dtype_code(tmp_path, code):
    documents = [[[1, 2, 3]], [[4]], [[5, 6]]]
    spec_write(tmp_path / "d", documents, code)
    dataset = IndexedDataset(str(tmp_path / "d"))
    assert dataset.dtype == np.dtype(SPEC_DTYPES[code])
    assert read_documents(dataset) == documents


def test_add_index_merges_datasets_like_writing_them_in_one_go(tmp_path):
    first, second = [[[1, 2]], [[3], [4, 5]]], [[[6]], [[7, 8, 9]]]
    write_with_builder(tmp_path / "a", first, vocab_size=100)
    write_with_builder(tmp_path / "b", second, vocab_size=100)
    write_with_builder(tmp_path / "ab", first + second, vocab_size=100)
    with IndexedDatasetBuilder(str(tmp_path / "merged"), vocab_size=100) as builder:
        builder.add_index(str(tmp_path / "a"))
        builder.add_index(str(tmp_path / "b"))
    for ext in (".idx", ".bin"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"ab{ext}").read_bytes()


def test_add_index_refuses_a_dataset_of_another_dtype(tmp_path):
    write_with_builder(tmp_path / "wide", [[[70_000]]], vocab_size=250_880)
    with IndexedDatasetBuilder(str(tmp_path / "narrow"), vocab_size=100) as builder:
        with pytest.raises(ValueError, match="int32.*uint16"):
            builder.add_index(str(tmp_path / "wide"))
        builder.abort()


# -- atomic writes -------------------------------------------------------------------------------


def test_a_failed_build_leaves_no_files_and_keeps_the_existing_dataset(tmp_path):
    write_with_builder(tmp_path / "d", [[[1, 2, 3]]], vocab_size=100)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        with IndexedDatasetBuilder(str(tmp_path / "d"), vocab_size=100) as builder:
            builder.add_item([4, 5])
            raise RuntimeError("tokenizer crashed")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    with pytest.raises(ValueError, match=r"\[5, 70000\].*uint16"):
        with IndexedDatasetBuilder(str(tmp_path / "other"), vocab_size=100) as builder:
            builder.add_item([5, 70_000])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


# -- corrupt and mismatched files ---------------------------------------------------------------


def _good_pair(tmp_path: Path) -> Path:
    write_with_builder(tmp_path / "d", [[[1, 2, 3]], [[4, 5]], [[6]]], vocab_size=100)
    return tmp_path / "d"


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _truncate(path: Path, drop: int) -> None:
    path.write_bytes(path.read_bytes()[:-drop])


def _append(path: Path, extra: bytes) -> None:
    path.write_bytes(path.read_bytes() + extra)


CORRUPTIONS = {
    "bad magic": (lambda p: _patch(p.with_suffix(".idx"), 0, b"NOTANIDX\x00"), ".idx", "bad magic"),
    "legacy format": (
        lambda p: _patch(p.with_suffix(".idx"), 0, b"TNTIDX\x00\x00\x00"),
        ".idx",
        "TNTIDX",
    ),
    "bad version": (
        lambda p: _patch(p.with_suffix(".idx"), 9, struct.pack("<Q", 2)),
        ".idx",
        "version 2",
    ),
    "bad dtype": (lambda p: _patch(p.with_suffix(".idx"), 17, b"\x09"), ".idx", "dtype code 9"),
    "truncated header": (
        lambda p: p.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00\x01"),
        ".idx",
        "truncated",
    ),
    "truncated arrays": (lambda p: _truncate(p.with_suffix(".idx"), 8), ".idx", "truncated"),
    "trailing bytes": (lambda p: _append(p.with_suffix(".idx"), b"12345"), ".idx", "trailing"),
    # Three sequences, three extra bytes: Megatron's multimodal per-sequence modes.
    "multimodal": (lambda p: _append(p.with_suffix(".idx"), b"\0\1\0"), ".idx", "multimodal"),
    "truncated bin": (lambda p: _truncate(p.with_suffix(".bin"), 2), ".bin", "truncated"),
    "longer bin": (lambda p: _append(p.with_suffix(".bin"), b"\0\0"), ".bin", "belong together"),
    "document index": (
        lambda p: _patch(p.with_suffix(".idx"), 34 + 12 * 3 + 8 * 3, struct.pack("<q", 2)),
        ".idx",
        "document index",
    ),
    "negative length": (
        lambda p: _patch(p.with_suffix(".idx"), 34, struct.pack("<i", -3)),
        ".idx",
        "sequence lengths",
    ),
    "pointers": (
        lambda p: _patch(p.with_suffix(".idx"), 34 + 12 + 8, struct.pack("<q", 5)),
        ".idx",
        "pointers",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_files_fail_at_open_naming_the_file_and_the_problem(tmp_path, case):
    prefix = _good_pair(tmp_path)
    corrupt, suffix, phrase = CORRUPTIONS[case]
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError) as error:
        IndexedDataset(str(prefix))
    assert str(prefix.with_suffix(suffix)) in str(error.value)
    assert phrase in str(error.value)


def test_a_bin_from_another_dataset_is_detected(tmp_path):
    prefix = _good_pair(tmp_path)
    write_with_builder(tmp_path / "other", [[[1, 2, 3, 4, 5, 6, 7]]], vocab_size=100)
    shutil.copy(tmp_path / "other.bin", prefix.with_suffix(".bin"))
    with pytest.raises(IndexedDatasetError, match="belong together"):
        IndexedDataset(str(prefix))


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_a_missing_file_is_named(tmp_path, missing):
    prefix = _good_pair(tmp_path)
    os.remove(prefix.with_suffix(missing))
    with pytest.raises(FileNotFoundError, match=str(prefix.with_suffix(missing))):
        IndexedDataset(str(prefix))

"""check_indexed_dataset: the whole-file checks preflight runs on every dataset of a blend, on
files written byte by byte here (not by our builder) so each defect is exactly the one named."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from bloomnative.data import (
    IndexedDataset,
    IndexedDatasetError,
    build_gpt_datasets,
    check_gpt_datasets,
    check_indexed_dataset,
)
from bloomnative.data.indexed_dataset import holds_token

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "assets" / "pydocs" / "pydocs_text_document"
CODES = {np.dtype(np.int32): 4, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}


def write_pair(prefix: Path, sequences: list[np.ndarray], pointers: list[int] | None = None):
    """One document per sequence; `pointers` replaces the byte offsets the sizes imply."""
    dtype = sequences[0].dtype
    sizes = [len(s) for s in sequences]
    implied = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * dtype.itemsize
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, CODES[dtype], len(sizes), len(sizes) + 1)
    prefix.with_suffix(".idx").write_bytes(
        header
        + np.array(sizes, "<i4").tobytes()
        + np.array(implied if pointers is None else pointers, "<i8").tobytes()
        + np.arange(len(sizes) + 1, dtype="<i8").tobytes()
    )
    prefix.with_suffix(".bin").write_bytes(np.concatenate(sequences).tobytes())
    return str(prefix)


def test_the_bundled_corpus_fits_its_vocabulary():
    dataset = check_indexed_dataset(str(BUNDLED), vocab_size=8192)
    assert dataset.num_tokens == 1_253_183


@pytest.mark.parametrize("chunk_tokens", [7, 1 << 26])
@pytest.mark.parametrize("bad", [1500, -3])
def test_the_first_token_outside_the_vocabulary_is_named_with_its_sequence(
    tmp_path, chunk_tokens, bad
):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 1000, n).astype(np.int32) for n in (5, 9, 4, 11)]
    sequences[2][3] = bad  # token 5 + 9 + 3 = 17 of the file
    sequences[3][0] = 2000  # a later one is not the one reported
    prefix = write_pair(tmp_path / "d", sequences)
    with pytest.raises(IndexedDatasetError) as error:
        check_indexed_dataset(prefix, vocab_size=1000, chunk_tokens=chunk_tokens)
    message = str(error.value)
    assert message.startswith(f"{prefix}.bin: token id {bad} (sequence 2, token 17 of the file)")
    assert "[0, 1000)" in message and "\n" not in message
    assert check_indexed_dataset(prefix, vocab_size=None).num_tokens == 29


def test_pointers_that_do_not_follow_the_sizes_are_reported(tmp_path):
    sequences = [np.array([1, 2], np.uint16)] * 3
    # First at 0, last ending at the .bin's end, multiples of 2: opening accepts them.
    prefix = write_pair(tmp_path / "d", sequences, pointers=[0, 2, 8])
    with pytest.raises(IndexedDatasetError) as error:
        check_indexed_dataset(prefix)
    assert str(error.value) == (
        f"{prefix}.idx: corrupt sequence pointers: sequence 1 starts at byte 2, but the sizes "
        "before it add up to byte 4"
    )


def test_a_float_token_stream_is_refused(tmp_path):
    prefix = write_pair(tmp_path / "d", [np.array([1.0, 2.0], np.float32)])
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: token dtype float32 is not an integ"):
        check_indexed_dataset(prefix, vocab_size=10)


def test_the_dataset_api_refuses_sizes_that_overrun_the_bin(tmp_path):
    """Sizes rewritten so that sequence 1 runs 20 tokens past the end of the .bin, while the
    total, the first pointer and the end of the last sequence still match the file: without
    preflight, build_gpt_datasets would serve it cut short."""
    sequences = [np.zeros(0, np.uint16), np.arange(50, dtype=np.uint16), np.ones(10, np.uint16)]
    prefix = write_pair(tmp_path / "d", sequences, pointers=[0, 60, 100])  # of sizes 30, 20, 10
    with pytest.raises(IndexedDatasetError) as error:
        build_gpt_datasets(prefix, "1", seq_len=8, seed=1, num_samples=(4, 0, 0))
    assert str(error.value) == (
        f"{prefix}.idx: corrupt sequence pointers: sequence 1 starts at byte 60, but the sizes "
        "before it add up to byte 0"
    )


@pytest.mark.parametrize("chunk_tokens", [3, 1 << 26])
def test_holds_token_finds_a_token_anywhere_and_only_one_the_dtype_can_hold(tmp_path, chunk_tokens):
    sequences = [np.array([5, 6, 7], np.uint16), np.array([8, 9], np.uint16)]
    dataset = IndexedDataset(write_pair(tmp_path / "d", sequences))
    for token in (5, 7, 9):
        assert holds_token(dataset, token, chunk_tokens)
    for token in (0, 10, -1, 70_000):
        assert not holds_token(dataset, token, chunk_tokens)


def test_check_gpt_datasets_names_the_datasets_without_the_eod(tmp_path):
    with_eod = write_pair(tmp_path / "a", [np.array([5, 0, 7, 0], np.uint16)] * 5)
    without = write_pair(tmp_path / "b", [np.array([5, 6, 7], np.uint16)] * 5)
    checked = check_gpt_datasets(f"1 {with_eod} 1 {without}", "1", (4, 0, 0), eod_id=0)
    assert checked.without_eod == (without,)
    assert check_gpt_datasets(with_eod, "1", (4, 0, 0)).without_eod == ()

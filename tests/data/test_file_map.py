"""Datasets are mapped with no file descriptor left open (data/file_map.py), so a blend of any
size fits the limit of open files; the maps a blend holds are what preflight counts against
vm.max_map_count (`BlendCheck.maps`)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from bloomnative.data import (
    IndexedDataset,
    build_gpt_datasets,
    build_mtf_datasets,
    check_gpt_datasets,
    check_mtf_datasets,
)
from bloomnative.data.file_map import map_file, map_npy
from harness.indexed_data import random_documents, write_documents
from harness.mtf_pairs import labelled_pairs, random_pair_lengths, write_pairs

linux_only = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts descriptors and maps in /proc/self"
)


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def maps_under(folder: Path) -> int:
    """This process's memory maps of files under `folder`."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f" {folder}/" in line)


@linux_only
def test_a_mapped_file_keeps_no_descriptor_and_is_unmapped_with_its_last_view(tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 64)
    before = open_files()
    whole = map_file(path)
    part = whole[1000:1010].view(np.uint16)
    assert open_files() == before and maps_under(tmp_path) == 1
    assert not whole.flags.writeable and not part.flags.writeable
    assert part.tolist() == np.fromfile(path, np.uint16, 5, offset=1000).tolist()
    del whole
    gc.collect()
    assert maps_under(tmp_path) == 1  # the view still reads the pages
    assert part[0] == np.fromfile(path, np.uint16, 1, offset=1000)[0]
    del part
    gc.collect()
    assert maps_under(tmp_path) == 0


def test_an_empty_file_is_an_empty_array(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    empty = map_file(tmp_path / "empty")
    assert empty.shape == (0,) and not empty.flags.writeable


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.int64).reshape(4, 3),
        np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        np.array([], dtype=np.uint16),
        np.float32(2.5) * np.ones((2, 2, 2), np.float32),
        np.int64(7),
    ],
)
def test_a_mapped_npy_equals_np_load(tmp_path, array):
    path = tmp_path / "a.npy"
    np.save(path, array)
    mapped, loaded = map_npy(path), np.load(path, mmap_mode="r")
    assert mapped.dtype == loaded.dtype and mapped.shape == loaded.shape
    assert np.array_equal(mapped, loaded) and not mapped.flags.writeable
    assert mapped.flags.f_contiguous == loaded.flags.f_contiguous


def test_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        map_file(tmp_path / "nowhere")


@linux_only
def test_open_datasets_and_their_cached_indices_hold_no_descriptor(tmp_path):
    prefixes = [write_documents(tmp_path / f"d{i}", random_documents(30, seed=i)) for i in range(5)]
    before = open_files()
    datasets = [IndexedDataset(p) for p in prefixes]
    blend = " ".join(f"1 {p}" for p in prefixes)
    splits = build_gpt_datasets(blend, "80,20,0", 8, 1, (50, 10, 0), str(tmp_path / "cache"))
    assert open_files() == before
    assert splits[0][3].shape == (9,) and len(datasets[0][0]) == len(datasets[0].get(0))


@linux_only
@pytest.mark.parametrize("split", ["80,20,0", "1", "70,20,10"])
@pytest.mark.parametrize("count", [1, 3])
def test_the_maps_preflight_counts_are_the_maps_a_built_blend_holds(tmp_path, split, count):
    documents = [random_documents(40, seed=i) for i in range(count)]
    documents[-1][0] = np.array([], np.int64)  # empty sequences are not mapped, files are
    prefixes = [write_documents(tmp_path / f"d{i}", d) for i, d in enumerate(documents)]
    if count == 3:  # an empty .bin is not mapped: a dataset of one empty document
        prefixes.append(write_documents(tmp_path / "empty", [np.array([], np.int64)]))
    blend = " ".join(f"1 {p}" for p in prefixes[:count]) + f" 1 {prefixes[0]}:0:0.5"
    asked = (40, 5 if split != "1" else 0, 0)
    checked = check_gpt_datasets(blend, split, asked)
    built = build_gpt_datasets(blend, split, 8, 1, asked, str(tmp_path / "cache"))
    assert maps_under(tmp_path) == checked.maps
    del built
    gc.collect()
    assert maps_under(tmp_path) == 0


@linux_only
def test_the_maps_of_packed_pairs_are_counted_too(tmp_path):
    prefixes = [
        write_pairs(tmp_path / f"p{i}", *labelled_pairs(random_pair_lengths(60, i, 10)))
        for i in range(3)
    ]
    asked = (30, 4, 0)
    checked = check_mtf_datasets(prefixes, "80,20,0", 16, asked, weights=[1, 2, 3])
    built = build_mtf_datasets(
        prefixes, "80,20,0", 16, 1, asked, [1, 2, 3], str(tmp_path / "cache"), pad_id=0
    )
    assert maps_under(tmp_path) == checked.maps == 3 * 4 + 2 * (3 * 2 + 2)
    del built

"""The GPT sample index against a naive reference, its epoch rules, and its cache."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from bloomnative.data import GPTDataset, IndexedDataset, build_sample_index
from bloomnative.data import gpt_dataset as gpt_dataset_module
from bloomnative.data import index_cache as index_cache_module
from bloomnative.data.index_cache import cache_folder
from harness.indexed_data import random_documents, write_documents


def naive_samples(dataset: IndexedDataset, document_order, seq_len: int, count: int):
    """Sample k = tokens [k * seq_len, k * seq_len + seq_len] of the concatenated documents."""
    stream = np.concatenate([dataset[int(d)] for d in document_order]).astype(np.int64)
    return [stream[k * seq_len : k * seq_len + seq_len + 1] for k in range(count)]


@pytest.mark.parametrize(
    ("seq_len", "num_samples"), [(1, 50), (7, 0), (16, 900), (64, 30), (300, 100)]
)
def test_every_sample_is_the_right_tokens_of_the_shuffled_stream(
    small_corpus, seq_len, num_samples
):
    indexed = IndexedDataset(small_corpus)
    dataset = GPTDataset(indexed, (10, 190), seq_len, num_samples, seed=3)
    index = dataset.index
    expected = naive_samples(indexed, index.document_order, seq_len, index.num_samples)
    assert len(dataset) >= num_samples
    for i in range(len(dataset)):
        sample = dataset[i]
        assert sample.dtype == np.int64 and len(sample) == seq_len + 1
        np.testing.assert_array_equal(sample, expected[int(index.sample_order[i])])


def test_each_epoch_holds_every_document_once_and_every_sample_appears_once(small_corpus):
    sizes = IndexedDataset(small_corpus).sequence_lengths
    documents = np.arange(20, 120)
    index = build_sample_index(sizes, documents, seq_len=32, num_samples=700, seed=5)
    epochs = index.document_order.reshape(-1, len(documents))
    assert len(epochs) > 2
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), documents)
    assert not all((epoch == epochs[0]).all() for epoch in epochs[1:])  # reshuffled per epoch
    np.testing.assert_array_equal(np.sort(index.sample_order), np.arange(index.num_samples))


@pytest.mark.parametrize("num_samples", [0, 1, 100, 157, 158, 1000])
def test_the_index_covers_the_fewest_epochs_that_hold_the_samples(small_corpus, num_samples):
    sizes = IndexedDataset(small_corpus).sequence_lengths
    documents = np.arange(200)
    tokens = int(sizes.sum())
    seq_len = 32
    index = build_sample_index(sizes, documents, seq_len, num_samples, seed=0)
    epochs = len(index.document_order) // len(documents)
    assert index.num_samples == (epochs * tokens - 1) // seq_len >= num_samples
    assert epochs == 1 or ((epochs - 1) * tokens - 1) // seq_len < num_samples


def _epoch_blocks(sizes: np.ndarray, seq_len: int, last_epoch_share: float):
    tokens = int(sizes.sum())
    per_epoch = (tokens - 1) // seq_len
    earlier = (2 * tokens - 1) // seq_len  # samples held by the first two epochs
    return earlier, earlier + int(last_epoch_share * per_epoch)


def test_a_last_epoch_used_below_80_percent_is_shuffled_on_its_own(small_corpus):
    sizes = IndexedDataset(small_corpus).sequence_lengths
    earlier, num_samples = _epoch_blocks(sizes, seq_len=8, last_epoch_share=0.3)
    index = build_sample_index(sizes, np.arange(200), 8, num_samples, seed=1)
    assert len(index.document_order) == 3 * 200
    # The samples of the first two epochs come first (in random order), then the last epoch's.
    np.testing.assert_array_equal(np.sort(index.sample_order[:earlier]), np.arange(earlier))
    assert not (index.sample_order[:earlier] == np.arange(earlier)).all()


def test_a_last_epoch_used_above_80_percent_is_shuffled_with_the_rest(small_corpus):
    sizes = IndexedDataset(small_corpus).sequence_lengths
    earlier, num_samples = _epoch_blocks(sizes, seq_len=8, last_epoch_share=0.9)
    index = build_sample_index(sizes, np.arange(200), 8, num_samples, seed=1)
    assert len(index.document_order) == 3 * 200
    assert index.sample_order[:earlier].max() >= earlier


def test_the_seed_decides_the_order(small_corpus):
    sizes = IndexedDataset(small_corpus).sequence_lengths
    a, b, c = (build_sample_index(sizes, np.arange(200), 16, 500, s) for s in (7, 7, 8))
    for name in ("document_order", "sample_starts", "sample_order"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.sample_order, c.sample_order)


def test_an_index_over_a_billion_tokens_puts_every_sample_at_its_stream_offset():
    # Its build time is a benchmark (tools/bench_data.py --only index), not asserted here.
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1000, 2_000_000, dtype=np.int32)  # about 1e9 tokens
    index = build_sample_index(sizes, np.arange(len(sizes)), 2048, 400_000, seed=1)
    assert index.num_samples >= 400_000
    # Sample k starts at stream token k * seq_len, counted independently in int64.
    document_starts = np.concatenate([[0], np.cumsum(sizes[index.document_order], dtype=np.int64)])
    starts = document_starts[index.sample_starts[:, 0]] + index.sample_starts[:, 1]
    np.testing.assert_array_equal(starts, np.arange(len(starts), dtype=np.int64) * 2048)
    assert np.array_equal(np.sort(index.sample_order), np.arange(index.num_samples))


def test_single_epoch_index_is_identical_to_megatrons(small_corpus):
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    megatron_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    sizes = IndexedDataset(small_corpus).sequence_lengths
    documents = np.arange(5, 195, dtype=np.int32)
    ours = build_sample_index(sizes, documents, 16, 100, seed=11)
    rng = np.random.RandomState(11)
    doc_idx = megatron_gpt._build_document_index(documents, 1, rng, False)
    tokens = int(sizes[documents].sum())
    sample_idx = helpers.build_sample_idx(sizes, doc_idx, 16, 1, tokens, True, True)
    shuffle_idx = megatron_gpt._build_shuffle_index(len(sample_idx) - 1, len(sample_idx) - 1, rng)
    np.testing.assert_array_equal(ours.document_order, doc_idx)
    np.testing.assert_array_equal(ours.sample_order, shuffle_idx)
    # Megatron starts at (0, 0) even when the first document is empty; ours at its first token.
    np.testing.assert_array_equal(ours.sample_starts[1:], sample_idx[1:])


# -- the cache -------------------------------------------------------------------------------------


def _forbid_rebuild(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the sample index was rebuilt")

    monkeypatch.setattr(gpt_dataset_module, "build_sample_index", fail)


def test_a_cached_index_is_loaded_not_rebuilt(small_corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    indexed = IndexedDataset(small_corpus)
    first = GPTDataset(indexed, (0, 150), 16, 300, seed=2, cache_dir=str(cache))
    folders = list(cache.glob("gpt_sample_index-*[!k]"))
    assert len(folders) == 1
    mtime = folders[0].stat().st_mtime_ns
    _forbid_rebuild(monkeypatch)
    second = GPTDataset(indexed, (0, 150), 16, 300, seed=2, cache_dir=str(cache))
    assert folders[0].stat().st_mtime_ns == mtime
    assert [first[i].tolist() for i in range(20)] == [second[i].tolist() for i in range(20)]


@pytest.mark.parametrize(
    "change",
    [
        {"documents": (0, 149)},
        {"seq_len": 17},
        {"num_samples": 301},
        {"seed": 3},
    ],
)
def test_the_index_is_rebuilt_when_its_description_changes(small_corpus, tmp_path, change):
    cache = str(tmp_path / "cache")
    indexed = IndexedDataset(small_corpus)
    arguments = {"documents": (0, 150), "seq_len": 16, "num_samples": 300, "seed": 2}
    GPTDataset(indexed, cache_dir=cache, **arguments)
    GPTDataset(indexed, cache_dir=cache, **{**arguments, **change})
    assert len(list(Path(cache).glob("gpt_sample_index-*[!k]"))) == 2


def test_the_index_is_rebuilt_when_the_dataset_is_rewritten(tmp_path):
    cache = str(tmp_path / "cache")
    prefix = write_documents(tmp_path / "d", random_documents(50, seed=1))
    before = GPTDataset(IndexedDataset(prefix), (0, 50), 8, 10, seed=0, cache_dir=cache)
    time.sleep(0.01)
    prefix = write_documents(tmp_path / "d", random_documents(50, seed=2))
    after = GPTDataset(IndexedDataset(prefix), (0, 50), 8, 10, seed=0, cache_dir=cache)
    assert len(list(Path(cache).glob("gpt_sample_index-*[!k]"))) == 2
    assert after[0].tolist() != before[0].tolist()


def _build_in_child(prefix: str, cache: str, queue) -> None:
    dataset = GPTDataset(IndexedDataset(prefix), (0, 200), 16, 5000, seed=4, cache_dir=cache)
    queue.put(np.asarray(dataset.index.sample_order).tolist())


@pytest.mark.multiprocess
def test_concurrent_processes_build_once_and_never_read_half_files(small_corpus, tmp_path):
    cache = str(tmp_path / "cache")
    builds = tmp_path / "builds.log"
    real_build = gpt_dataset_module.build_sample_index

    def counting_build(*args, **kwargs):
        with open(builds, "a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # keep the others waiting on the lock
        return real_build(*args, **kwargs)

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    gpt_dataset_module.build_sample_index = counting_build  # inherited by the forked children
    try:
        children = [
            context.Process(target=_build_in_child, args=(small_corpus, cache, queue))
            for _ in range(4)
        ]
        for child in children:
            child.start()
        orders = [queue.get(timeout=60) for _ in children]
        for child in children:
            child.join(timeout=60)
    finally:
        gpt_dataset_module.build_sample_index = real_build
    assert all(child.exitcode == 0 for child in children)
    assert len(builds.read_text().split()) == 1
    assert all(order == orders[0] for order in orders)
    assert len([p for p in Path(cache).iterdir() if not p.name.endswith(".lock")]) == 1


def test_cache_folder_name_is_a_hash_of_the_description(tmp_path):
    description = {"kind": "gpt_sample_index", "seq_len": 16}
    assert cache_folder("c", description) == cache_folder("c", dict(reversed(description.items())))
    assert cache_folder("c", description) != cache_folder("c", {**description, "seq_len": 17})


def _rank_builds(rank: int, init_file: str, prefix: str, cache: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        dataset = GPTDataset(IndexedDataset(prefix), (0, 200), 16, 3000, seed=9, cache_dir=cache)
        queue.put((rank, np.asarray(dataset.index.sample_order).tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_under_torch_distributed_rank_0_builds_and_the_other_ranks_load(small_corpus, tmp_path):
    builds = tmp_path / "builds.log"
    real_build = gpt_dataset_module.build_sample_index

    def counting_build(*args, **kwargs):
        with open(builds, "a") as log:
            log.write("built\n")
        return real_build(*args, **kwargs)

    real_flock = index_cache_module.fcntl.flock

    def logging_flock(file, operation):
        with open(tmp_path / "locks.log", "a") as log:
            log.write("lock\n")
        return real_flock(file, operation)

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    arguments = (str(tmp_path / "init"), small_corpus, str(tmp_path / "cache"), queue)
    gpt_dataset_module.build_sample_index = counting_build
    index_cache_module.fcntl.flock = logging_flock
    try:
        ranks = [context.Process(target=_rank_builds, args=(r, *arguments)) for r in range(2)]
        for rank in ranks:
            rank.start()
        results = dict(queue.get(timeout=120) for _ in ranks)
        for rank in ranks:
            rank.join(timeout=60)
    finally:
        gpt_dataset_module.build_sample_index = real_build
        index_cache_module.fcntl.flock = real_flock
    assert [rank.exitcode for rank in ranks] == [0, 0]
    assert builds.read_text() == "built\n"
    # Rank 1 waited at the barrier and found the files: it never even queued for the lock.
    assert (tmp_path / "locks.log").read_text() == "lock\n"
    assert results[0] == results[1]

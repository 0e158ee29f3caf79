"""Packed (input, target) samples: the same packing as Megatron-DeepSpeed's
DecoderPackedMTFDataset, by hand and against its published algorithm; samples, blends, cache."""

from __future__ import annotations

import numpy as np
import pytest

from bloomnative.data import (
    BlendedDataset,
    MTFDataset,
    PairDataset,
    build_mtf_datasets,
    build_packing_index,
)
from bloomnative.data import mtf_dataset as mtf_dataset_module
from bloomnative.data.packing import close_rows
from harness.mtf_pairs import labelled_pairs, random_pair_lengths, write_pairs

PAD = 999


def megatron_deepspeed_packing(lengths, capacity: int, num_samples: int, seed: int):
    """``(shuffle_idx, sample_idx)`` as Megatron-DeepSpeed's ``_build_index_mappings`` builds
    them (bigscience-workshop/Megatron-DeepSpeed, megatron/data/decoder_packed_mtf_dataset.py,
    the version with the empty-row guard and the skip warning), transcribed from its published
    algorithm: one loop over the pairs of each epoch, epochs added while at most
    ``num_samples`` rows have closed. ``capacity`` is its ``seq_length`` (``args.seq_length +
    1`` in finetune_t0.py)."""
    rng = np.random.RandomState(seed)
    row_length, row_start, epoch = 0, 0, 0
    shuffles, samples = [], []
    while len(samples) <= num_samples:
        documents = np.arange(len(lengths), dtype=np.int64)
        rng.shuffle(documents)
        shuffles.append(documents)
        for j, document in enumerate(documents):
            position = epoch * len(documents) + j
            length = int(lengths[document])
            row_length += length
            if row_length > capacity:
                if position > row_start:
                    samples.append((row_start, position))
                row_start, row_length = position, length
                if length > capacity:  # skipped
                    row_start, row_length = position + 1, 0
        epoch += 1
    return np.concatenate(shuffles), np.array(samples, dtype=np.int64).reshape(-1, 2)


def test_rows_close_greedily_when_the_next_pair_does_not_fit():
    # By hand, 8 tokens per row: 3 + 4 = 7 fit, 9 does not (the row [0, 2) closes) and can
    # never fit (skipped); 2 + 2 + 2 = 6 fit, 5 does not: [3, 6) closes; 5 opens a row that
    # the stream ends inside.
    rows, open_start = close_rows(np.array([3, 4, 9, 2, 2, 2, 5]), capacity=8)
    assert rows.tolist() == [[0, 2], [3, 6]] and open_start == 6
    # A pair that fills the row exactly closes nothing until the next one arrives.
    rows, open_start = close_rows(np.array([8, 1, 7, 9, 9]), capacity=8)
    assert rows.tolist() == [[0, 1], [1, 3]] and open_start == 5


def test_rows_continue_across_epochs_and_epochs_are_added_until_enough_rows_closed():
    # Five pairs of 3 tokens, 7 per row: two pairs per row. Epoch 0 (positions 0-4) closes
    # [0, 2) and [2, 4); the row from 4 continues into epoch 1, which closes [4, 6), [6, 8);
    # 4 rows are not more than num_samples = 4, so epoch 2 closes [8, 10), [10, 12), [12, 14).
    index = build_packing_index(np.full(5, 3), capacity=7, num_samples=4, seed=11)
    assert index.sample_bounds.tolist() == [[2 * k, 2 * k + 2] for k in range(7)]
    rng = np.random.RandomState(11)  # one shuffle of arange(5) per epoch
    epochs = []
    for _ in range(3):
        order = np.arange(5, dtype=np.int64)
        rng.shuffle(order)
        epochs.append(order)
    assert index.pair_order.tolist() == np.concatenate(epochs).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_the_index_equals_megatron_deepspeeds_including_oversize_pairs_and_epochs(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 64))
    lengths = rng.integers(1, capacity * 5 // 4, int(rng.integers(5, 300)))  # some too long
    for num_samples in (0, 1, 7, int(rng.integers(50, 400))):
        index = build_packing_index(lengths, capacity, num_samples, seed)
        shuffle_idx, sample_idx = megatron_deepspeed_packing(lengths, capacity, num_samples, seed)
        assert np.array_equal(index.pair_order, shuffle_idx)
        assert np.array_equal(index.sample_bounds, sample_idx)
        assert index.num_samples > num_samples


def test_no_pair_that_fits_is_an_error_not_an_endless_loop():
    with pytest.raises(ValueError, match=r"none of the 3 pairs fits a sample of 4 tokens"):
        build_packing_index(np.array([5, 9, 6]), capacity=4, num_samples=1, seed=0)


# -- packed samples -------------------------------------------------------------------------------


def test_a_sample_is_its_pairs_inputs_then_targets_then_padding(tmp_path):
    # Pair 0: input [5, 6], target [7]; pair 1: input [8], target [9, 10]. Both (6 tokens) fit
    # a sample of 7 + 1; the row closes when the next epoch's first pair does not fit.
    prefix = write_pairs(tmp_path / "p", [[5, 6], [8]], [[7], [9, 10]])
    dataset = MTFDataset(PairDataset(prefix), (0, 2), seq_len=7, num_samples=0, seed=3, pad_id=PAD)
    first, second = dataset.index.pair_order[:2].tolist()
    assert dataset.index.sample_bounds[0].tolist() == [0, 2]
    expected = {  # by hand, for either order of the two pairs
        (0, 1): ([5, 6, 7, 8, 9, 10, PAD, PAD], [1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0]),
        (1, 0): ([8, 9, 10, 5, 6, 7, PAD, PAD], [1, 1, 1, 2, 2, 2, 0, 0], [1, 0, 0, 1, 1, 0, 0, 0]),
    }[(first, second)]
    sample = dataset[0]
    assert sample["tokens"].dtype == np.int64 and sample["segment_ids"].dtype == np.int64
    assert sample["is_inputs"].dtype == bool
    assert sample["tokens"].tolist() == expected[0]
    assert sample["segment_ids"].tolist() == expected[1]
    assert sample["is_inputs"].astype(int).tolist() == expected[2]


def _pair_ids(sample: dict) -> list[int]:
    """The pairs of a sample of labelled pairs, in order (each token is its pair's id)."""
    ids = []
    for segment in range(1, int(sample["segment_ids"].max()) + 1):
        tokens = sample["tokens"][sample["segment_ids"] == segment]
        assert len(set(tokens.tolist())) == 1
        ids.append(int(tokens[0]))
    return ids


def test_every_pair_of_an_epoch_is_used_once_and_oversize_pairs_never(tmp_path, capsys):
    lengths = random_pair_lengths(120, seed=5, longest=20)  # at most 30 tokens
    lengths[27], lengths[50] = (40, 5), (3, 60)  # longer than a sample of 33 tokens
    prefix = write_pairs(tmp_path / "p", *labelled_pairs(lengths))
    dataset = MTFDataset(PairDataset(prefix), (20, 120), 32, 200, seed=1, pad_id=PAD)
    assert dataset.skipped_pairs == 2
    warned = capsys.readouterr().err  # bloomnative's logger: warnings on stderr
    assert "2 of the 100 pairs" in warned and "longer than a sample of 33 tokens" in warned
    index = dataset.index
    assert len(index.pair_order) >= 300  # a few epochs
    used_in_epoch_0 = []
    for k in range(len(dataset)):
        start, end = index.sample_bounds[k].tolist()
        held = _pair_ids(dataset[k])
        # The sample holds exactly the pairs of its stream positions, in stream order.
        assert held == (20 + index.pair_order[start:end]).tolist()
        assert 27 not in held and 50 not in held
        used_in_epoch_0 += [20 + int(index.pair_order[p]) for p in range(start, min(end, 100))]
    # Epoch 0 is stream positions 0-99: every pair once, but the two that never fit.
    assert sorted(used_in_epoch_0) == sorted(set(range(20, 120)) - {27, 50})


def test_oversize_pairs_are_skipped_and_counted_in_a_warning(tmp_path, capsys):
    lengths = [(3, 2)] * 20 + [(30, 1), (2, 40)]
    prefix = write_pairs(tmp_path / "p", *labelled_pairs(lengths))
    dataset = MTFDataset(PairDataset(prefix), (0, 22), 15, 10, seed=0, pad_id=PAD)
    assert dataset.skipped_pairs == 2
    message = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(message) == 1 and "2 of the 22 pairs" in message[0]
    assert "the longest has 42" in message[0]
    held = {i for k in range(len(dataset)) for i in _pair_ids(dataset[k])}
    assert held == set(range(20))


# -- blends, splits and the cache -----------------------------------------------------------------


def _two_pair_sets(tmp_path):
    a = write_pairs(tmp_path / "a", *labelled_pairs(random_pair_lengths(300, seed=1, longest=12)))
    b = write_pairs(tmp_path / "b", *labelled_pairs(random_pair_lengths(100, seed=2, longest=12)))
    return a, b


def test_splits_cut_the_pairs_as_gpt_splits_cut_documents(tmp_path):
    a, _ = _two_pair_sets(tmp_path)
    train, valid, test = build_mtf_datasets(a, "80,15,5", 16, seed=1, num_samples=(50, 5, 0),
                                            pad_id=PAD)  # fmt: skip
    assert [d.documents for d in (train, valid, test)] == [(0, 240), (240, 285), (285, 300)]
    assert len(train) > 50 and len(valid) > 5 and len(test) >= 1
    for dataset in (train, valid, test):
        first, stop = dataset.documents
        held = {i for k in range(len(dataset)) for i in _pair_ids(dataset[k])}
        assert held <= set(range(first, stop))  # only the split's own pairs
        assert len(dataset[0]["tokens"]) == 17


def test_a_blend_of_pairs_serves_each_prefix_by_weight_inside_its_range(tmp_path):
    a, b = _two_pair_sets(tmp_path)
    train, valid, _ = build_mtf_datasets(
        [f"0.25 {a}:0:0.5", "0.75", b], "90,10,0", 16, seed=2, num_samples=(200, 20, 0),
        cache_dir=str(tmp_path / "cache"), pad_id=PAD,
    )  # fmt: skip
    assert isinstance(train, BlendedDataset) and len(train) == 200 and len(valid) == 20
    assert [d.documents for d in train.datasets] == [(0, 135), (0, 90)]
    assert [d.documents for d in valid.datasets] == [(135, 150), (90, 100)]
    assert np.bincount(train.dataset_index).tolist() == [50, 150]
    for i in range(len(train)):
        component = train.datasets[train.dataset_index[i]]
        expected = component[train.dataset_sample_index[i]]
        for key, value in train[i].items():
            assert np.array_equal(value, expected[key])
    same = build_mtf_datasets([a, b], "1", 16, 2, (30, 0, 0), weights=[1, 3], pad_id=PAD)[0]
    assert np.bincount(same.dataset_index).tolist() == [8, 22]


def test_a_missing_side_of_a_pair_is_named(tmp_path):
    a, _ = _two_pair_sets(tmp_path)
    (tmp_path / "a_targets_document.idx").unlink()
    with pytest.raises(Exception, match=r"a_targets_document\.idx does not exist"):
        build_mtf_datasets(a, "1", 16, 1, (10, 0, 0), pad_id=PAD)


def test_a_cached_packing_index_is_loaded_not_rebuilt_and_rebuilt_on_change(tmp_path, monkeypatch):
    a, _ = _two_pair_sets(tmp_path)
    cache = tmp_path / "cache"
    first = MTFDataset(PairDataset(a), (0, 300), 16, 100, 4, PAD, str(cache))
    assert len(list(cache.glob("mtf_packing_index-*[!k]"))) == 1

    def must_not_build(*args, **kwargs):
        raise AssertionError("the cached index was rebuilt")

    monkeypatch.setattr(mtf_dataset_module, "build_packing_index", must_not_build)
    second = MTFDataset(PairDataset(a), (0, 300), 16, 100, 4, PAD, str(cache))
    mapped = second.index.sample_bounds.flags  # a read-only view of the cached file
    assert not mapped.owndata and not mapped.writeable
    assert np.array_equal(first.index.sample_bounds, second.index.sample_bounds)
    assert np.array_equal(first.index.pair_order, second.index.pair_order)
    monkeypatch.undo()
    MTFDataset(PairDataset(a), (0, 300), 16, 100, 5, PAD, str(cache))  # another seed
    write_pairs(tmp_path / "a", *labelled_pairs(random_pair_lengths(300, seed=9, longest=12)))
    MTFDataset(PairDataset(a), (0, 300), 16, 100, 4, PAD, str(cache))  # rewritten pairs
    assert len(list(cache.glob("mtf_packing_index-*[!k]"))) == 3

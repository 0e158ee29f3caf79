"""The loader: global sample order, DP slices, resume, batch-size rampup."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bloomnative.data import PretrainingLoader, rampup_batch_size


class CountingDataset:
    """Sample i is [i * 100, i * 100 + 1, ...]: every token names the sample it came from."""

    def __init__(self, num_samples: int, seq_len: int) -> None:
        self.num_samples, self.seq_len = num_samples, seq_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return np.arange(self.seq_len + 1, dtype=np.int64) + 100 * i


def sample_ids(batch) -> list[int]:
    return [int(row[0]) // 100 for inputs, _ in batch for row in inputs]


def test_batches_are_int64_inputs_and_labels_shifted_by_one():
    loader = PretrainingLoader(CountingDataset(64, seq_len=8), 2, 0, 1, prefetch=False)
    batch = loader.next_batch(4)
    assert len(batch) == 2
    for inputs, labels in batch:
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape == (2, 8)
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert sample_ids(batch) == [0, 1, 2, 3]


def test_context_parallel_ranks_get_their_load_balanced_chunks_of_inputs_and_labels():
    from functools import partial

    from bloomnative.parallel.context_parallel import shard_sequence

    dataset, cp = CountingDataset(16, seq_len=8), 2
    whole = PretrainingLoader(dataset, 2, 0, 1, prefetch=False).next_batch(4)
    for rank, (first, second) in enumerate([(0, 3), (1, 2)]):
        shard = partial(shard_sequence, cp_rank=rank, cp=cp)
        loader = PretrainingLoader(dataset, 2, 0, 1, prefetch=False, sequence_shard=shard)
        for (inputs, labels), (all_inputs, all_labels) in zip(
            loader.next_batch(4), whole, strict=True
        ):
            # Chunks of 2 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
            columns = [2 * first, 2 * first + 1, 2 * second, 2 * second + 1]
            assert torch.equal(inputs, all_inputs[:, columns]) and inputs.is_contiguous()
            assert torch.equal(labels, all_labels[:, columns])


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_global_batch_is_the_same_under_dp_1_2_and_4(prefetch):
    dataset = CountingDataset(400, seq_len=4)
    steps = [8, 8, 16, 16, 8]  # a rampup changes the batch size mid-run
    per_degree = {}
    for dp in (1, 2, 4):
        loaders = [PretrainingLoader(dataset, 2, r, dp, prefetch=prefetch) for r in range(dp)]
        per_degree[dp] = [
            [i for loader in loaders for i in sample_ids(loader.next_batch(gbs))] for gbs in steps
        ]
    assert per_degree[1] == per_degree[2] == per_degree[4]
    offsets = np.cumsum([0, *steps])
    assert per_degree[1] == [list(range(a, b)) for a, b in zip(offsets, offsets[1:], strict=False)]


def test_each_rank_takes_its_contiguous_slice_of_the_global_batch():
    dataset = CountingDataset(100, seq_len=4)
    loader = PretrainingLoader(dataset, micro_batch_size=2, dp_rank=1, dp_size=4, prefetch=False)
    assert sample_ids(loader.next_batch(16)) == [4, 5, 6, 7]
    assert sample_ids(loader.next_batch(16)) == [20, 21, 22, 23]


@pytest.mark.parametrize("prefetch", [False, True])
def test_resuming_from_the_saved_state_gives_the_batches_of_an_uninterrupted_run(prefetch):
    dataset = CountingDataset(500, seq_len=6)
    schedule = [8, 8, 12, 12, 16, 16, 16, 16]

    def run(loader, sizes):
        return [[t.tolist() for pair in loader.next_batch(g) for t in pair] for g in sizes]

    uninterrupted = run(PretrainingLoader(dataset, 2, 1, 2, prefetch=prefetch), schedule)
    first = PretrainingLoader(dataset, 2, 1, 2, prefetch=prefetch)
    head = run(first, schedule[:3])
    state = first.state_dict()
    assert state == {"consumed_samples": 28}
    first.close()
    # Resume on a fresh loader, as after loading a checkpoint.
    second = PretrainingLoader(dataset, 2, 1, 2, prefetch=prefetch)
    second.load_state_dict(state)
    assert head + run(second, schedule[3:]) == uninterrupted


def test_load_state_dict_drops_a_prefetched_batch_for_another_position():
    loader = PretrainingLoader(CountingDataset(100, seq_len=4), 1, 0, 1, prefetch=True)
    loader.next_batch(4)  # prefetches samples 4..7
    loader.load_state_dict({"consumed_samples": 40})
    assert sample_ids(loader.next_batch(4)) == [40, 41, 42, 43]


def test_a_batch_size_that_does_not_divide_is_refused_with_valid_values():
    loader = PretrainingLoader(CountingDataset(100, seq_len=4), 2, 0, 3, prefetch=False)
    with pytest.raises(ValueError, match=r"multiple of micro_batch_size 2 x dp_size 3 = 6"):
        loader.next_batch(8)


def test_running_past_the_dataset_names_what_to_change():
    loader = PretrainingLoader(CountingDataset(10, seq_len=4), 2, 0, 1, prefetch=True)
    loader.next_batch(8)
    with pytest.raises(IndexError, match=r"samples \[8, 16\).*has 10.*num_samples"):
        loader.next_batch(8)


def megatron_rampup(consumed: int, start: int, increment: int, ramp: int, gbs: int) -> int:
    """Megatron's RampupBatchsizeNumMicroBatches.update, transcribed."""
    per_increment = ramp / ((gbs - start) // increment)
    if consumed > ramp:
        return gbs
    return start + int(consumed / per_increment) * increment


def test_rampup_matches_megatron_on_the_bloom_176b_schedule():
    start, increment, ramp, gbs = 192, 16, 9_765_625, 2048
    assert rampup_batch_size(0, start, increment, ramp, gbs) == 192
    per_increment = ramp / ((gbs - start) // increment)  # 84,186.4 samples
    assert rampup_batch_size(int(per_increment), start, increment, ramp, gbs) == 192
    assert rampup_batch_size(int(per_increment) + 1, start, increment, ramp, gbs) == 208
    assert rampup_batch_size(ramp + 1, start, increment, ramp, gbs) == 2048
    for consumed in range(0, 11_000_000, 7_919):
        expected = megatron_rampup(consumed, start, increment, ramp, gbs)
        assert rampup_batch_size(consumed, start, increment, ramp, gbs) == expected


def test_a_rampup_run_consumes_the_ramped_sizes_step_by_step():
    dataset = CountingDataset(2000, seq_len=2)
    loader = PretrainingLoader(dataset, 4, 0, 1, prefetch=True)
    sizes = []
    for _ in range(30):
        size = rampup_batch_size(loader.consumed_samples, 8, 8, 200, 32)
        sizes.append(size)
        loader.next_batch(size)
    assert sizes[0] == 8 and sizes[-1] == 32 and sorted(sizes) == sizes
    assert set(sizes) == {8, 16, 24, 32}
    assert loader.consumed_samples == sum(sizes)


@pytest.mark.parametrize(
    ("start", "increment", "gbs"),
    [(0, 16, 2048), (192, 0, 2048), (200, 16, 2048), (4096, 16, 2048)],
)
def test_an_impossible_rampup_is_refused(start, increment, gbs):
    with pytest.raises(ValueError, match="rampup"):
        rampup_batch_size(0, start, increment, 1000, gbs)

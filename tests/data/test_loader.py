"""The loader: global sample order, DP slices, resume, batch-size rampup."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from bloomnative.data import PretrainingLoader, build_gpt_datasets, rampup_batch_size
from bloomnative.parallel import shard_sequence
from harness.indexed_data import random_documents, write_documents
from harness.launching import python_command, run


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
    assert state == {"consumed_samples": 28, "skipped": []}
    first.close()
    # Resume on a fresh loader, as after loading a checkpoint.
    second = PretrainingLoader(dataset, 2, 1, 2, prefetch=prefetch)
    second.load_state_dict(state)
    assert head + run(second, schedule[3:]) == uninterrupted


def test_a_blend_built_from_plain_arguments_resumes_exactly_under_another_dp_size(tmp_path):
    """What a training loop outside the Trainer does: build the blended datasets from paths and
    weights, train, save the loader's state; after a restart (datasets built again, now on
    two data-parallel ranks) the loader continues with exactly the uninterrupted run's samples."""
    prefixes = [
        write_documents(tmp_path / name, random_documents(80, seed=seed, max_len=40))
        for name, seed in (("a", 1), ("b", 2))
    ]

    def build():
        train, _, _ = build_gpt_datasets(
            prefixes, "1,0,0", seq_len=8, seed=5, num_samples=(96, 0, 0), weights=[0.25, 0.75],
            cache_dir=str(tmp_path / "cache"),
        )  # fmt: skip
        return train

    def tokens(batches) -> list[list[int]]:
        return [row.tolist() for batch in batches for inputs, _ in batch for row in inputs]

    uninterrupted = PretrainingLoader(build(), 2, 0, 1, prefetch=False)
    expected = tokens(uninterrupted.next_batch(16) for _ in range(6))
    first = PretrainingLoader(build(), 2, 0, 1, prefetch=True)
    head = tokens(first.next_batch(16) for _ in range(2))
    state = first.state_dict()
    first.close()
    resumed = [PretrainingLoader(build(), 2, rank, 2, prefetch=True) for rank in (0, 1)]
    for loader in resumed:
        loader.load_state_dict(state)
    tail = [tokens([loader.next_batch(16) for loader in resumed]) for _ in range(4)]
    assert head + [row for step in tail for row in step] == expected


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


class TokenDataset:
    """Fixed samples of seq_len + 1 tokens."""

    def __init__(self, samples: np.ndarray) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.samples[i]


@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_eod_mask_loss_ignores_the_positions_megatron_masks(micro_batch_size):
    """Megatron's --eod-mask-loss masks the positions whose input token is the EOD (the
    prediction of the next document's first token); the loader gives those labels -100 and
    leaves the inputs as they were (with one sample per micro batch the two share storage)."""
    gpt_dataset = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    eod = 3
    samples = np.random.default_rng(0).integers(0, 6, size=(8, 17))  # many EODs, some adjacent
    loader = PretrainingLoader(
        TokenDataset(samples), micro_batch_size, 0, 1, prefetch=False, eod_mask_id=eod
    )
    batch = loader.next_batch(8)
    inputs = torch.cat([x for x, _ in batch])
    labels = torch.cat([y for _, y in batch])
    tokens = torch.from_numpy(samples)
    assert torch.equal(inputs, tokens[:, :-1])
    for row, (x, y) in enumerate(zip(tokens[:, :-1], labels, strict=True)):
        _, loss_mask, _ = gpt_dataset._get_ltor_masks_and_position_ids(
            x, eod, False, False, True, False
        )
        assert torch.equal(y == -100, loss_mask == 0), row
        assert torch.equal(y[loss_mask == 1], tokens[row, 1:][loss_mask == 1])
    assert 0 < (labels == -100).sum() < labels.numel()


def test_under_context_parallelism_the_eod_mask_follows_the_tokens_it_masks():
    """Each cp rank's labels are its chunks of the masked labels: the mask is taken on the
    whole sequence (a chunk's first label depends on the token before it) and then cut."""
    eod, cp = 3, 2
    samples = np.random.default_rng(0).integers(0, 6, size=(4, 17))
    whole = PretrainingLoader(TokenDataset(samples), 2, 0, 1, prefetch=False, eod_mask_id=eod)
    expected = whole.next_batch(4)
    for rank in range(cp):
        shard = partial(shard_sequence, cp_rank=rank, cp=cp)
        loader = PretrainingLoader(
            TokenDataset(samples), 2, 0, 1, prefetch=False, eod_mask_id=eod, sequence_shard=shard
        )
        for (inputs, labels), (all_inputs, all_labels) in zip(
            loader.next_batch(4), expected, strict=True
        ):
            assert torch.equal(inputs, shard(all_inputs))
            assert torch.equal(labels, shard(all_labels))
            assert (labels == -100).any()


EXIT_WITH_A_PREFETCHING_LOADER = """
import numpy as np
import bloomnative.parallel  # as the trainer and the tools do: it changes what exit clears first
from bloomnative.data import PretrainingLoader

class Samples:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return np.arange(9, dtype=np.int64) + 100 * i

loader = PretrainingLoader(Samples(), 2, 0, 1, prefetch=True)
loader.next_batch(4)
print("exiting")
"""


@pytest.mark.multiprocess
def test_a_process_exits_quietly_with_a_prefetching_loader_alive():
    """A tool that ends with its loader alive: the loader's clean-up at interpreter exit printed
    'Exception ignored in: PretrainingLoader.__del__ ... AttributeError' after its last line."""
    done = run(python_command(["-c", EXIT_WITH_A_PREFETCHING_LOADER]))
    assert done.stdout == "exiting\n"
    assert "Exception ignored" not in done.stderr and "Error" not in done.stderr, done.stderr

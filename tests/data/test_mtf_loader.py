"""The loader on packed (input, target) samples: the loss mask (padding found by its place, a
target token with the pad's id counted) and --norm-target-loss weights on hand-made samples,
segment ids, DP slices, resume, rollback windows and context-parallel shards."""

from __future__ import annotations

import copy
import pickle
from functools import partial

import numpy as np
import pytest
import torch

from bloomnative.data import MicroBatch, PretrainingLoader, build_mtf_datasets
from bloomnative.data.micro_batch import IGNORE_INDEX, target_run_weights
from bloomnative.parallel import shard_sequence
from harness.mtf_pairs import labelled_pairs, random_pair_lengths, write_pairs

P = 0  # the pad id of the hand-made samples
X = IGNORE_INDEX


def float32(rows: list[list[float]]) -> torch.Tensor:
    """The weights written out by hand, as the loader holds them (each rounded once)."""
    return torch.tensor(rows, dtype=torch.float32)


class HandMadeSamples:
    """Packed samples written out by hand (what MTFDataset serves)."""

    def __init__(self, samples: list[tuple[list[int], list[int], list[int]]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        tokens, segments, inputs = self.samples[i]
        return {
            "tokens": np.array(tokens, dtype=np.int64),
            "segment_ids": np.array(segments, dtype=np.int64),
            "is_inputs": np.array(inputs, dtype=bool),
        }


# Pair 1: input [11, 12], target [13, 14, 15]; pair 2: input [21], target [22]; padding.
SAMPLE = (
    [11, 12, 13, 14, 15, 21, 22, P, P],
    [1, 1, 1, 1, 1, 2, 2, 0, 0],
    [1, 1, 0, 0, 0, 1, 0, 0, 0],
)


def test_labels_count_only_on_target_tokens_of_pairs():
    loader = PretrainingLoader(HandMadeSamples([SAMPLE]), 1, 0, 1, prefetch=False)
    (batch,) = loader.next_batch(1)
    assert isinstance(batch, MicroBatch) and batch.loss_weights is None
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, P]]
    # Label i is token i + 1; it counts where token i + 1 is a target of a pair (segment id
    # > 0): 13, 14, 15 (predicted from 12, 13, 14) and 22 (from 21). 21 is an input, the rest
    # padding.
    assert batch.labels.tolist() == [[X, 13, 14, 15, X, 22, X, X]]
    # The inputs' segments: pair 1 is positions 0-4, pair 2 positions 5-6, padding from 7.
    assert batch.segment_start.tolist() == [[0, 0, 0, 0, 0, 5, 5, 7]]
    assert batch.segment_end.tolist() == [[5, 5, 5, 5, 5, 7, 7, 8]]


def test_norm_target_loss_weighs_each_target_run_by_one_over_its_length():
    samples = HandMadeSamples([SAMPLE])
    loader = PretrainingLoader(samples, 1, 0, 1, prefetch=False, norm_target_loss=True)
    (batch,) = loader.next_batch(1)
    third = 1 / 3
    assert torch.equal(batch.loss_weights, float32([[0, third, third, third, 0, 1, 0, 0]]))
    assert batch.labels.tolist() == [[X, 13, 14, 15, X, 22, X, X]]  # the same mask


def test_target_runs_end_at_the_end_of_a_row():
    # Row 0 ends inside a target run of 2; row 1 starts with one of 3 (a 1-token input).
    # Megatron-DeepSpeed flattens the micro batch and would count one run of 5.
    counted = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    expected = float32([[0, 0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3, 0]])
    assert torch.equal(target_run_weights(counted), expected)
    assert target_run_weights(torch.zeros(2, 3, dtype=torch.bool)).sum() == 0


def test_a_target_token_with_the_pad_id_counts_and_the_eod_mask_is_megatron_deepspeeds():
    # Padding is where it is (segment 0), not a token: a target token with the pad's id (P at
    # position 3) counts, where Megatron-DeepSpeed's labels != pad would drop it and cut the
    # target run in two. With --eod-mask-loss every label whose input is the EOD (2) is masked,
    # as there; the runs are measured after it.
    sample = ([5, 6, 7, P, 8, 9, 2, 4, P], [1] * 8 + [0], [1, 0, 0, 0, 0, 0, 0, 0, 0])
    loader = PretrainingLoader(
        HandMadeSamples([sample]), 1, 0, 1, prefetch=False, eod_mask_id=2, norm_target_loss=True
    )
    (batch,) = loader.next_batch(1)
    assert batch.labels.tolist() == [[6, 7, P, 8, 9, 2, X, X]]
    assert torch.equal(batch.loss_weights, float32([[1 / 6] * 6 + [0, 0]]))


def test_with_the_pad_equal_to_the_eod_every_eod_ending_a_target_counts(tmp_path):
    """The common habit pad = end-of-document, with targets preprocessed with --append-eod:
    every target's EOD counts, so the model learns to stop; only the padding after the last
    pair of a sample counts in no loss."""
    eod = 0
    rng = np.random.default_rng(5)
    lengths = random_pair_lengths(60, seed=5, longest=6)
    inputs = [rng.integers(1, 100, n) for n, _ in lengths]
    targets = [np.append(rng.integers(1, 100, n), eod) for _, n in lengths]
    pairs = write_pairs(tmp_path / "eod", inputs, targets)
    dataset = build_mtf_datasets(pairs, "1", 16, seed=1, num_samples=(8, 0, 0), pad_id=eod)[0]
    (batch,) = PretrainingLoader(dataset, 8, 0, 1, prefetch=False).next_batch(8)
    samples = [dataset[k] for k in range(8)]
    pairs_served = sum(int(s["segment_ids"].max()) for s in samples)
    padded = sum(int((s["segment_ids"] == 0).sum()) for s in samples)
    assert padded > 0  # the pad fills samples too: only its place tells it from the EODs
    assert int((batch.labels == eod).sum()) == pairs_served  # one EOD per target, each counted
    targets_served = sum(int((~s["is_inputs"] & (s["segment_ids"] > 0)).sum()) for s in samples)
    assert int((batch.labels != IGNORE_INDEX).sum()) == targets_served


def test_a_micro_batch_is_the_pair_of_inputs_and_labels_with_attributes():
    inputs, labels = torch.arange(4).view(1, 4), torch.ones(1, 4)
    start, end = torch.zeros(1, 4, dtype=torch.int32), torch.full((1, 4), 4, dtype=torch.int32)
    batch = MicroBatch(inputs, labels, start, end)
    x, y = batch
    assert x is inputs and y is labels and batch[1] is labels and len(batch) == 2
    assert batch.segments == (start, end) and MicroBatch(inputs, labels).segments is None
    for again in (copy.deepcopy(batch), pickle.loads(pickle.dumps(batch))):
        assert isinstance(again, MicroBatch) and torch.equal(again.segment_end, end)
        assert again.loss_weights is None and torch.equal(again.input_ids, inputs)


# -- packed pairs through the loader ---------------------------------------------------------


@pytest.fixture
def pairs(tmp_path) -> str:
    return write_pairs(tmp_path / "p", *labelled_pairs(random_pair_lengths(400, seed=3, longest=8)))


def _train(pairs: str, samples: int = 200):
    return build_mtf_datasets(pairs, "1", 16, seed=7, num_samples=(samples, 0, 0), pad_id=999)[0]


def _rows(batches) -> list[list[int]]:
    return [row for batch in batches for micro in batch for row in micro.input_ids.tolist()]


def test_the_global_batch_of_packed_samples_is_the_same_under_dp_1_and_2(pairs):
    dataset = _train(pairs)
    steps = [8, 8, 16]
    per_degree = {}
    for dp in (1, 2):
        loaders = [PretrainingLoader(dataset, 2, r, dp, prefetch=True) for r in range(dp)]
        per_degree[dp] = [
            row
            for gbs in steps
            for loader in loaders
            for micro in loader.next_batch(gbs)
            for row in micro.input_ids.tolist()
        ]
    assert per_degree[1] == per_degree[2]
    assert per_degree[1] == [dataset[k]["tokens"][:-1].tolist() for k in range(32)]


def test_resume_and_rollback_windows_serve_the_batches_of_an_uninterrupted_run(pairs):
    dataset = _train(pairs)

    def loader():
        return PretrainingLoader(dataset, 2, 0, 1, prefetch=False)

    whole = loader()
    whole.skip(8, 12)  # a rollback window
    expected = [whole.next_batch(4) for _ in range(5)]
    first = loader()
    first.skip(8, 12)
    before = [first.next_batch(4) for _ in range(2)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"consumed_samples": 8, "skipped": [(8, 12)]}
    after = [resumed.next_batch(4) for _ in range(3)]
    assert _rows(before + after) == _rows(expected)
    positions = [*range(8), *range(12, 24)]
    assert _rows(expected) == [dataset[k]["tokens"][:-1].tolist() for k in positions]
    for batch, again in zip(expected, before + after, strict=True):
        for micro, micro_again in zip(batch, again, strict=True):
            assert torch.equal(micro.labels, micro_again.labels)
            assert torch.equal(micro.segment_start, micro_again.segment_start)


def test_context_parallel_ranks_get_their_chunks_of_every_field(pairs):
    dataset, cp = _train(pairs), 2

    def batch(shard=None):
        return PretrainingLoader(
            dataset, 2, 0, 1, prefetch=False, norm_target_loss=True,
            sequence_shard=shard,
        ).next_batch(2)[0]  # fmt: skip

    whole = batch()
    for rank in range(cp):
        shard = partial(shard_sequence, cp_rank=rank, cp=cp)
        part = batch(shard)
        # The weights come from whole sequences: a run cut by the shards keeps 1 / its length.
        for mine, full in zip(part.__getnewargs__(), whole.__getnewargs__(), strict=True):
            assert torch.equal(mine, shard(full)) and mine.is_contiguous()
    # Weights sum to the number of target runs, whichever rank holds their tokens.
    # One target run per pair: the segments (by their start) holding a counted label.
    counted = whole.labels != IGNORE_INDEX
    runs = sum(
        len(set(row[mask].tolist())) for row, mask in zip(whole.segment_start, counted, strict=True)
    )
    assert whole.loss_weights.sum().item() == pytest.approx(runs)

"""Blend syntax, the blend order, split boundaries, and building the three splits."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from bloomnative.data import (
    BlendedDataset,
    GPTDataset,
    build_blending_indices,
    build_gpt_datasets,
    parse_blend,
    split_boundaries,
)
from harness.indexed_data import random_documents, write_documents

# -- blend syntax ----------------------------------------------------------------------------


def test_a_single_prefix_has_weight_one():
    (entry,) = parse_blend("data/a_text_document")
    assert (entry.weight, entry.prefix, entry.doc_range) == (1, "data/a_text_document", (0, 1))


def test_weights_are_normalised_exactly_and_lists_and_strings_agree():
    from_list = parse_blend(["0.3", "data/a", "0.9", "data/b"])
    from_string = parse_blend("0.3 data/a 0.9 data/b")
    assert from_list == from_string
    assert [e.weight for e in from_list] == [Fraction(1, 4), Fraction(3, 4)]


def test_weights_given_apart_from_the_prefixes_mean_the_same_blend():
    assert parse_blend(["data/a", "data/b:0:0.5"], weights=[0.3, 0.9]) == parse_blend(
        "0.3 data/a 0.9 data/b:0:0.5"
    )
    assert parse_blend(["data/a"], weights=[2.0]) == parse_blend("data/a")
    with pytest.raises(ValueError, match="2 weights .* for 1 dataset prefixes.*one weight per"):
        parse_blend(["data/a"], weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="must be positive"):
        parse_blend(["data/a", "data/b"], weights=[1, 0])


def test_bigscience_document_ranges_follow_the_prefix():
    entries = parse_blend(["0.5 data/a:0:0.95", "0.5", "data/b:0.95:1.0"])
    assert [(e.prefix, e.doc_range) for e in entries] == [
        ("data/a", (0.0, 0.95)),
        ("data/b", (0.95, 1.0)),
    ]


@pytest.mark.parametrize(
    ("blend", "message"),
    [
        ("", "empty"),
        ("0.3 data/a 0.7", "alternate weight and prefix"),
        ("data/a data/b", "expected a weight, got 'data/a'"),
        ("-1 data/a 1 data/b", "must be positive"),
        ("1 data/a:0.9:0.1 1 data/b", "0 <= START < END <= 1"),
        ("data/a_text_document.bin", "without the extension: 'data/a_text_document'"),
    ],
)
def test_a_malformed_blend_says_what_is_valid(blend, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(blend)


# -- blend order --------------------------------------------------------------------------------


def reference_blend_order(weights: list[Fraction], n: int) -> list[int]:
    """Tijdeman's rule, one sample at a time with exact fractions: among the datasets at least
    delta = 1 / (2K - 2) behind their share, the one whose next sample is due first."""
    delta = Fraction(1, 2 * len(weights) - 2)
    counts = [0] * len(weights)
    order = []
    for sample in range(1, n + 1):
        eligible = [k for k, w in enumerate(weights) if w * sample - counts[k] >= delta]
        chosen = min(eligible, key=lambda k: (counts[k] + 1 - delta) / weights[k])
        counts[chosen] += 1
        order.append(chosen)
    return order


BLENDS = [
    ["0.3", "0.7"],
    ["1", "1", "1"],
    ["0.2", "0.3", "0.5"],
    ["0.05", "0.15", "0.3", "0.5"],
    ["0.123", "0.877"],
    ["1", "2", "3", "5", "8", "13"],
]


@pytest.mark.parametrize("weights", BLENDS)
def test_blend_order_follows_tijdemans_rule_exactly(weights):
    n = 2500
    dataset_index, sample_index = build_blending_indices(weights, n)
    exact = [Fraction(w) / sum(Fraction(x) for x in weights) for w in weights]
    assert dataset_index.tolist() == reference_blend_order(exact, n)
    # ... and sample_index counts each dataset's samples in order.
    for k in range(len(weights)):
        np.testing.assert_array_equal(
            sample_index[dataset_index == k], np.arange((dataset_index == k).sum())
        )


@pytest.mark.parametrize("seed", range(8))
def test_every_dataset_stays_within_one_sample_of_its_share_at_every_prefix(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 10))
    # Skewed weights with several decimals: Megatron's rule drifts past one sample on these.
    weights = [f"{w:.5f}" for w in rng.dirichlet(np.full(count, 0.5)) + 1e-4]
    n = 20_000
    dataset_index, _ = build_blending_indices(weights, n)
    exact = np.array([float(w) for w in weights]) / sum(float(w) for w in weights)
    one_hot = np.zeros((n, count))
    one_hot[np.arange(n), dataset_index] = 1
    counts = np.cumsum(one_hot, axis=0)
    targets = np.arange(1, n + 1)[:, None] * exact[None, :]
    assert np.abs(counts - targets).max() <= 1 - 1 / (2 * count - 2) + 1e-9


def test_a_periodic_blend_is_tiled_without_changing_the_order():
    weights = ["0.3", "0.45", "0.25"]  # period 20
    dataset_index, sample_index = build_blending_indices(weights, 1003)
    exact = [Fraction(w) for w in weights]
    assert dataset_index.tolist() == reference_blend_order(exact, 1003)
    for k in range(3):
        np.testing.assert_array_equal(
            sample_index[dataset_index == k], np.arange((dataset_index == k).sum())
        )


# -- splits ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "n", "expected"),
    [
        ("969,30,1", 1000, (0, 969, 999, 1000)),
        ("949,50,1", 1154, (0, 1095, 1153, 1154)),
        ("45,45,10", 10, (0, 5, 9, 10)),  # round(4.5) = 4 twice, then shifted onto n
        ("0.3/0.3/0.4", 5, (0, 1, 3, 5)),  # round(1.5) = 2 twice: shifted back by one
        ("100", 7, (0, 7, 7, 7)),
        ("8,2", 10, (0, 8, 10, 10)),
    ],
)
def test_split_boundaries_follow_megatrons_rounding(split, n, expected):
    assert split_boundaries(split, n) == expected


@pytest.mark.parametrize("split", ["", "a,b,c", "1,2,3,4", "-1,2,0", "0,0,0", "1,,2"])
def test_a_malformed_split_says_what_is_valid(split):
    with pytest.raises(ValueError, match="split"):
        split_boundaries(split, 100)


# -- building the three splits -----------------------------------------------------------------


def _corpora(tmp_path):
    a = write_documents(tmp_path / "a", random_documents(300, seed=1, max_len=40))
    b = write_documents(tmp_path / "b", random_documents(100, seed=2, max_len=40))
    return a, b


def test_splits_use_disjoint_document_ranges_and_valid_can_be_longer(tmp_path):
    a, _ = _corpora(tmp_path)
    train, valid, test = build_gpt_datasets(
        a, "80,15,5", seq_len=16, seed=1, num_samples=(100, 10, 0), cache_dir=None,
        valid_seq_len=48,
    )  # fmt: skip
    assert [d.documents for d in (train, valid, test)] == [(0, 240), (240, 285), (285, 300)]
    assert (train.seq_len, valid.seq_len, test.seq_len) == (16, 48, 48)
    assert len(train[0]) == 17 and len(valid[0]) == 49
    assert len(train) >= 100 and len(valid) >= 10


def test_a_blend_serves_each_split_by_weight_inside_each_document_range(tmp_path):
    a, b = _corpora(tmp_path)
    train, valid, _ = build_gpt_datasets(
        [f"0.25 {a}:0:0.5", "0.75", b], "90,10,0", 8, seed=1, num_samples=(400, 40, 0),
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert isinstance(train, BlendedDataset) and len(train) == 400 and len(valid) == 40
    first, second = train.datasets
    assert isinstance(first, GPTDataset)
    assert first.documents == (0, 135) and second.documents == (0, 90)
    assert valid.datasets[0].documents == (135, 150) and valid.datasets[1].documents == (90, 100)
    assert np.bincount(train.dataset_index).tolist() == [100, 300]
    for i in range(len(train)):
        component = train.datasets[train.dataset_index[i]]
        assert train[i].tolist() == component[train.dataset_sample_index[i]].tolist()


def test_a_missing_prefix_is_named(tmp_path):
    a, _ = _corpora(tmp_path)
    missing = str(tmp_path / "nope_text_document")
    with pytest.raises(FileNotFoundError, match=f"{missing}.idx"):
        build_gpt_datasets(f"0.5 {a} 0.5 {missing}", "1,0,0", 8, 1, (10, 0, 0), None)


def test_an_empty_split_is_none_unless_samples_are_asked_of_it(tmp_path):
    a, _ = _corpora(tmp_path)
    _, _, test = build_gpt_datasets(a, "95,5,0", 8, 1, (10, 10, 0), None)
    assert test is None
    with pytest.raises(ValueError, match=r"test split is empty.*give test a larger share"):
        build_gpt_datasets(a, "95,5,0", 8, 1, (10, 10, 5), None)


def test_more_samples_than_an_index_can_hold_names_what_to_change(tmp_path):
    a = write_documents(tmp_path / "tiny", [np.arange(5), np.arange(5)])
    with pytest.raises(ValueError, match="ask for fewer samples or give this split more"):
        build_gpt_datasets(a, "1,0,0", 2048, 1, (2_000_000_000, 0, 0), None)

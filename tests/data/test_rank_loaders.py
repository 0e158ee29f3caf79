"""`build_loaders`, the trainer's one call into the data package: the loaders it returns serve
what a loader built by hand over the same split serves, a validation loader starts afresh each
time one is made, and the second validation length is served at its own length."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bloomnative.data import PretrainingLoader, build_gpt_datasets, build_loaders

SEED = 7


def settings(corpus: str, long_seq_len: int = 0):
    data = SimpleNamespace(
        blend=[corpus], split="90,10,0", format="gpt", prefetch=False, norm_target_loss=False
    )
    shaping = SimpleNamespace(
        seq_len=16, micro_batch_size=2, eod_mask_id=None, document_eod_id=None, pad_id=None,
        train_samples=32, valid_samples=8, long_seq_len=long_seq_len, cache_dir="",
    )  # fmt: skip
    return data, shaping


def test_the_loaders_serve_the_splits_of_the_run(synthetic_corpus):
    data, shaping = settings(synthetic_corpus, long_seq_len=32)
    loaders = build_loaders(data, shaping, seed=SEED, dp_rank=1, dp_size=2, device="cpu")
    train, _, _ = build_gpt_datasets([synthetic_corpus], "90,10,0", 16, SEED, (32, 8, 0))
    by_hand = PretrainingLoader(train, 2, dp_rank=1, dp_size=2, prefetch=False)
    for (x, y), (a, b) in zip(loaders.train.next_batch(8), by_hand.next_batch(8), strict=True):
        assert torch.equal(x, a) and torch.equal(y, b)
    assert loaders.valid is not None and loaders.valid_long is not None
    first = loaders.valid().next_batch(4)[0].input_ids
    assert torch.equal(loaders.valid().next_batch(4)[0].input_ids, first)  # from the start
    assert first.shape == (2, 16)
    assert loaders.valid_long().next_batch(4)[0].input_ids.shape == (2, 32)


def test_without_a_second_length_there_is_no_long_validation(synthetic_corpus):
    data, shaping = settings(synthetic_corpus)
    loaders = build_loaders(data, shaping, seed=SEED, dp_rank=0, dp_size=1, device="cpu")
    assert loaders.valid_long is None

"""The corpus in assets/pydocs: reproducible from its JSON lines, usable by the debug config."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bloomnative.data import IndexedDataset, build_gpt_datasets, load_tokenizer
from bloomnative.data.preprocess import PreprocessConfig, preprocess

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "pydocs"
PREFIX = str(ASSETS / "pydocs_text_document")
DEBUG_SPLIT = "949,50,1"


def test_the_committed_tokens_are_what_preprocessing_the_committed_text_gives(tmp_path):
    config = PreprocessConfig(
        inputs=(str(ASSETS / "pydocs.jsonl.gz"),),
        tokenizer=str(ASSETS / "tokenizer.json"),
        output_prefix=str(tmp_path / "pydocs"),
        workers=2,
        append_eod=True,
    )
    preprocess(config, log=lambda message: None)
    for ext in (".bin", ".idx"):
        rebuilt = (tmp_path / f"pydocs_text_document{ext}").read_bytes()
        assert rebuilt == Path(PREFIX + ext).read_bytes()


def test_the_tokenizer_has_the_eod_at_id_0_and_fits_uint16():
    tokenizer = load_tokenizer(str(ASSETS / "tokenizer.json"))
    assert (tokenizer.eod_token, tokenizer.eod_id, tokenizer.vocab_size) == (
        "<|endoftext|>",
        0,
        8192,
    )
    dataset = IndexedDataset(PREFIX)
    assert dataset.dtype == np.uint16
    assert all(dataset[i][-1] == 0 for i in range(0, len(dataset), 97))


def test_the_debug_split_has_a_valid_set_of_many_8_x_256_batches():
    train, valid, test = build_gpt_datasets(PREFIX, DEBUG_SPLIT, 256, 1234, (2000, 0, 0), None)
    assert len(valid) >= 8 * 20  # one epoch of the valid documents: over 20 batches of 8 x 256
    assert len(train) >= 2000 and test is not None
    tokenizer = load_tokenizer(str(ASSETS / "tokenizer.json"))
    assert len(tokenizer.decode(valid[0].tolist())) > 256  # real text, about 4 bytes a token

"""What preflight checks of pair datasets (data.format = "mtf") and how it names what is wrong;
the config keys of packed pairs; the pad token."""

from __future__ import annotations

import os

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from bloomnative.config import ConfigError, parse_args
from bloomnative.data import IndexedDatasetError, check_pair_datasets, pad_token_id
from bloomnative.launch.preflight import main
from harness.mtf_pairs import labelled_pairs, write_pairs

LENGTHS = [(3, 2)] * 10


@pytest.fixture
def pair_prefix(tmp_path) -> str:
    return write_pairs(tmp_path / "xp3", *labelled_pairs(LENGTHS))


def test_sound_pairs_pass_and_their_tokens_are_counted(pair_prefix):
    assert check_pair_datasets(pair_prefix) == 50
    assert check_pair_datasets(f"0.5 {pair_prefix} 0.5 {pair_prefix}:0:0.5", 1000) == 100


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        (["_targets_document.idx"], r"xp3_targets_document\.idx does not exist"),
        (["_inputs_document.bin", "_inputs_document.idx"], r"\.bin and .*\.idx do not exist"),
    ],
)
def test_a_missing_side_is_named_with_what_mtf_reads(pair_prefix, missing, named):
    for suffix in missing:
        os.remove(pair_prefix + suffix)
    with pytest.raises(IndexedDatasetError, match=named) as caught:
        check_pair_datasets(pair_prefix)
    assert "xp3_inputs_document.{bin,idx} and" in str(caught.value)
    assert "--json-keys inputs targets" in str(caught.value)


def test_a_side_prefix_given_for_the_pair_prefix_is_corrected(pair_prefix):
    with pytest.raises(IndexedDatasetError, match=rf"give the pair prefix '{pair_prefix}'"):
        check_pair_datasets(pair_prefix + "_inputs_document")


def test_sides_of_different_lengths_are_refused_with_both_counts(tmp_path):
    inputs, targets = labelled_pairs(LENGTHS)
    prefix = write_pairs(tmp_path / "xp3", inputs, targets[:-1])
    with pytest.raises(IndexedDatasetError, match=r"holds 10 sequences but .*holds 9") as caught:
        check_pair_datasets(prefix)
    assert str(caught.value).startswith(f"pair prefix '{prefix}': ")


def test_a_token_outside_the_vocabulary_is_named_with_its_file(tmp_path):
    inputs, targets = labelled_pairs(LENGTHS)
    targets[4] = np.array([1, 700])
    prefix = write_pairs(tmp_path / "xp3", inputs, targets)
    check_pair_datasets(prefix, vocab_size=1000)
    with pytest.raises(IndexedDatasetError, match=r"xp3_targets_document.bin: token id 700"):
        check_pair_datasets(prefix, vocab_size=512)


def _preflight(pair_prefix: str, *overrides: str) -> int:
    """Preflight of a run on the pairs; the bundled tokenizer has no pad, so EOD pads."""
    pairs = ["--data.format=mtf", f"--data.blend={pair_prefix}", "--data.pad_token=<|endoftext|>"]
    return main(["--world-size=1", *pairs, *overrides])


def test_preflight_passes_pairs_and_names_a_broken_pair_in_one_line(pair_prefix, capsys):
    assert _preflight(pair_prefix, "--data.split=8,2,0") == 0
    assert "preflight ok" in capsys.readouterr().err
    # The default split ("949,50,1") leaves 10 pairs no valid pair; validation asks for some.
    assert _preflight(pair_prefix) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "config error: data.split: the valid split is empty: split '949,50,1' gives it no "
        f"documents of '{pair_prefix}' (10 documents)"
    )
    os.remove(pair_prefix + "_targets_document.bin")
    assert _preflight(pair_prefix, "--data.split=8,2,0") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"data error: pair prefix '{pair_prefix}': ")
    assert "xp3_targets_document.bin does not exist" in err


def test_preflight_names_the_pairs_of_which_none_fits_a_sample(tmp_path, capsys):
    """Packing would fail in every rank; preflight names the prefix, the split and the key."""
    prefix = write_pairs(tmp_path / "long", *labelled_pairs([(40, 30)] * 8 + [(3, 2)] * 2))
    assert _preflight(prefix, "--data.split=8,2,0", "--training.seq_len=128") == 0
    capsys.readouterr()
    assert _preflight(prefix, "--data.split=8,2,0", "--training.seq_len=64") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"config error: none of the 8 pairs of '{prefix}' [0, 8) (the train split) fits a "
        "sample of 65 tokens (the longest has 70, the shortest 70): nothing to pack; use a "
        "longer training.seq_len or shorter pairs"
    )


def test_norm_target_loss_and_pad_token_need_packed_pairs():
    config = parse_args(["--data.format=mtf", "--data.norm_target_loss=true"])
    assert config.data.norm_target_loss and config.data.pad_token == ""
    for key, value in (("norm_target_loss", "true"), ("pad_token", "<pad>")):
        with pytest.raises(ConfigError, match=rf'data.{key} = .* set data.format = "mtf"'):
            parse_args([f"--data.{key}={value}"])


def test_the_pad_token_is_named_or_the_tokenizers(tmp_path):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "a": 4}  # BLOOM's first ids
    path = str(tmp_path / "bloom_like.json")
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(path)
    assert pad_token_id(path) == 3
    assert pad_token_id(path, "</s>") == 2
    with pytest.raises(ValueError, match=r"'<PAD>' is not in the vocabulary .*'<pad>'"):
        pad_token_id(path, "<PAD>")
    padded = Tokenizer(WordLevel({**vocab, "<fill>": 5}, unk_token="<unk>"))
    padded.enable_padding(pad_id=5, pad_token="<fill>")
    padded.save(path)
    assert pad_token_id(path) == 5  # the padding settings come first
    Tokenizer(WordLevel({"<unk>": 0, "x": 1}, unk_token="<unk>")).save(path)
    with pytest.raises(ValueError, match=r"no padding token.*'<pad>'.*name one"):
        pad_token_id(path)

"""data.pad_token, the token that fills packed samples after their last pair: an id (a TOML
integer) or a token's text (a TOML string), resolved once by `resolve_run`, which checks it,
logs it and records its id in the resolved config (the dump folder's config.toml)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from bloomnative.config import Config, ConfigError, load_toml, parse_args
from bloomnative.train.resolved import resolve_run
from harness.mtf_pairs import write_pairs

PAD, THREE = 3, 13  # the ids of "<pad>" and of the token whose text is "3"


@pytest.fixture
def run_args(tmp_path) -> list[str]:
    """A packed-pairs run whose tokenizer has BLOOM's first ids (<pad> = 3) and the numbers
    0-89 as words ("3" = 13); the first target holds "3" twice and <pad> once."""
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": PAD, **{str(i): 10 + i for i in range(90)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    targets = [np.array([THREE, 20, THREE, PAD, 2]), np.array([21, 2])]
    pairs = write_pairs(tmp_path / "pairs", [np.array([30, 31]), np.array([32])], targets, 100)
    return [
        "--data.format=mtf",
        f"--data.blend={pairs}",
        f"--data.tokenizer={tmp_path / 'tokenizer.json'}",
        "--data.split=1",
        "--model.vocab_size=100",
    ]


def pad_id(argv: list[str]) -> int | None:
    return resolve_run(parse_args(argv), 1, "cpu").data.pad_id


def with_toml(tmp_path: Path, data: str) -> list[str]:
    """`--config` of a file holding the [data] lines `data` (the rest: Config's defaults)."""
    path = tmp_path / "pad.toml"
    path.write_text(f"[data]\n{data}\n")
    return ["--config", str(path)]


def test_a_pad_given_as_a_number_is_an_id_and_as_a_string_a_tokens_text(run_args, tmp_path):
    assert pad_id([*run_args, "--data.pad_token=3"]) == PAD
    assert pad_id([*run_args, '--data.pad_token="3"']) == THREE  # a TOML string: text
    assert pad_id([*run_args, "--data.pad_token=<pad>"]) == PAD  # not an integer: text
    assert pad_id([*run_args, '--data.pad_token="<pad>"']) == PAD
    assert pad_id(run_args) == PAD  # empty: the tokenizer's <pad>
    assert pad_id([*with_toml(tmp_path, "pad_token = 3"), *run_args]) == PAD
    assert pad_id([*with_toml(tmp_path, 'pad_token = "3"'), *run_args]) == THREE
    assert parse_args([*run_args, "--data.pad_token=3"]).data.pad_token == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--data.pad_token=300", r"^data.pad_token = 300: no token of \S+ has id 300; its ids "
                                 r"are 0-99$"),
        ("--data.pad_token=-1", r"^data.pad_token = -1: no token of \S+ has id -1; its ids "),
        ('--data.pad_token="300"', r"^data.pad_token = '300': pad token '300' is not in the "
                                   r"vocabulary .*; an id is an integer \(pad_token = 300, "),
    ],
)  # fmt: skip
def test_a_pad_the_tokenizer_lacks_is_one_line_naming_the_key_and_what_is_valid(
    run_args, override, message
):
    with pytest.raises(ConfigError, match=message) as caught:
        pad_id([*run_args, override])
    assert "\n" not in str(caught.value)


def test_a_pad_id_is_checked_against_the_model_and_needs_no_tokenizer(run_args):
    with pytest.raises(
        ConfigError,
        match=r"^data.pad_token = 60: id 60 is outside the model's vocabulary of 50 "
        r"\(model.vocab_size\); give an id in \[0, 50\) or the text of a token",
    ):
        pad_id([*run_args, "--data.pad_token=60", "--model.vocab_size=50"])
    untokenized = [*run_args, "--data.tokenizer=", "--data.pad_token=99"]
    assert pad_id(untokenized) == 99
    with pytest.raises(ConfigError, match=r"^data.pad_token = 100: id 100 is outside"):
        pad_id([*untokenized, "--data.pad_token=100"])


def test_a_pad_of_another_type_or_for_pretraining_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"data.pad_token: expected a token id \(an integer\) or a token's text \(a "
        r"string\), got 3.0",
    ):
        parse_args(with_toml(tmp_path, 'format = "mtf"\npad_token = 3.0'))
    # Id 0 is a pad given, though falsy: it needs packed pairs as any other.
    with pytest.raises(ConfigError, match=r"^data.pad_token = 0 applies only to packed pairs"):
        parse_args(with_toml(tmp_path, "pad_token = 0"))


def test_the_resolved_config_records_the_pad_id_used(run_args, tmp_path):
    for given in ("", "--data.pad_token=<pad>", "--data.pad_token=3"):
        run = resolve_run(parse_args([*run_args, given] if given else run_args), 1, "cpu")
        assert run.config.data.pad_token == PAD
        assert "pad_token = 3" in run.config.to_toml().splitlines()
        (tmp_path / "config.toml").write_text(run.config.to_toml())
        again = Config()
        load_toml(again, tmp_path / "config.toml")  # as the trainer's config.toml reads back
        assert again.data.pad_token == PAD and again == run.config


def test_one_log_line_names_the_pad_and_the_target_tokens_with_its_id(run_args):
    lines: list[str] = []
    resolve_run(parse_args([*run_args, '--data.pad_token="3"']), 1, "cpu", log=lines.append)
    (line,) = [line for line in lines if "pad_token" in line]
    assert line.startswith(
        "data.pad_token: id 13 ('3') pads packed samples after their last pair; padding is left "
        "out of the loss by its place, not its id: target tokens with id 13 count"
    )
    assert line.endswith("; 2 of the 7 target tokens of data.blend have it")
    lines.clear()
    resolve_run(parse_args([*run_args, "--data.tokenizer=", "--data.pad_token=3"]), 1, "cpu",
                log=lines.append)  # fmt: skip
    assert "id 3 (its text unknown: no data.tokenizer)" in lines[-1]
    assert lines[-1].endswith("; 1 of the 7 target tokens of data.blend have it")

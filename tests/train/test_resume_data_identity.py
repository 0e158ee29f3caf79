"""A resume compares the datasets of the blend by what they are, not by how they are spelled
(train/resume_checks.py): the same files named by a relative or an absolute path agree, a dataset
remade under the same name does not, and a checkpoint whose record holds only the text of
`data.blend` (saved before the datasets were identified) still resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bloomnative.checkpoint.checkpointer import BadCheckpointError, Checkpointer
from bloomnative.checkpoint.resume import Resume, VerifiedCheck, plan_start
from bloomnative.checkpoint.run_record import DATA_FILE
from bloomnative.config import Config
from bloomnative.train.resume_checks import DATASETS, data_settings
from harness.indexed_data import random_documents, write_documents
from harness.mtf_pairs import labelled_pairs, random_pair_lengths, write_pairs
from harness.training import write_word_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def config(blend: list[str], tokenizer: str = "", data_format: str = "gpt") -> Config:
    c = Config()
    c.data.blend, c.data.tokenizer, c.data.format = blend, tokenizer, data_format
    return c


def save(folder: Path, record: dict) -> None:
    """Training checkpoint step-2 whose data_settings.json is `record`."""
    state = {"model": {"w": torch.zeros(2)}, "optimizer": {"state.w.step": torch.tensor(2.0)}}
    checkpointer = Checkpointer(folder, 0, async_mode=False, min_free_gib=0)
    checkpointer.save(2, state, {DATA_FILE: record})
    checkpointer.wait()


def start(folder: Path, now: Config):
    checkpointer = Checkpointer(folder, 0, async_mode=False, min_free_gib=0)
    return plan_start(folder, VerifiedCheck(checkpointer, None, data_settings(now))).start


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """<tmp>/data/a and <tmp>/data/b, a tokenizer, the current folder <tmp>."""
    folder = tmp_path / "data"
    folder.mkdir()
    for seed, name in enumerate("ab"):
        write_documents(folder / name, random_documents(40, seed=seed))
    write_word_tokenizer(folder / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    return folder


def test_a_relative_and_an_absolute_path_to_the_same_dataset_agree(data, tmp_path):
    relative = config(["0.3", "data/a", "0.7", "data/b"], "data/tokenizer.json")
    absolute = config([f"3 {data / 'a'} 7 {data}/../data/b"], str(data / "tokenizer.json"))
    save(tmp_path / "ckpt", data_settings(relative))
    assert start(tmp_path / "ckpt", absolute) == Resume(2)
    save(tmp_path / "other", data_settings(absolute))
    assert start(tmp_path / "other", relative) == Resume(2)


def test_a_dataset_remade_under_the_same_name_is_refused_naming_it(data, tmp_path):
    run = config(["data/a"])
    save(tmp_path / "ckpt", data_settings(run))
    write_documents(data / "a", random_documents(41, seed=7))  # same name, other data
    with pytest.raises(BadCheckpointError) as refused:
        start(tmp_path / "ckpt", run)
    line = str(refused.value)
    assert "data.blend: 'data/a' (" in line and "holds other data than the checkpoint" in line
    assert "\n" not in line and "sha256" in line


def test_the_same_text_naming_other_files_from_another_folder_is_refused(data, tmp_path):
    run = config(["data/a"])
    save(tmp_path / "ckpt", data_settings(run))
    shutil.copytree(data, tmp_path / "elsewhere" / "data")  # the same bytes, other files
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path / "elsewhere")
        with pytest.raises(BadCheckpointError, match=r"data.blend: \['data/a'\] in the checkpoint"):
            start(tmp_path / "ckpt", run)


@pytest.mark.parametrize(
    "blend, agrees",
    [
        (["1 data/a 1 data/b"], True),  # weights compared as numbers
        (["0.5", "data/a", "0.5", "data/b:0:1"], True),
        (["1 data/a 2 data/b"], False),
        (["1 data/b 1 data/a"], False),
        (["1 data/a 1 data/b:0:0.5"], False),
        (["data/a"], False),
    ],
)
def test_the_blend_itself_must_be_the_same(data, tmp_path, blend, agrees):
    save(tmp_path / "ckpt", data_settings(config(["0.5 data/a 0.5 data/b"])))
    if agrees:
        assert start(tmp_path / "ckpt", config(blend)) == Resume(2)
    else:
        with pytest.raises(BadCheckpointError, match=r"data.blend: \['0.5 data/a 0.5 data/b'\]"):
            start(tmp_path / "ckpt", config(blend))


def test_a_record_of_text_paths_from_before_still_resumes(data, tmp_path):
    """The data_settings.json of checkpoints saved before data.datasets: the paths as typed."""
    record = data_settings(config(["data/a"], "data/tokenizer.json"))
    old = {key: value for key, value in record.items() if key != DATASETS}
    assert list(old) == [
        "training.seq_len",
        "data.blend",
        "data.split",
        "data.tokenizer",
        "data.format",
    ]
    assert old["data.blend"] == ["data/a"] and old["data.tokenizer"] == "data/tokenizer.json"
    save(tmp_path / "ckpt", old)
    now = config([str(data / "a")], str(data / "tokenizer.json"))
    assert start(tmp_path / "ckpt", now) == Resume(2)
    assert start(tmp_path / "ckpt", config(["data/a"], "data/tokenizer.json")) == Resume(2)
    with pytest.raises(BadCheckpointError, match=r"data.blend: \['data/a'\] in the checkpoint"):
        start(tmp_path / "ckpt", config(["data/b"], "data/tokenizer.json"))
    with pytest.raises(BadCheckpointError, match="data.tokenizer: 'data/tokenizer.json' in the"):
        start(tmp_path / "ckpt", config(["data/a"], ""))


def test_a_pair_prefix_is_identified_by_its_four_files(data, tmp_path):
    pairs = write_pairs(data / "p", *labelled_pairs(random_pair_lengths(20, 0, 8)))
    run = config(["data/p"], data_format="mtf")
    record = data_settings(run)
    assert sorted(record[DATASETS]["data/p"]["files"]) == [
        "_inputs_document.bin",
        "_inputs_document.idx",
        "_targets_document.bin",
        "_targets_document.idx",
    ]
    save(tmp_path / "ckpt", json.loads(json.dumps(record)))
    assert start(tmp_path / "ckpt", config([pairs], data_format="mtf")) == Resume(2)
    write_documents(Path(f"{pairs}_targets_document"), [np.arange(5)] * 20)
    with pytest.raises(BadCheckpointError, match="holds other data"):
        start(tmp_path / "ckpt", run)

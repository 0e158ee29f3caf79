"""The fingerprint of a Hugging Face folder's weights (interop/hf_fingerprint.py), which a LoRA
run's checkpoints record of their frozen base: the same weights however they are stored give the
same one; other weights, even one changed number, another one; and reading such a checkpoint as
a model refuses a base that is gone or has changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from bloomnative.interop import CheckpointFormatError
from bloomnative.interop.checkpoint_model import recorded_base_folder
from bloomnative.interop.hf_fingerprint import base_record, hf_fingerprint
from harness.hf_models import make_hf_bloom, save_hf_bloom
from harness.training import flip_bytes

SHAPE = {"vocab_size": 128, "hidden_size": 32, "n_layer": 2, "n_head": 4}


@pytest.fixture(scope="module")
def model():
    return make_hf_bloom(**SHAPE, seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory) -> Path:
    return save_hf_bloom(model, tmp_path_factory.mktemp("base"))


def test_the_same_weights_copied_or_sharded_otherwise_have_the_same_fingerprint(
    model, folder, tmp_path
):
    copy = shutil.copytree(folder, tmp_path / "copy")
    sharded = save_hf_bloom(model, tmp_path / "sharded", max_shard_size="20KB")
    assert json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert hf_fingerprint(copy) == hf_fingerprint(sharded) == hf_fingerprint(folder)
    assert hf_fingerprint(folder).startswith("hf-weights-v1:")


def test_other_weights_have_another_fingerprint(model, folder, tmp_path):
    retrained = save_hf_bloom(make_hf_bloom(**SHAPE, seed=2), tmp_path / "retrained")
    assert hf_fingerprint(retrained) != hf_fingerprint(folder)
    with torch.no_grad():
        edited = make_hf_bloom(**SHAPE, seed=1)
        edited.transformer.h[1].mlp.dense_4h_to_h.bias[0] += 1e-3
    assert hf_fingerprint(save_hf_bloom(edited, tmp_path / "edited")) != hf_fingerprint(folder)


def test_a_pickled_folder_is_hashed_whole(folder, tmp_path):
    pickled = shutil.copytree(folder, tmp_path / "bin")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    before = hf_fingerprint(pickled)
    flip_bytes(pickled / "pytorch_model.bin", count=1)
    assert hf_fingerprint(pickled) != before


def test_a_checkpoint_refuses_a_base_that_is_gone_or_changed(folder, tmp_path):
    checkpoint = SimpleNamespace(folder=tmp_path / "checkpoints" / "step-8")
    record = base_record(str(folder))
    assert recorded_base_folder(checkpoint, record) == str(folder.resolve())
    gone = {**record, "initial_hf": str(tmp_path / "moved")}
    with pytest.raises(CheckpointFormatError, match="no Hugging Face folder now.*--merge --base"):
        recorded_base_folder(checkpoint, gone)
    changed = {**record, "fingerprint": "hf-weights-v1:0"}
    with pytest.raises(CheckpointFormatError, match="whose weights have changed since"):
        recorded_base_folder(checkpoint, changed)

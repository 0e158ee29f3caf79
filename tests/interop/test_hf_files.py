"""Hugging Face folder formats: round trips, the layouts that load, the ones that are refused,
and how folders are written."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bloomnative.interop import CheckpointFormatError, load_hf_model, save_hf_model
from bloomnative.interop import hf as hf_module
from harness.hf_models import make_hf_bloom, relative_error, save_hf_bloom, tokens, transformers

SHAPE = dict(hidden_size=96, n_head=3, n_layer=2, vocab_size=120)


@pytest.fixture
def hf_bloom() -> transformers.BloomForCausalLM:
    return make_hf_bloom(**SHAPE, seed=1)


@pytest.fixture
def hf_folder(tmp_path, hf_bloom) -> Path:
    return save_hf_bloom(hf_bloom, tmp_path / "hf")


def safetensors_contents(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def assert_same_logits(model, hf_bloom) -> None:
    ids = tokens(SHAPE["vocab_size"])
    with torch.no_grad():
        assert relative_error(model(ids), hf_bloom(ids).logits) < 1e-5


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def rewrite_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_export_round_trip_is_tensor_for_tensor_identical(tmp_path, hf_bloom, dtype):
    source = save_hf_bloom(hf_bloom.to(dtype), tmp_path / "hf")
    save_hf_model(load_hf_model(source), tmp_path / "out", dtype=dtype)
    original, exported = safetensors_contents(source), safetensors_contents(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype == dtype, name
        assert torch.equal(exported[name], tensor), name


def test_loaded_model_is_fp32_with_the_head_tied(hf_folder):
    model = load_hf_model(hf_folder)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.word_embeddings.weight
    assert model.args.n_head == SHAPE["n_head"] and model.args.n_layer == SHAPE["n_layer"]


def test_overrides_and_dtype_reach_the_model(hf_folder):
    model = load_hf_model(hf_folder, dtype=torch.bfloat16, fused_kernels=True)
    assert model.args.fused_kernels
    assert model.word_embeddings.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="unknown BloomArgs fields"):
        load_hf_model(hf_folder, attn="sdpa")


def test_exported_config_describes_the_model(tmp_path, hf_folder):
    save_hf_model(load_hf_model(hf_folder), tmp_path / "out", dtype=torch.bfloat16, eos_token_id=2)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "bloom" and config["architectures"] == ["BloomForCausalLM"]
    assert (config["hidden_size"], config["n_head"], config["n_layer"]) == (96, 3, 2)
    assert config["tie_word_embeddings"] and config["dtype"] == "bfloat16"
    assert config["eos_token_id"] == 2 and "bos_token_id" not in config


# ---------------------------------------------------------------- layouts that load


def test_sharded_safetensors_with_index_load(tmp_path, hf_bloom):
    folder = save_hf_bloom(hf_bloom, tmp_path / "hf", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert_same_logits(load_hf_model(folder), hf_bloom)


def test_keys_without_transformer_prefix_and_a_tied_lm_head_load(hf_folder, hf_bloom):
    def strip_prefix_and_store_head(state):
        for name in list(state):
            state[name.removeprefix("transformer.")] = state.pop(name)
        state["lm_head.weight"] = state["word_embeddings.weight"].clone()

    rewrite_weights(hf_folder, strip_prefix_and_store_head)
    assert_same_logits(load_hf_model(hf_folder), hf_bloom)


def test_pytorch_bin_weights_load(hf_folder, hf_bloom):
    state = load_file(hf_folder / "model.safetensors")
    (hf_folder / "model.safetensors").unlink()
    torch.save(state, hf_folder / "pytorch_model.bin")
    assert_same_logits(load_hf_model(hf_folder), hf_bloom)


def test_config_key_aliases_are_accepted(hf_folder, hf_bloom):
    edit_config(hf_folder, hidden_size=None, n_head=None, n_layer=None)
    edit_config(hf_folder, n_embed=96, num_attention_heads=3, num_hidden_layers=2)
    assert_same_logits(load_hf_model(hf_folder), hf_bloom)


def test_large_export_is_sharded_with_an_index_that_transformers_reads(tmp_path, hf_folder):
    model = load_hf_model(hf_folder)
    out = save_hf_model(model, tmp_path / "out", max_shard_size=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shard_files) > 1
    assert sorted(set(index["weight_map"].values())) == [f.name for f in shard_files]
    for path in shard_files:
        with safe_open(str(path), framework="pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            assert len(sizes) == 1 or sum(4 * torch.Size(s).numel() for s in sizes) <= 30_000
    hf = transformers.BloomForCausalLM.from_pretrained(out).eval()
    assert_same_logits(model, hf)
    assert_same_logits(load_hf_model(out), hf)


# ---------------------------------------------------------------- folders that are refused


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="gpt2"), "model_type is 'gpt2', expected 'bloom'"),
        (dict(apply_residual_connection_post_layernorm=True), "post_layernorm = true"),
        (dict(n_head=None), "missing key 'n_head' or 'num_attention_heads'"),
        (dict(hidden_size=0), "hidden_size = 0, expected a positive integer"),
    ],
)
def test_configs_of_other_networks_are_refused_naming_file_and_key(hf_folder, changes, message):
    edit_config(hf_folder, **changes)
    with pytest.raises(CheckpointFormatError, match="config.json") as error:
        load_hf_model(hf_folder)
    assert message in str(error.value)


def test_missing_and_unexpected_tensors_are_listed(hf_folder):
    def drop_one_add_one(state):
        del state["transformer.h.1.mlp.dense_4h_to_h.bias"]
        state["transformer.h.0.self_attention.rotary"] = torch.zeros(3)

    rewrite_weights(hf_folder, drop_one_add_one)
    with pytest.raises(CheckpointFormatError) as error:
        load_hf_model(hf_folder)
    assert "missing tensors: transformer.h.1.mlp.dense_4h_to_h.bias" in str(error.value)
    assert "unexpected tensors: transformer.h.0.self_attention.rotary" in str(error.value)


def test_weights_of_another_shape_are_refused(hf_folder):
    edit_config(hf_folder, n_layer=3)
    with pytest.raises(CheckpointFormatError, match="missing tensors: transformer.h.2."):
        load_hf_model(hf_folder)


def test_an_untied_lm_head_is_refused(hf_folder):
    def store_untied_head(state):
        state["lm_head.weight"] = state["transformer.word_embeddings.weight"] + 1

    rewrite_weights(hf_folder, store_untied_head)
    with pytest.raises(CheckpointFormatError, match="lm_head.weight differs"):
        load_hf_model(hf_folder)


def test_untied_config_without_a_stored_head_is_refused(hf_folder):
    edit_config(hf_folder, tie_word_embeddings=False)
    with pytest.raises(CheckpointFormatError, match="tie_word_embeddings = false"):
        load_hf_model(hf_folder)


def test_pytorch_bin_holding_arbitrary_objects_is_not_unpickled(hf_folder):
    (hf_folder / "model.safetensors").unlink()
    torch.save({"created": datetime.date(2022, 7, 1)}, hf_folder / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match="weights_only=True"):
        load_hf_model(hf_folder)


def test_a_folder_without_config_or_weights_is_refused(tmp_path, hf_folder):
    with pytest.raises(CheckpointFormatError, match="has no config.json"):
        load_hf_model(tmp_path)
    (hf_folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match="has no weights"):
        load_hf_model(hf_folder)


# ---------------------------------------------------------------- writing folders


def test_export_never_overwrites_a_non_empty_folder_unless_asked(tmp_path, hf_folder):
    model = load_hf_model(hf_folder)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf_model(model, out)
    assert (out / "notes.txt").read_text() == "keep me"
    save_hf_model(model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


def test_a_failed_export_leaves_no_folder_behind(tmp_path, hf_folder, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_module, "write_safetensors_shards", fail)
    with pytest.raises(OSError, match="disk full"):
        save_hf_model(load_hf_model(hf_folder), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_tokenizer_json_is_copied_into_the_export(tmp_path, hf_folder):
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text('{"version": "1.0"}')
    out = save_hf_model(load_hf_model(hf_folder), tmp_path / "out", tokenizer_file=tokenizer)
    assert (out / "tokenizer.json").read_text() == tokenizer.read_text()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        save_hf_model(load_hf_model(hf_folder), tmp_path / "out2", tokenizer_file=tmp_path)

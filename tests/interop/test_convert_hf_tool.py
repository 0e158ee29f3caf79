"""tools/convert_hf.py: Hugging Face <-> native DCP checkpoints, driven through main()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.checkpoint.integrity import RECORD
from bloomnative.checkpoint.reading import verified_reader
from bloomnative.interop import CheckpointFormatError, load_hf_model, load_native_model
from bloomnative.model.state import model_state
from harness.hf_models import make_hf_bloom, relative_error, save_hf_bloom, tokens, transformers
from harness.training import load_tool, write_word_tokenizer

SHAPE = dict(hidden_size=96, n_head=3, n_layer=2, vocab_size=120)
# The trainer's checkpoint functions, used here without a process group, say so.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


convert_hf = load_tool("convert_hf")


@pytest.fixture
def hf_bloom() -> transformers.BloomForCausalLM:
    return make_hf_bloom(**SHAPE, seed=2)


@pytest.fixture
def hf_folder(tmp_path, hf_bloom) -> Path:
    return save_hf_bloom(hf_bloom, tmp_path / "hf")


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return transformers.BloomForCausalLM.from_pretrained(folder).eval()(ids).logits.float()


def forget_file(folder: Path, name: str) -> None:
    """Deletes a file of a checkpoint folder and its entry of the checksum record: the folder as
    if it had been written without it."""
    (folder / name).unlink()
    record = json.loads((folder / RECORD).read_text())
    del record["files"][name]
    (folder / RECORD).write_text(json.dumps(record))


def write_training_checkpoint(dump: Path, model, step: int) -> Path:
    """A full checkpoint as the trainer writes one: model, AdamW state, step and data position."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(tokens(SHAPE["vocab_size"])).sum().backward()
    optimizer.step()
    state = {
        "model": model_state([model]),
        "optimizer": ckpt.optimizer_state([model], [optimizer]),
        "train": {"step": torch.tensor(step)},
        "data": {"consumed_samples": 64, "skipped": []},
    }
    folder = dump / "checkpoints"
    ckpt.Checkpointer(folder, keep_latest_k=0, async_mode=False, min_free_gib=0).save(step, state)
    return folder / f"step-{step}"


def test_to_native_then_to_hf_reproduces_the_logits(tmp_path, hf_folder, hf_bloom):
    native = tmp_path / "native"
    assert convert_hf.main(["to-native", "--hf", str(hf_folder), "--out", str(native)]) == 0
    assert (native / ".metadata").is_file()
    out = tmp_path / "back"
    argv = ["to-hf", "--checkpoint", str(native), "--out", str(out), "--n-head", "3"]
    assert convert_hf.main(argv) == 0
    ids = tokens(SHAPE["vocab_size"])
    with torch.no_grad():
        reference = hf_bloom(ids).logits
    assert relative_error(hf_logits(out, ids), reference) < 1e-6


def test_training_checkpoint_exports_with_heads_from_the_run_config(tmp_path, hf_folder):
    model = load_hf_model(hf_folder)
    dump = tmp_path / "run"
    step_dir = write_training_checkpoint(dump, model, step=7)
    # The run's resolved config (the trainer writes every [model] key); the checkpoint has no
    # bloom_args.json, as training checkpoints of before issue 26 have none.
    shape = "".join(f"{key} = {value}\n" for key, value in SHAPE.items())
    (dump / "config.toml").write_text(f'[model]\npreset = "debug"\n{shape}')
    out = tmp_path / "exported"
    assert convert_hf.main(["to-hf", "--checkpoint", str(step_dir), "--out", str(out)]) == 0
    ids = tokens(SHAPE["vocab_size"], seed=4)
    with torch.no_grad():
        assert relative_error(hf_logits(out, ids), model(ids)) < 1e-6


def test_an_export_carries_the_runs_tokenizer_and_its_special_token_ids(tmp_path, hf_folder):
    """Without --tokenizer: the run's data.tokenizer, and config.json's eos (the run's EOD), bos
    (the tokenizer has no <s>: the EOD) and pad (the mtf run's data.pad_token, an id in the
    resolved config), which transformers' tokenizer knows too; tools/generate.py samples from
    the folder. (Before: no tokenizer, transformers' default ids 1 and 2, which are words here.)"""
    model = load_hf_model(hf_folder)
    dump = tmp_path / "run"
    step_dir = write_training_checkpoint(dump, model, step=3)
    (tmp_path / "words").mkdir()
    tokenizer = write_word_tokenizer(tmp_path / "words" / "tokenizer.json", SHAPE["vocab_size"])
    shape = "".join(f"{key} = {value}\n" for key, value in SHAPE.items())
    data = f'format = "mtf"\ntokenizer = "{tokenizer}"\npad_token = 5\n'
    (dump / "config.toml").write_text(f'[model]\npreset = "debug"\n{shape}[data]\n{data}')
    out = tmp_path / "exported"
    assert convert_hf.main(["to-hf", "--checkpoint", str(step_dir), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    config = json.loads((out / "config.json").read_text())
    ids = {key: config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert ids == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 5}
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf_tokenizer.eos_token, hf_tokenizer.pad_token) == ("<|endoftext|>", "w5")
    generate = load_tool("generate")
    argv = ["--checkpoint", str(out), "--prompt", "w1 w2", "--max-new-tokens", "3"]
    assert generate.main([*argv, "--device", "cpu"]) == 0

    flags = ["--eos-token-id", "7", "--pad-token-id", "0", "--overwrite"]
    assert convert_hf.main(["to-hf", "--checkpoint", str(step_dir), "--out", str(out), *flags]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 7, 0)


def test_bf16_export_with_tokenizer_loads_in_transformers(tmp_path, hf_folder, hf_bloom):
    native = tmp_path / "native"
    convert_hf.main(["to-native", "--hf", str(hf_folder), "--out", str(native)])
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json", SHAPE["vocab_size"])
    out = tmp_path / "bf16"
    argv = ["to-hf", "--checkpoint", str(native), "--out", str(out), "--n-head", "3"]
    assert convert_hf.main([*argv, "--dtype", "bf16", "--tokenizer", str(tokenizer)]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file()
    hf = transformers.BloomForCausalLM.from_pretrained(out)
    assert hf.transformer.word_embeddings.weight.dtype == torch.bfloat16
    ids = tokens(SHAPE["vocab_size"])
    with torch.no_grad():
        assert relative_error(hf(ids).logits, hf_bloom(ids).logits) < 0.05


def test_native_checkpoint_loads_into_a_training_model_by_canonical_names(tmp_path, hf_folder):
    native = tmp_path / "native"
    convert_hf.main(["to-native", "--hf", str(hf_folder), "--out", str(native)])
    reference = load_hf_model(hf_folder)
    model = load_native_model(native, n_head=3)
    fresh = type(model)(model.args)
    reader = verified_reader(native)
    ckpt.load_components(reader, {"model": ckpt.ModelState([fresh])}, complete=["model"])
    expected = reference.state_dict()
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert fresh.lm_head.weight is fresh.word_embeddings.weight


def test_to_native_records_what_the_shapes_cannot_show(tmp_path, hf_folder):
    config_path = hf_folder / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_norm_epsilon"] = 1e-6
    config_path.write_text(json.dumps(config))
    native = tmp_path / "native"
    convert_hf.main(["to-native", "--hf", str(hf_folder), "--out", str(native)])
    assert json.loads((native / "bloom_args.json").read_text())["n_head"] == 3
    out = tmp_path / "out"
    assert convert_hf.main(["to-hf", "--checkpoint", str(native), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["n_head"], config["layer_norm_epsilon"]) == (3, 1e-6)


def test_head_count_is_required_when_nothing_records_it(tmp_path, hf_folder, capsys):
    native = tmp_path / "native"
    convert_hf.main(["to-native", "--hf", str(hf_folder), "--out", str(native)])
    forget_file(native, "bloom_args.json")
    out = tmp_path / "out"
    assert convert_hf.main(["to-hf", "--checkpoint", str(native), "--out", str(out)]) == 2
    assert "--n-head" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(CheckpointFormatError, match="not divisible by n_head=5"):
        load_native_model(native, n_head=5)


def test_errors_are_reported_without_a_traceback(tmp_path, capsys):
    argv = ["to-hf", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x"), "--n-head", "2"]
    assert convert_hf.main(argv) == 2
    assert "not a DCP checkpoint folder" in capsys.readouterr().err
    assert convert_hf.main(["to-native", "--hf", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_to_native_refuses_to_overwrite_without_the_flag(tmp_path, hf_folder, capsys):
    argv = ["to-native", "--hf", str(hf_folder), "--out", str(tmp_path / "native")]
    assert convert_hf.main(argv) == 0
    assert convert_hf.main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert convert_hf.main([*argv, "--overwrite"]) == 0


def test_shard_sizes_parse_decimal_and_binary_units():
    assert convert_hf.parse_size("5GB") == 5 * 10**9
    assert convert_hf.parse_size("512MiB") == 512 * 2**20
    assert convert_hf.parse_size("1000") == 1000


def _heads_not_dividing(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_head": 5}))
    return folder / "config.json"


def _truncated(folder: Path) -> Path:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return weights


def _nan_weight(folder: Path) -> Path:
    weights = folder / "model.safetensors"
    state = load_file(weights)
    state["transformer.h.1.mlp.dense_h_to_4h.weight"][3, 5] = float("nan")
    save_file(state, weights, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_heads_not_dividing, "hidden_size=96 is not divisible by n_head=5"),
        (_truncated, "not a readable safetensors file: "),
        (_nan_weight, "transformer.h.1.mlp.dense_h_to_4h.weight holds NaN or infinite values"),
    ],
    ids=["n_head does not divide hidden_size", "truncated safetensors", "NaN weight"],
)
def test_a_broken_hugging_face_folder_is_one_line_naming_the_file(
    tmp_path, hf_folder, capsys, damage, problem
):
    named = damage(hf_folder)
    out = tmp_path / "native"
    assert convert_hf.main(["to-native", "--hf", str(hf_folder), "--out", str(out)]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert line.startswith(f"[convert_hf] error: {named}: ") and problem in line
    assert not out.exists()


@pytest.mark.parametrize(
    "flag, value", [("--n-head", "0"), ("--max-shard-size", "0"), ("--bos-token-id", "-1")]
)
def test_a_bad_flag_is_one_line_naming_it(tmp_path, capsys, flag, value):
    argv = ["to-hf", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), flag, value]
    with pytest.raises(SystemExit) as exit_:
        convert_hf.main(argv)
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and line.startswith(f"convert_hf.py to-hf: error: argument {flag}")

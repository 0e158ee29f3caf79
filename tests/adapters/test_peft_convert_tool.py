"""tools/convert_hf.py to-peft and to-hf --merge on a LoRA run: the commands end to end on a run
the trainer saved (PEFT loads the adapter folder onto the base and gives the checkpoint's model;
the merged folder is PEFT's merge_and_unload), and bad input as one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bloomnative.adapters import apply_lora
from bloomnative.interop import load_hf_model, load_native_model, save_native_checkpoint
from harness.hf_models import make_hf_bloom, relative_error, save_hf_bloom, tokens, transformers
from harness.launching import python_command, run
from harness.peft_reference import loaded_in_peft
from harness.training import REPO, TINY_RUN, load_tool, run_training

SHAPE = dict(hidden_size=32, n_head=4, n_layer=4, vocab_size=128)  # TINY_RUN's
TARGETS = ["query_key_value", "dense_h_to_4h"]
LORA = ["--lora.rank=4", "--lora.alpha=8", f"--lora.target_modules={','.join(TARGETS)}"]
# The trainer's checkpoint functions, used here without a process group, say so.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

convert_hf = load_tool("convert_hf")


def convert(*argv: str) -> None:
    """`python tools/convert_hf.py ARGV` as a user runs it; it must succeed."""
    run(python_command([str(REPO / "tools" / "convert_hf.py"), *argv]))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_hf_bloom(make_hf_bloom(**SHAPE, seed=7), tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def lora_run(synthetic_corpus, base, tmp_path_factory) -> Path:
    """The dump folder of a 2-step LoRA run from `base` (a high learning rate, so that the
    adapters move the logits well beyond the tolerances)."""
    dump = tmp_path_factory.mktemp("lora_run") / "run"
    run_training(
        [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            f"--job.dump_folder={dump}",
            f"--checkpoint.initial_hf={base}",
            "--checkpoint.interval=2",
            "--training.steps=2",
            "--optimizer.lr=0.05",
            *LORA,
        ]
    )
    return dump


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model(ids)
    return getattr(output, "logits", output)


@pytest.mark.multiprocess
def test_to_peft_and_to_hf_merge_give_the_runs_model_in_peft(lora_run, base, tmp_path, capfd):
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    convert("to-peft", "--checkpoint", str(lora_run), "--out", str(adapter))
    convert("to-hf", "--merge", "--checkpoint", str(lora_run), "--out", str(merged))

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        4,
        8.0,
        str(base),
    )
    theirs = loaded_in_peft(base, adapter, capfd)
    assert set(theirs.peft_config["default"].target_modules) == set(TARGETS)

    ids = tokens(SHAPE["vocab_size"], seed=5)
    ours = load_native_model(lora_run / "checkpoints" / "step-2").eval()  # adapters folded
    expected = logits(ours, ids)
    assert relative_error(logits(load_hf_model(base), ids), expected) > 1e-3  # they trained
    assert relative_error(logits(theirs, ids), expected) < 1e-5
    assert (
        relative_error(logits(transformers.BloomForCausalLM.from_pretrained(merged), ids), expected)
        < 1e-5
    )

    reference = theirs.merge_and_unload().state_dict()
    with safe_open(str(merged / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            torch.testing.assert_close(f.get_tensor(name), reference[name], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- bad input


def saved_step(dump: Path, model, lora: str = "", initial_hf: str = "") -> Path:
    """A run's dump folder holding `model` as its step-1 (the model-only writer) and the
    config.toml a run with these [lora] and checkpoint.initial_hf settings leaves."""
    step = save_native_checkpoint(model, dump / "checkpoints" / "step-1")
    shape = "".join(f"{key} = {value}\n" for key, value in SHAPE.items())
    checkpoint = f'[checkpoint]\ninitial_hf = "{initial_hf}"\n'
    (dump / "config.toml").write_text(f"[model]\n{shape}{checkpoint}{lora}")
    return step


LORA_SECTION = '[lora]\nrank = 4\nalpha = 8.0\ntarget_modules = ["query_key_value"]\n'


def adapted(base: Path):
    model = load_hf_model(base)
    apply_lora(model, 4, 8.0, 0.0, ["query_key_value"])
    return model


def error_line(capsys, *argv: str) -> str:
    assert convert_hf.main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("[convert_hf] error: ")
    return lines[-1]


def test_a_run_without_adapters_is_refused(base, tmp_path, capsys):
    dump = tmp_path / "run"
    saved_step(dump, load_hf_model(base))
    line = error_line(capsys, "to-peft", "--checkpoint", str(dump), "--out", str(tmp_path / "o"))
    assert "lora.rank = 0: the run trained no adapters" in line
    saved_step(tmp_path / "other", load_hf_model(base), LORA_SECTION)
    argv = ["--checkpoint", str(tmp_path / "other"), "--out", str(tmp_path / "o")]
    assert "holds no LoRA adapters" in error_line(capsys, "to-peft", *argv)
    assert not (tmp_path / "o").exists()


def test_merge_needs_a_base_that_fits(base, tmp_path, capsys):
    dump = tmp_path / "run"
    saved_step(dump, adapted(base), LORA_SECTION)
    argv = ["to-hf", "--merge", "--checkpoint", str(dump), "--out", str(tmp_path / "o")]
    assert "has no checkpoint.initial_hf: give the Hugging Face folder" in error_line(capsys, *argv)
    wide = save_hf_bloom(make_hf_bloom(**{**SHAPE, "hidden_size": 64}), tmp_path / "wide")
    line = error_line(capsys, *argv, "--base", str(wide))
    assert "query_key_value.lora_a.weight is (4, 32), (4, 64) in the model's adapters" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--base", "b"], "--base is the base folder of --merge"),
        (["--merge", "--n-head", "4"], "--merge takes the model's shape and head count"),
    ],
)
def test_flags_that_do_not_go_together_are_one_line(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit) as exit_:
        convert_hf.main(["to-hf", "--checkpoint", str(tmp_path), "--out", "o", *flags])
    assert exit_.value.code == 2 and says in capsys.readouterr().err

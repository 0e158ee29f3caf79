"""Every mistake in the user's input that a worker would meet is found by preflight, before
torchrun starts: one line naming the key, exit code 2. (Each of these was, before, "preflight
ok" and then the same traceback from every restart of the job.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bloomnative.config import parse_args
from bloomnative.data import IndexedDatasetBuilder
from bloomnative.launch.preflight import main as preflight
from bloomnative.model import BloomArgs
from bloomnative.train.resolved import resolve_run
from harness.launching import only_stderr_line
from harness.training import run_training


def hf_folder(folder: Path, n_layer: int = 4, hidden_size: int = 32, vocab_size: int = 128) -> str:
    """A Hugging Face folder's config.json and (empty) weight file: what preflight reads."""
    folder.mkdir()
    config = {"model_type": "bloom", "n_layer": n_layer, "n_head": 4, "hidden_size": hidden_size}
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--data.split=0,100,0"], "config error: data.split: the train split is empty: "),
        (
            ["--data.split=100,0,0", "--validation.freq=1"],
            "config error: data.split: the valid split is empty: ",
        ),
        (["--data.split=abc"], "config error: data.split: split 'abc' has a part that is not a "),
        (["--data.split=nan,1,1"], "config error: data.split: split 'nan,1,1' needs finite "),
        (["--optimizer.eps=nan"], "config error: optimizer.eps = nan: must be a finite number"),
        (["--optimizer.eps=0"], "config error: optimizer.eps must be positive, got 0.0"),
        (["--optimizer.weight_decay=-1"], "config error: optimizer.weight_decay must be >= 0"),
        (["--optimizer.lr=inf"], "config error: optimizer.lr = inf: must be a finite number"),
        (["--job.seed=-1"], "config error: job.seed = -1: must be in [0, 4294967295]"),
        (["--checkpoint.keep_latest_k=-1"], "config error: checkpoint.keep_latest_k must be >= 0"),
        (
            ["--activation_checkpoint.mode=selective", "--activation_checkpoint.every=0"],
            "config error: activation_checkpoint.every must be positive, got 0",
        ),
    ],
)
def test_splits_and_settings_a_worker_would_fail_on(tiny_run_args, overrides, message, capsys):
    assert preflight(["--world-size=1", *tiny_run_args, *overrides]) == 2
    assert only_stderr_line(capsys).startswith(message)


def test_a_dataset_without_documents_is_not_ok(tiny_run_args, tmp_path, capsys):
    empty = str(tmp_path / "empty_text_document")
    with IndexedDatasetBuilder(empty, vocab_size=128):
        pass
    assert preflight(["--world-size=1", *tiny_run_args, f"--data.blend={empty}"]) == 2
    assert only_stderr_line(capsys).startswith(
        f"config error: data.split: the train split is empty: split '1000,0,0' gives it no "
        f"documents of '{empty}' (0 documents)"
    )
    blank = str(tmp_path / "blank_text_document")
    with IndexedDatasetBuilder(blank, vocab_size=128) as builder:
        builder.add_document(np.array([], dtype=np.int32))
    assert preflight(["--world-size=1", *tiny_run_args, f"--data.blend={blank}"]) == 2
    assert "holds no tokens" in only_stderr_line(capsys)


def test_the_folders_the_run_writes_must_be_folders(tiny_run_args, tmp_path, capsys):
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("")
    assert preflight(["--world-size=1", *tiny_run_args, f"--job.dump_folder={in_the_way}"]) == 2
    assert (
        only_stderr_line(capsys)
        == f"config error: job.dump_folder: {in_the_way} is a file, not a folder"
    )
    below = in_the_way / "run"
    assert preflight(["--world-size=1", *tiny_run_args, f"--job.dump_folder={below}"]) == 2
    assert only_stderr_line(capsys) == (
        f"config error: job.dump_folder: {below} would be inside {in_the_way}, which is a file, "
        "not a folder"
    )
    assert preflight(["--world-size=1", *tiny_run_args, f"--data.cache_dir={in_the_way}"]) == 2
    assert only_stderr_line(capsys).startswith("config error: data.cache_dir: ")


def test_initial_hf_must_exist_and_have_the_models_shape(tiny_run_args, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert preflight(["--world-size=1", *tiny_run_args, f"--checkpoint.initial_hf={missing}"]) == 2
    assert only_stderr_line(capsys) == (
        f"config error: checkpoint.initial_hf: {missing} does not exist as a folder"
    )
    wider = hf_folder(tmp_path / "wider", hidden_size=64)
    assert preflight(["--world-size=1", *tiny_run_args, f"--checkpoint.initial_hf={wider}"]) == 2
    assert only_stderr_line(capsys) == (
        f"config error: checkpoint.initial_hf = {wider} holds another shape than [model] sets: "
        "model.hidden_size = 32 but its config.json has hidden_size = 64. Leave these keys "
        "unset (0: the shape is read from the folder) or set them to match"
    )
    same = hf_folder(tmp_path / "same")
    assert preflight(["--world-size=1", *tiny_run_args, f"--checkpoint.initial_hf={same}"]) == 0


def test_initial_hf_gives_the_shape_and_every_set_key_that_differs_is_in_one_line(
    tiny_run_args, tmp_path, capsys
):
    """The folder's config.json is the model's shape: keys [model] leaves unset come from it
    (model.preset then gives none; 'debug' has 4 layers of 192, 6 heads, 8192 tokens), and
    every set key that differs is named in the one line, not one per start."""
    unset = [arg for arg in tiny_run_args if not arg.startswith("--model.")]
    small = hf_folder(tmp_path / "small", n_layer=2, hidden_size=64, vocab_size=256)
    argv = [*unset, f"--checkpoint.initial_hf={small}"]
    assert preflight(["--world-size=1", *argv]) == 0
    assert "preflight ok: debug (0.1M parameters)" in capsys.readouterr().err
    run = resolve_run(parse_args(argv), 1, "cpu")
    shape = {key: getattr(run.model_args, key) for key in BloomArgs.SHAPE_FIELDS}
    assert shape == {"n_layer": 2, "hidden_size": 64, "n_head": 4, "vocab_size": 256}
    assert (run.config.model.n_layer, run.config.model.hidden_size) == (2, 64)  # config.toml's

    set_keys = [*unset, "--model.n_layer=4", "--model.n_head=4", "--model.vocab_size=128"]
    assert preflight(["--world-size=1", *set_keys, f"--checkpoint.initial_hf={small}"]) == 2
    assert only_stderr_line(capsys) == (
        f"config error: checkpoint.initial_hf = {small} holds another shape than [model] sets: "
        "model.n_layer = 4 but its config.json has n_layer = 2; model.vocab_size = 128 but its "
        "config.json has vocab_size = 256. Leave these keys unset (0: the shape is read from "
        "the folder) or set them to match"
    )


def test_a_load_step_that_does_not_exist(tiny_run_args, tmp_path, capsys):
    assert preflight(["--world-size=1", *tiny_run_args, "--checkpoint.load_step=999"]) == 2
    assert only_stderr_line(capsys) == (
        f"config error: checkpoint.load_step = 999: no complete checkpoint at "
        f"{tmp_path / 'run' / 'checkpoints' / 'step-999'}; {tmp_path / 'run' / 'checkpoints'} "
        "holds no complete checkpoint (set checkpoint.load_step = -1 to start afresh)"
    )


def test_load_step_0_starts_afresh_as_the_workers_do(tiny_run_args, tmp_path, capsys):
    """With no step-0 the workers start afresh (the folder's checkpoints set aside), from
    checkpoint.initial_hf if given; preflight takes that branch too (checkpoint/resume.py)."""
    assert preflight(["--world-size=1", *tiny_run_args, "--checkpoint.load_step=0"]) == 0
    capsys.readouterr()
    wider = hf_folder(tmp_path / "wider", hidden_size=64)
    argv = [
        "--world-size=1",
        *tiny_run_args,
        "--checkpoint.load_step=0",
        f"--checkpoint.initial_hf={wider}",
    ]
    assert preflight(argv) == 2
    assert "model.hidden_size = 32 but its config.json has hidden_size = 64" in only_stderr_line(
        capsys
    )


@pytest.mark.multiprocess
def test_a_worker_launched_without_preflight_fails_final_on_an_empty_split(tiny_run_args):
    """The same mistake reaching a worker is still a one-line error with the code (2) that the
    launcher does not restart, not a traceback."""
    proc = run_training([*tiny_run_args, "--data.split=0,100,0"], timeout=300, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "data error: the train split is empty: split '0,100,0' gives it no documents of "
        )
    )

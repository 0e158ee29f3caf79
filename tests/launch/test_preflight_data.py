"""Preflight opens the data and the tokenizer: a corrupt or mismatched file is one line naming
it, exit code 2, before torchrun starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from bloomnative.launch.preflight import main as preflight
from harness.indexed_data import write_documents
from harness.launching import run
from harness.training import (
    REPO,
    TINY_RUN,
    build_eod_heavy_corpus,
    build_synthetic_corpus,
    run_training,
    write_word_tokenizer,
)

BUNDLED = REPO / "assets" / "pydocs" / "pydocs_text_document"


@pytest.mark.multiprocess
def test_run_train_sh_stops_on_a_truncated_idx_before_torchrun(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    shutil.copy(BUNDLED.with_suffix(".bin"), prefix.with_suffix(".bin"))
    idx = prefix.with_suffix(".idx")
    idx.write_bytes(BUNDLED.with_suffix(".idx").read_bytes()[:-8])
    dump = tmp_path / "run"
    proc = run(
        [str(REPO / "run_train.sh"), f"--data.blend={prefix}", f"--job.dump_folder={dump}"],
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"data error: {idx}: truncated: ")
    assert proc.stdout == "" and not dump.exists()
    # Launched without the preflight, the trainer reports it the same way, without a traceback.
    args = [f"--data.blend={prefix}", f"--job.dump_folder={dump}", "--metrics.tensorboard=false"]
    proc = run_training(args, timeout=300, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"data error: {idx}: truncated: ")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--model.vocab_size=4096"],
            "config error: data.tokenizer: assets/pydocs/tokenizer.json has 8192 token ids but "
            "the model's vocabulary has 4096",
        ),
        (
            ["--data.tokenizer=/nowhere/tokenizer.json"],
            "config error: data.tokenizer: tokenizer file '/nowhere/tokenizer.json' does not exist",
        ),
        (
            ["--data.tokenizer=", "--model.vocab_size=4096"],
            "data error: assets/pydocs/pydocs_text_document.bin: token id 5362 (sequence 0, ",
        ),
    ],
)
def test_a_tokenizer_or_data_that_does_not_fit_the_model_is_one_line(overrides, message, capsys):
    assert preflight(["--world-size", "1", *overrides]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(message)


def test_a_good_run_reports_what_was_checked(capsys):
    assert preflight(["--world-size", "1"]) == 0
    assert "data: 1 dataset(s), 1,253,183 tokens checked in" in capsys.readouterr().err


def _copies(source: Path, folder: Path, count: int) -> list[Path]:
    """`count` datasets holding the tokens of `source`, at <folder>/d<i>."""
    folder.mkdir()
    idx, bin_ = (source.with_suffix(s).read_bytes() for s in (".idx", ".bin"))
    for i in range(count):
        (folder / f"d{i}.idx").write_bytes(idx)
        (folder / f"d{i}.bin").write_bytes(bin_)
    return [folder / f"d{i}" for i in range(count)]


@pytest.mark.multiprocess
def test_a_blend_of_2000_datasets_trains_under_a_limit_of_1024_open_files(tmp_path):
    """Each dataset's .bin and .idx, and each cached index array, used to keep a file open
    (np.memmap's duplicate descriptor): 300 datasets passed preflight, then the trainer died in
    its set-up with "Too many open files". Now they are mapped with none kept open."""
    source = Path(build_synthetic_corpus(str(tmp_path / "source"), documents=4))
    prefixes = _copies(source, tmp_path / "blend", 2000)
    dump = tmp_path / "run"
    args = [
        *TINY_RUN,
        "--model.n_layer=1",
        "--training.steps=1",
        "--checkpoint.enable=false",
        f"--job.dump_folder={dump}",
        # Relative to the run's folder: 2,000 absolute paths would pass the 128 KiB that one
        # argument may hold.
        f"--data.blend={' '.join(f'1 {p.relative_to(tmp_path)}' for p in prefixes)}",
    ]
    limited = ["bash", "-c", 'ulimit -n 1024 && exec "$@"', "bash"]  # soft and hard limit
    command = [*limited, str(REPO / "run_train.sh"), *args]
    proc = run(command, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preflight ok" in proc.stderr and "data: 2000 dataset(s)" in proc.stderr
    assert "step 1 |" in proc.stdout + proc.stderr


def test_a_blend_the_memory_map_limit_cannot_hold_is_one_line(tmp_path, monkeypatch, capsys):
    """The maps do grow with the blend: preflight counts those training will hold and refuses
    a blend that vm.max_map_count cannot take, before any worker."""
    import bloomnative.data.file_map as file_map

    source = Path(build_synthetic_corpus(str(tmp_path / "source"), documents=20))
    prefixes = _copies(source, tmp_path / "blend", 3)
    blend = f"--data.blend={' '.join(f'1 {p}' for p in prefixes)}"
    args = [*TINY_RUN, blend, f"--job.dump_folder={tmp_path / 'run'}"]
    # 3 x (.bin + .idx) + the train split's 3 x 3 sample-index arrays + the blend's 2.
    in_use = file_map.maps_in_use()
    monkeypatch.setattr(file_map, "max_map_count", lambda: in_use + 16)
    assert preflight(["--world-size", "1", *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "config error: data.blend: its 3 datasets need 17 memory maps in each training process"
    )
    assert "vm.max_map_count = " in line and "sysctl -w vm.max_map_count=" in line
    monkeypatch.setattr(file_map, "max_map_count", lambda: in_use + 1000)
    assert preflight(["--world-size", "1", *args]) == 0


@pytest.fixture
def eod_data(tmp_path) -> tuple[Path, Path, Path]:
    """(dataset without an EOD, dataset with one after each document, their tokenizer)."""
    rng = np.random.default_rng(0)
    without = write_documents(
        tmp_path / "no_eod", [rng.integers(1, 128, 60) for _ in range(100)], 128
    )
    with_eod = build_eod_heavy_corpus(str(tmp_path / "eod"))
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    return Path(without), Path(with_eod), tokenizer


def _reset_attention_run(tmp_path: Path, tokenizer: Path, *blend: Path) -> list[str]:
    return [
        "--world-size",
        "1",
        *TINY_RUN,
        f"--data.tokenizer={tokenizer}",
        "--data.reset_attention_mask=true",
        f"--data.blend={' '.join(f'1 {prefix}' for prefix in blend)}",
        f"--job.dump_folder={tmp_path / 'run'}",
    ]


def test_reset_attention_mask_on_data_without_its_eod_is_one_line(tmp_path, eod_data, capsys):
    """The option cuts samples at the EOD; on data that holds none it did nothing, silently."""
    without, with_eod, tokenizer = eod_data
    assert preflight(_reset_attention_run(tmp_path, tokenizer, without)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"config error: data.reset_attention_mask = true: no dataset of data.blend ({without}) "
        "holds the end-of-document token it cuts samples at (id 0: "
    )
    assert line.endswith("or set data.reset_attention_mask = false")
    # Some datasets of the blend with EODs: the others are named in a warning.
    assert preflight(_reset_attention_run(tmp_path, tokenizer, with_eod, without)) == 0
    err = capsys.readouterr().err
    assert (
        "data.reset_attention_mask: 1 of the blend's 2 datasets hold no EOD token (id 0): "
        f"{without}; their samples are not cut into documents"
    ) in err
    assert preflight(_reset_attention_run(tmp_path, tokenizer, with_eod)) == 0
    assert "WARNING" not in capsys.readouterr().err

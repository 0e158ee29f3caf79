"""Preflight opens the data and the tokenizer: a corrupt or mismatched file is one line naming
it, exit code 2, before torchrun starts."""

from __future__ import annotations

import shutil

import pytest

from bloomnative.launch.preflight import main as preflight
from harness.launching import run
from harness.training import REPO, run_training

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

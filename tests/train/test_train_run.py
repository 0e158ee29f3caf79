"""End to end: the launcher trains and leaves metrics, TensorBoard events and a checkpoint; the
same seed gives the same run; training can start from a Hugging Face folder."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from bloomnative.config import parse_args
from bloomnative.data import PretrainingLoader, build_gpt_datasets
from bloomnative.interop import load_native_model
from training_helpers import (
    REPO,
    TINY_RUN,
    losses_by_step,
    metric_rows,
    run_training,
    train_env,
)

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops", "mfu", "mem_peak_gib"}


def test_run_train_sh_writes_metrics_tensorboard_and_a_checkpoint(tmp_path):
    """The real launcher with the default (debug) config on the bundled corpus, cut short."""
    proc = subprocess.run(
        [
            str(REPO / "run_train.sh"),
            "--training.steps=3",
            "--training.seq_len=64",
            "--validation.freq=3",
            "--validation.steps=1",
            "--metrics.log_freq=1",
            f"--job.dump_folder={tmp_path}",
        ],
        cwd=REPO,
        env={**train_env(), "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = metric_rows(tmp_path)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for row in train_rows:
        assert REQUIRED <= set(row), REQUIRED - set(row)
        assert row["mfu"] is None  # CPU, no configured peak
        assert row["tokens_per_sec"] > 0 and row["tflops"] > 0
    assert any("eval_loss" in r for r in rows)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "step-3").is_dir()
    assert "step 3 | loss" in proc.stdout
    # The default run ends with a sample from its final checkpoint, starting with the prompt.
    sample = parse_args([]).validation
    assert sample.sample_tokens > 0
    header = f"[bloomnative] sample from step-3 (more: tools/generate.py --checkpoint {tmp_path} "
    after = proc.stdout.split(header, 1)[1].split("\n", 1)[1]
    assert after.startswith(sample.sample_prompt) and len(after) > len(sample.sample_prompt) + 1


def test_two_runs_with_the_same_seed_are_identical(tmp_path, synthetic_corpus):
    runs = []
    for name in ("a", "b"):
        run_training(
            [
                *TINY_RUN,
                f"--data.blend={synthetic_corpus}",
                "--training.steps=4",
                f"--job.dump_folder={tmp_path / name}",
                "--checkpoint.enable=false",
            ]
        )
        runs.append(losses_by_step(tmp_path / name))
    assert runs[0] == runs[1] and len(runs[0]) == 4


def test_initial_hf_starts_from_the_hugging_face_weights(tmp_path, synthetic_corpus):
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=4, n_head=4)
    hf = transformers.BloomForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    run_training(
        [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            "--training.steps=1",
            f"--job.dump_folder={tmp_path / 'run'}",
            "--checkpoint.enable=false",
            f"--checkpoint.initial_hf={tmp_path / 'hf'}",
        ]
    )
    train, _, _ = build_gpt_datasets(synthetic_corpus, "1000,0,0", 32, 42, (8, 0, 0), None)
    batches = PretrainingLoader(train, 8, 0, 1, prefetch=False).next_batch(8)
    ((inputs, labels),) = batches
    with torch.no_grad():
        expected = F.cross_entropy(hf(inputs).logits.flatten(0, 1), labels.flatten())
    assert losses_by_step(tmp_path / "run")[1] == pytest.approx(expected.item(), rel=1e-5)


def test_hf_export_of_a_trained_run_loads_in_transformers_with_the_same_logits(
    tmp_path, synthetic_corpus
):
    dump = tmp_path / "run"
    run_training(
        [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            "--training.steps=3",
            f"--job.dump_folder={dump}",
            "--parallelism.dp_shard=2",
        ],
        nproc=2,
    )
    step = dump / "checkpoints" / "step-3"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "convert_hf.py"),
            "to-hf",
            "--checkpoint",
            str(step),
            "--out",
            str(tmp_path / "hf"),
        ],
        check=True,
        env=train_env(),
        capture_output=True,
        timeout=300,
    )
    ours = load_native_model(step)
    theirs = transformers.BloomForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = ours.layers["0"].self_attention.dense.bias
    assert trained.abs().max() > 0  # biases start at zero: these weights were trained
    tokens = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_validation_at_a_longer_sequence_length_is_logged(tmp_path, synthetic_corpus):
    dump = tmp_path / "run"
    run_training(
        [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            "--training.steps=2",
            f"--job.dump_folder={dump}",
            "--checkpoint.enable=false",
            "--data.split=900,100,0",
            "--validation.freq=2",
            "--validation.steps=1",
            "--validation.seq_len=64",
        ]
    )
    (row,) = [r for r in metric_rows(dump) if "eval_loss" in r]
    assert row["step"] == 2 and row["eval_loss_long"] > 0 and row["eval_ppl"] > 1


def test_logged_loss_is_the_mean_over_the_log_interval_and_each_step_is_in_tensorboard(
    tmp_path, synthetic_corpus
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_training(
        [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            "--training.steps=6",
            "--metrics.log_freq=4",
            "--metrics.tensorboard=true",
            f"--job.dump_folder={tmp_path}",
            "--checkpoint.enable=false",
        ]
    )
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    per_step = {e.step: e.value for e in events.Scalars("loss_step")}
    assert sorted(per_step) == [1, 2, 3, 4, 5, 6]
    logged = losses_by_step(tmp_path)
    assert sorted(logged) == [1, 4, 6]  # the first step, every 4th, the last
    for step, first in ((1, 1), (4, 2), (6, 5)):  # each row covers the steps since the last
        interval = [per_step[s] for s in range(first, step + 1)]
        assert logged[step] == pytest.approx(sum(interval) / len(interval), rel=1e-6)
    assert logged[4] != pytest.approx(per_step[4], rel=1e-6)  # not just the last step's

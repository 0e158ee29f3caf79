"""The memory planner against what real training steps allocate on CPU (see
memory_measurement.py for what each measurement sees)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from memory_measurement import (
    MICRO_BATCH,
    MICRO_BATCHES,
    build_trainer,
    measured_step_peak,
    optimizer_state_tensors,
    parameters,
    predict,
    predicted_saved_bytes,
    relative_error,
    saved_activation_bytes,
    storage_bytes,
)

TOLERANCE = 0.15
HERE = Path(__file__).resolve().parent


def test_model_states_match_the_live_tensors(tmp_path):
    trainer = build_trainer(tmp_path)
    trainer.train_step()  # AdamW allocates its moments on the first step
    estimate = predict(trainer)
    assert storage_bytes(parameters(trainer)) == estimate.component("fp32 weights").bytes
    assert (
        storage_bytes(optimizer_state_tensors(trainer)) == estimate.component("AdamW moments").bytes
    )
    trainer.forward_backward(trainer.train_loader.next_batch(MICRO_BATCH * MICRO_BATCHES))
    grads = [p.grad for p in parameters(trainer)]
    assert storage_bytes(grads) == estimate.component("fp32 gradients").bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_saved_activations_match_the_estimate(tmp_path, dtype):
    trainer = build_trainer(tmp_path, f"--training.dtype={dtype}")
    measured = saved_activation_bytes(trainer)
    predicted = predicted_saved_bytes(predict(trainer))
    assert relative_error(predicted, measured) < TOLERANCE, (predicted, measured)


def test_step_peak_and_recompute_saving_match_the_estimate(tmp_path):
    measured, predicted = {}, {}
    for mode in ("none", "full"):
        trainer = build_trainer(tmp_path / mode, f"--activation_checkpoint.mode={mode}")
        trainer.train_step()  # warm-up: AdamW state exists from now on
        measured[mode] = measured_step_peak(trainer)
        predicted[mode] = predict(trainer).allocated_peak
        assert relative_error(predicted[mode], measured[mode]) < TOLERANCE, (mode, predicted)
    saving_measured = measured["none"] - measured["full"]
    saving_predicted = predicted["none"] - predicted["full"]
    assert saving_measured > 0
    assert relative_error(saving_predicted, saving_measured) < TOLERANCE


@pytest.mark.multiprocess
def test_pipeline_ranks_peaks_match_the_estimate(tmp_path):
    """Two pipeline stages under 1F1B with four micro batches: the first stage holds two in
    flight, the last stage the loss and, through return_outputs, every micro batch's logits."""
    overrides = [
        "--parallelism.pp=2",
        "--parallelism.dp_shard=1",
        "--parallelism.pp_microbatches=4",
        "--training.global_batch_size=16",
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(HERE / "memory_worker.py"),
        str(tmp_path),
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        error = relative_error(result["predicted"], result["measured"])
        assert error < TOLERANCE, (rank, result)

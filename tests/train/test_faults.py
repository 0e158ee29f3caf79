"""Non-finite losses are skipped (and counted) instead of corrupting the weights, and a run that
keeps producing them stops with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from training_helpers import TINY_RUN, metric_rows, run_training, train_env

# Runs the real trainer in a fresh process with forward_backward returning NaN at chosen steps.
INJECT_NAN = textwrap.dedent(
    """
    import json, sys
    import torch
    from bloomnative.config import parse_args
    from bloomnative.train.distributed import exit_process
    from bloomnative.train.trainer import Trainer

    nan_steps = set(json.loads(sys.argv[1]))
    trainer = Trainer(parse_args(sys.argv[2:]))
    real = trainer.forward_backward

    def forward_backward(micro_batches):
        loss = real(micro_batches)
        if trainer.step + 1 in nan_steps:
            for p in trainer.params:
                p.grad.fill_(float("nan"))
        return loss

    trainer.forward_backward = forward_backward
    real_step = trainer.train_step

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def optimizer_state():
        # Weights, AdamW moments and step counts: this rank's shards.
        tensors = [local(p).detach().clone() for p in trainer.params]
        for opt in trainer.optimizers:
            for state in opt.state.values():
                tensors += [local(t).detach().clone() for t in state.values()]
        return tensors

    def train_step():
        skipped = trainer.step + 1 in nan_steps
        before = optimizer_state() if skipped else None
        result = real_step()
        if skipped:
            same = all(torch.equal(a, b) for a, b in zip(before, optimizer_state(), strict=True))
            print(f"step {trainer.step} skipped, state unchanged: {same}", flush=True)
        return result

    trainer.train_step = train_step
    trainer.run()
    exit_process(0)
    """
)


def run_with_nan(
    tmp_path: Path, corpus: str, nan_steps: list[int], *extra: str, nproc: int = 0
) -> subprocess.CompletedProcess:
    script = tmp_path / "inject.py"
    script.write_text(INJECT_NAN)
    argv = [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={tmp_path / 'run'}",
        "--checkpoint.enable=false",
        *extra,
    ]
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*launcher, str(script), json.dumps(nan_steps), *argv],
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "implementation, nproc",
    [
        ("foreach", 0),  # decided on the host
        ("fused", 0),  # decided on the device: found_inf read by the fused AdamW kernel
        ("fused", 2),  # ... with FSDP2's DTensor parameters
    ],
)
def test_a_nan_gradient_step_is_skipped_and_counted(
    tmp_path, synthetic_corpus, implementation, nproc
):
    proc = run_with_nan(
        tmp_path,
        synthetic_corpus,
        [3],
        "--training.steps=5",
        f"--optimizer.implementation={implementation}",
        nproc=nproc,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step 3 skipped, state unchanged: True" in proc.stdout
    rows = {row["step"]: row for row in metric_rows(tmp_path / "run")}
    assert [rows[s]["nonfinite_skipped"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert all(rows[s]["loss"] == rows[s]["loss"] for s in rows)  # later losses are finite
    # The skipped step does not advance the learning-rate schedule (as in Megatron).
    assert rows[4]["lr"] == rows[3]["lr"] != rows[5]["lr"]


def test_consecutive_nonfinite_steps_stop_the_run_with_a_message(tmp_path, synthetic_corpus):
    proc = run_with_nan(
        tmp_path,
        synthetic_corpus,
        [2, 3, 4],
        "--training.steps=10",
        "--training.max_nonfinite_steps=3",
    )
    assert proc.returncode != 0
    assert "non-finite for 3 consecutive steps (training.max_nonfinite_steps)" in proc.stderr


def test_config_errors_stop_before_any_work_with_exit_code_2(tmp_path):
    proc = run_training(["--training.stepz=3"], timeout=120, check=False)
    assert proc.returncode == 2
    assert "unknown key 'training.stepz'" in proc.stderr

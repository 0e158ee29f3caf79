"""Every parallel layout trains exactly like the single-process run: same loss at every step
(relative difference < 1e-4) and the same final parameters, on CPU with gloo in fp32. Layouts
that also evaluate (context parallelism: at the training length and at twice it) match the
single-process eval_loss and eval_loss_long as well."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training_helpers import TINY_RUN, losses_by_step, metric_rows, train_env

RUNNER = Path(__file__).with_name("layout_runner.py")
BASE = [*TINY_RUN, "--training.steps=5", "--checkpoint.enable=false", "--parallelism.dp_shard=-1"]
# Evaluation after the last step on one batch of the validation split, at the training length
# and at twice it (TINY_RUN's seq_len is 32); the higher lr keeps the reference learning on the
# smaller training split.
VALIDATION = [
    "--data.split=800,200,0",
    "--validation.freq=5",
    "--validation.steps=1",
    "--validation.seq_len=64",
    "--optimizer.lr=6e-3",
]
CP2 = [*VALIDATION, "--parallelism.cp=2"]

LAYOUTS = {
    1: {
        "single": [],
        "single_fused_loss": ["--model.fused_loss=true"],
        "single_validation": VALIDATION,
    },
    2: {
        "fsdp2_zero3": ["--parallelism.zero_stage=3"],
        "fsdp2_zero2": ["--parallelism.zero_stage=2"],
        "tp2_sp_lossparallel": ["--parallelism.tp=2"],
        "tp2_no_sp": [
            "--parallelism.tp=2",
            "--parallelism.sequence_parallel=false",
            "--parallelism.loss_parallel=false",
        ],
        "pp2_gpipe": ["--parallelism.pp=2", "--parallelism.pp_schedule=GPipe"],
        "pp2_1f1b": ["--parallelism.pp=2", "--parallelism.pp_schedule=1F1B"],
        "pp2_zbv": [
            "--parallelism.pp=2",
            "--parallelism.pp_schedule=ZBVZeroBubble",
            "--parallelism.pp_stages_per_rank=2",
        ],
        "pp2_interleaved1f1b": [
            "--parallelism.pp=2",
            "--parallelism.pp_stages_per_rank=2",
            "--parallelism.pp_schedule=Interleaved1F1B",
        ],
        "pp2_interleaved_zero_bubble": [
            "--parallelism.pp=2",
            "--parallelism.pp_stages_per_rank=2",
            "--parallelism.pp_schedule=InterleavedZeroBubble",
        ],
        "pp2_uneven_1_3": ["--parallelism.pp=2", "--parallelism.pp_layers_per_stage=1,3"],
        "fsdp2_ac_full": ["--activation_checkpoint.mode=full"],
        "fsdp2_fused_loss": ["--model.fused_loss=true"],
        "fsdp2_ac_compile": ["--activation_checkpoint.mode=full", "--compile.enable=true"],
        "pp2_fused_loss": ["--parallelism.pp=2", "--model.fused_loss=true"],
        "tp2_ac_selective": [
            "--parallelism.tp=2",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.every=2",
        ],
        "cp2": CP2,
        "cp2_ac_full_compile": [*CP2, "--activation_checkpoint.mode=full", "--compile.enable=true"],
        "cp2_ac_selective_fused_loss": [
            *CP2,
            "--activation_checkpoint.mode=selective",
            "--model.fused_loss=true",
        ],
    },
    4: {
        "hsdp_2x2": ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"],
        "dp2_cp2": CP2,
        "tp2_cp2": [*CP2, "--parallelism.tp=2"],
        # The pipeline schedule is built for one sequence length: no eval_loss_long under PP.
        "pp2_cp2": [*CP2, "--parallelism.pp=2", "--validation.seq_len=0"],
    },
    8: {"dp2_tp2_pp2": ["--parallelism.tp=2", "--parallelism.pp=2"]},
}


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> Path:
    """Runs all layouts, one torchrun world per world size."""
    out = tmp_path_factory.mktemp("layouts")
    base = [*BASE, f"--data.blend={synthetic_corpus}", f"--data.cache_dir={out / 'cache'}"]
    env = train_env()
    for nproc, layouts in LAYOUTS.items():
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(RUNNER),
            str(out),
            json.dumps(layouts),
            *base,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"world {nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return out


def losses(folder: Path) -> list[float]:
    return list(losses_by_step(folder).values())


def params(folder: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("params_pp*.pt")):
        merged.update(torch.load(path, weights_only=True))
    return merged


def evaluations(folder: Path) -> dict[str, float]:
    (row,) = [row for row in metric_rows(folder) if "eval_loss" in row]
    return {key: row[key] for key in ("eval_loss", "eval_loss_long") if key in row}


REFERENCES = {"single", "single_validation"}
ALL = [name for world in LAYOUTS.values() for name in world if name not in REFERENCES]


def reference_of(layout: str) -> str:
    """The single-process run with the same data split and evaluation."""
    overrides = next(world[layout] for world in LAYOUTS.values() if layout in world)
    return "single_validation" if "--validation.freq=5" in overrides else "single"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ALL)
def test_layout_matches_single_process(runs, layout):
    single = reference_of(layout)
    reference, candidate = losses(runs / single), losses(runs / layout)
    assert len(reference) == len(candidate) == 5
    assert reference[-1] < reference[0] - 0.05, "the reference run should be learning"
    for step, (a, b) in enumerate(zip(reference, candidate, strict=True), start=1):
        assert abs(a - b) / abs(a) < 1e-4, f"step {step}: {layout} loss {b} vs {single} {a}"
    if single == "single_validation":
        expected = evaluations(runs / single)
        for key, b in evaluations(runs / layout).items():
            a = expected[key]
            assert abs(a - b) / abs(a) < 1e-4, f"{key}: {layout} {b} vs {single} {a}"
    ref_params, got = params(runs / single), params(runs / layout)
    assert set(got) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)

"""Every parallel layout trains exactly like the single-process run: same loss at every step
(relative difference < 1e-4) and the same final parameters, on CPU with gloo in fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bloomnative.data import IndexedDatasetBuilder

RUNNER = Path(__file__).with_name("layout_runner.py")
REPO = Path(__file__).resolve().parents[2]

# A 4-block model small enough for 8 processes on 2 cores; 5 optimizer steps.
BASE = [
    "--model.n_layer=4",
    "--model.hidden_size=32",
    "--model.n_head=4",
    "--model.vocab_size=128",
    "--training.steps=5",
    "--training.seq_len=32",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=2",
    "--training.dtype=fp32",
    "--optimizer.lr=3e-3",
    "--optimizer.min_lr=3e-4",
    "--lr_scheduler.warmup_steps=2",
    "--checkpoint.enable=false",
    "--metrics.tensorboard=false",
    "--metrics.log_freq=1",
    "--data.split=1000,0,0",
    "--data.prefetch=false",
    "--validation.freq=0",
    "--parallelism.dp_shard=-1",
]

LAYOUTS = {
    1: {"single": []},
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
        "pp2_uneven_1_3": ["--parallelism.pp=2", "--parallelism.pp_layers_per_stage=1,3"],
        "fsdp2_ac_full": ["--activation_checkpoint.mode=full"],
        "tp2_ac_selective": [
            "--parallelism.tp=2",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.every=2",
        ],
    },
    4: {"hsdp_2x2": ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"]},
    8: {"dp2_tp2_pp2": ["--parallelism.tp=2", "--parallelism.pp=2"]},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "synthetic_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=128) as builder:
        for _ in range(200):
            # Documents with structure (a repeating pattern plus noise) so the loss moves.
            length = int(rng.integers(20, 120))
            start = int(rng.integers(0, 128))
            doc = (start + np.arange(length) * int(rng.integers(1, 5))) % 128
            noise = rng.random(length) < 0.2
            doc[noise] = rng.integers(0, 128, noise.sum())
            builder.add_document(doc)
    return prefix


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> Path:
    """Runs all layouts, one torchrun world per world size."""
    out = tmp_path_factory.mktemp("layouts")
    base = [*BASE, f"--data.blend={dataset}", f"--data.cache_dir={out / 'cache'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
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
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def params(folder: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("params_pp*.pt")):
        merged.update(torch.load(path, weights_only=True))
    return merged


ALL = [name for world in LAYOUTS.values() for name in world if name != "single"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ALL)
def test_layout_matches_single_process(runs, layout):
    reference, candidate = losses(runs / "single"), losses(runs / layout)
    assert len(reference) == len(candidate) == 5
    assert reference[-1] < reference[0] - 0.05, "the reference run should be learning"
    for step, (a, b) in enumerate(zip(reference, candidate, strict=True), start=1):
        assert abs(a - b) / abs(a) < 1e-4, f"step {step}: {layout} loss {b} vs single {a}"
    ref_params, got = params(runs / "single"), params(runs / layout)
    assert set(got) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)

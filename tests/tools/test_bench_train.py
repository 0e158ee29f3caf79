"""tools/bench_train.py end to end on CPU: a few real training steps, timed and reported."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from harness.launching import python_command, run
from harness.training import REPO, load_tool

SMALL_RUN = [
    "--training.seq_len=128",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=4",
    "--data.prefetch=false",
    "--matmul-size=256",
    "--warmup=1",
    "--steps=2",
]


def run_bench(tmp_path: Path, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "2"}
    bench = python_command([str(REPO / "tools" / "bench_train.py"), *args])
    return run(bench, cwd=REPO, env=env, timeout=timeout, check=False)


def positive_finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def check_run(result: dict, steps: int) -> None:
    for key in (
        "step_time_s_median",
        "step_time_s_p90",
        "tokens_per_sec_median",
        "tokens_per_sec_p90",
        "tflops_median",
        "mfu_matmul_ceiling",
        "first_step_s",
    ):
        assert positive_finite(result[key]), (key, result[key])
    assert result["tokens_per_sec_p90"] <= result["tokens_per_sec_median"]
    assert len(result["step_times_s"]) == steps
    assert math.isfinite(result["loss_first"]) and math.isfinite(result["loss_last"])
    assert result["mfu_device_peak"] is None  # CPU, no --peak-tflops
    assert positive_finite(result["memory"]["peak_rss_gib"])


@pytest.mark.multiprocess
def test_bench_train_reports_ours_and_hugging_face(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench(
        tmp_path,
        *SMALL_RUN,
        "--model.n_layer=2",
        "--baseline=hf",
        "--baseline-modes=eager",
        "--activation_checkpoint.mode=auto",
        "--activation_checkpoint.memory_budget_gib=1",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["torch"] and report["date"]
    assert report["config"]["seq_len"] == 128 and report["config"]["n_layer"] == 2
    assert positive_finite(report["matmul_ceiling"]["tflops"])
    ours, theirs = report["bloomnative"], report["baseline"]["hf_eager"]
    check_run(ours, steps=2)
    check_run(theirs, steps=2)
    assert ours["compile_s"] is None  # compile.enable is false
    chosen = report["recompute_chosen_by_planner"]  # the planner picked what was run
    assert chosen["predicted_device_gib"] <= chosen["capacity_gib"] == 1
    assert report["config"]["activation_checkpoint"] == chosen["mode"]
    assert 0 < report["memory_plan"]["allocated_peak_gib"] < 1
    ratio = report["ratio_ours_over_hf_eager"]
    assert math.isclose(
        ratio, ours["tokens_per_sec_median"] / theirs["tokens_per_sec_median"], rel_tol=1e-9
    )
    # The same batches from the same initial-loss scale: both start near ln(vocab).
    assert abs(theirs["loss_first"] - ours["loss_first"]) < 0.5
    assert "ratio_ours_over_hf_eager" in proc.stdout


@pytest.mark.multiprocess
def test_bench_train_reports_torchtitan_llama3_with_its_own_flops(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench(
        tmp_path,
        *SMALL_RUN,
        "--model.n_layer=2",
        "--baseline=torchtitan",
        "--baseline-modes=eager",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ours, theirs = report["bloomnative"], report["baseline"]["torchtitan_eager"]
    check_run(theirs, steps=2)
    llama = theirs["model"]
    dim, layers, vocab, ffn = (
        llama["dim"],
        llama["n_layers"],
        llama["vocab_size"],
        llama["ffn_hidden"],
    )
    assert (dim, layers, vocab) == (192, 2, 8192)  # the debug preset's width; n_layer=2
    assert ffn % 256 == 0 and ffn >= 8 * dim // 3  # Llama's SwiGLU hidden size rounding
    # Untied embedding and output, per block: q, k, v, o, three MLP matrices and two norms.
    params = 2 * vocab * dim + layers * (4 * dim * dim + 3 * dim * ffn + 2 * dim) + dim
    assert llama["params"] == params
    # torchtitan's count: 6 x (parameters - embedding) + 12 x layers x dim x seq.
    assert theirs["flops_per_token"] == 6 * (params - vocab * dim) + 12 * layers * dim * 128
    expected_tflops = theirs["tokens_per_sec_median"] * theirs["flops_per_token"] / 1e12
    assert math.isclose(theirs["tflops_median"], expected_tflops, rel_tol=1e-9)
    assert abs(theirs["loss_first"] - math.log(vocab)) < 1.0
    ratio = report["ratio_ours_over_torchtitan_eager"]
    assert math.isclose(
        ratio, ours["tokens_per_sec_median"] / theirs["tokens_per_sec_median"], rel_tol=1e-9
    )


def test_bench_train_rejects_bad_flags(capsys):
    bench = load_tool("bench_train")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--steps=0"])
    assert exit_info.value.code == 2
    assert "--warmup and --steps must be at least 1" in capsys.readouterr().err
    assert bench.main(["--training.sq_len=128"]) == 2
    assert "training.seq_len" in capsys.readouterr().err  # the nearest valid key
    assert bench.main(["--sync-debug"]) == 2  # CUDA's sync debug mode; the CPU has a probe test
    assert "--sync-debug needs a CUDA device, not cpu" in capsys.readouterr().err

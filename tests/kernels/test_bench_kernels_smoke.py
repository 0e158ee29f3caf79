"""tools/bench_kernels.py --smoke runs end to end on CPU and writes every benchmark row."""

import json
import os
from pathlib import Path

import pytest

from harness.launching import python_command, run

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench_kernels.py"


@pytest.mark.multiprocess
def test_bench_kernels_smoke_mode_writes_a_row_per_implementation(tmp_path):
    out = tmp_path / "bench.json"
    proc = run(python_command([str(SCRIPT), "--smoke", "--out", str(out)]), env=os.environ)
    payload = json.loads(out.read_text())
    assert payload["environment"]["smoke"] is True
    rows = payload["rows"]
    by_benchmark = {}
    for row in rows:
        by_benchmark.setdefault(row["benchmark"], []).append(row)
    assert set(by_benchmark) == {
        "device copy",
        "attention fwd",
        "attention bwd",
        "attention fwd+bwd",
        "layer_norm fwd+bwd",
        "bias_gelu fwd+bwd",
        "linear_cross_entropy fwd+bwd",
    }
    # Everything that can run on CPU did; only the GPU-only baselines are skipped.
    skipped = {row["impl"] for row in rows if row["ms"] is None}
    assert skipped == {"flex_attention + alibi score_mod", "sdpa flash, causal, no bias"}
    assert all(row["ms"] > 0 for row in rows if row["ms"] is not None)
    # Every attention mode for each head_dim (a power of two and a split one).
    attention_shapes = {
        (r["benchmark"], r["shape"]) for r in rows if r["benchmark"] != "device copy"
    }
    assert {
        ("attention bwd", "b1 s48 h2 d32"),
        ("attention fwd", "b1 s48 h2 d48"),
    } <= attention_shapes
    assert "linear_cross_entropy" in proc.stdout  # the table is printed too


def test_bench_kernels_hands_over_its_rows_after_each_benchmark():
    """What a run killed by its deadline has written: the rows of every benchmark done."""
    import torch

    from harness.training import load_tool

    bench = load_tool("bench_kernels")
    settings = bench.Settings(torch.device("cpu"), torch.float32, warmup=0, iters=1, smoke=True)
    emitted = []
    rows = bench.run(settings, {"norms", "loss"}, [48], [32], emit=lambda r: emitted.append(len(r)))
    # copy, then layer_norm + bias_gelu (3 rows each), then the loss (3 rows)
    assert emitted == [7, len(rows)] and len(rows) == 10

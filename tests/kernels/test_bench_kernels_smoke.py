"""tools/bench_kernels.py --smoke runs end to end on CPU and writes every benchmark row."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench_kernels.py"


def test_bench_kernels_smoke_mode_writes_a_row_per_implementation(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
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

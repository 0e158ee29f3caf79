"""`tools/gpu_acceptance.sh first-contact --tiny` end to end on CPU: the seven steps of a GPU
lease's first command and the FP8 step run when named, each writing its flat JSON the moment it
ends, a step killed by its budget recorded as such with the earlier files intact, and nothing
else under $OUT."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness.kernel_checks import NEEDS_TRITON
from harness.launching import run
from harness.training import REPO

STEPS = ["environment", "correctness", "train_1b7", "attention_bench", "hf_baseline",
         "norms_loss_bench", "train_1b7_mb1_zero2"]  # fmt: skip
JSONS = [f"{i:02d}_{step}.json" for i, step in enumerate(STEPS, start=1)]
FP8_JSON = "08_train_1b7_fp8.json"  # run only when --steps names it
MACHINE_FIELDS = {"device_name", "python", "torch", "triton", "cuda", "step", "status"}


def first_contact(out: Path, *args: str, budgets: str = "") -> tuple[int, dict[str, dict]]:
    """Runs the command with OUT=out; its exit code and {file name: record}."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "TRITON_INTERPRET": "1", "BLOOMNATIVE_FIRST_CONTACT_BUDGETS": budgets}  # fmt: skip
    env.pop("BLOOMNATIVE_FIRST_CONTACT_T0", None)
    command = [str(REPO / "tools" / "gpu_acceptance.sh"), "first-contact", "--tiny", *args]
    proc = run(command, cwd=REPO, env=env, timeout=400, check=False)
    records = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
    return proc.returncode, records


def assert_flat_with_machine(record: dict) -> None:
    assert MACHINE_FIELDS <= set(record), sorted(record)
    assert not any(isinstance(v, dict) for v in record.values()), record


@NEEDS_TRITON
@pytest.mark.multiprocess
def test_first_contact_tiny_writes_every_step_and_records_the_one_killed_by_its_budget(tmp_path):
    out = tmp_path / "out"
    # hf_baseline gets 2 s: the process is killed while it imports, the step after it still runs
    every_step = ",".join([*STEPS, "train_1b7_fp8"])
    rc, records = first_contact(out, f"--steps={every_step}", budgets="hf_baseline=2")
    assert sorted(os.listdir(out)) == sorted([*JSONS, FP8_JSON, "first_contact.log"])
    for record in records.values():
        assert_flat_with_machine(record)
    status = {name: records[name]["status"] for name in [*JSONS, FP8_JSON]}
    killed = "05_hf_baseline.json"
    assert status == {**dict.fromkeys([*JSONS, FP8_JSON], "ok"), killed: "timeout"}, status
    assert records[killed]["reason"] == "killed by its 2 s budget" and rc == 1
    correctness = records["02_correctness.json"]
    assert correctness["result.ok"] is True
    assert correctness["result.float64.2.name"].startswith("attention d128 dropout 0.1")
    train = records["03_train_1b7.json"]
    assert train["result.bloomnative.dynamo.frames_compiled_after_first_step"] == 0
    assert (
        train["summary.losses_finite"] is True
        and train["result.bloomnative.tokens_per_sec_median"] > 0
    )
    zero2 = records["07_train_1b7_mb1_zero2.json"]
    assert "--parallelism.zero_stage=2" in zero2["result.command"]
    assert zero2["result.config.micro_batch_size"] == 1
    fp8 = records[FP8_JSON]  # FP8 (emulated here) beside the same run without it
    assert fp8["result.config.quantize_linear"] == "float8_rowwise"
    assert "--quantize.emulate=true" in fp8["result.command"]
    ours = fp8["result.bloomnative.tokens_per_sec_median"]
    plain = fp8["result.bloomnative_no_fp8.tokens_per_sec_median"]
    assert fp8["result.ratio_fp8_over_no_fp8"] == pytest.approx(ours / plain, rel=1e-9)
    # the same weights and batch: the first losses differ by FP8's rounding (2e-3 of the loss in
    # tests/train/test_float8_training.py)
    first = fp8["result.bloomnative.loss_first"]
    assert first == pytest.approx(fp8["result.bloomnative_no_fp8.loss_first"], rel=2e-3)
    rows = records["04_attention_bench.json"]
    assert any(
        str(v).startswith("sdpa flash, causal") for k, v in rows.items() if k.endswith(".impl")
    )
    log = (out / "first_contact.log").read_text()
    assert all(f"=== {step}: exit" in log for step in [*STEPS, "train_1b7_fp8"])
    # each comparison is printed as it ends (what a step killed by its budget still tells)
    for i in range(5):
        assert f"correctness: {correctness[f'result.float64.{i}.name']}: ok, errors" in log


@pytest.mark.multiprocess
def test_first_contact_skips_every_step_it_has_no_time_for(tmp_path):
    rc, records = first_contact(tmp_path, "--deadline-s=1")  # the FP8 step is not one of them
    assert sorted(records) == JSONS and sorted(os.listdir(tmp_path)) == JSONS
    for record in records.values():
        assert_flat_with_machine(record)
        assert record["status"] == "skipped" and "s left, the step needs" in record["reason"]
    assert rc == 1


@pytest.mark.multiprocess
def test_first_contact_runs_only_the_steps_named_and_they_keep_their_numbers(tmp_path):
    rc, records = first_contact(tmp_path, "--deadline-s=1", "--steps=correctness,hf_baseline")
    assert sorted(records) == ["02_correctness.json", "05_hf_baseline.json"], sorted(records)
    assert rc == 1  # both skipped: no time
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "refused")}
    command = [str(REPO / "tools" / "gpu_acceptance.sh"), "first-contact", "--steps=train"]
    proc = run(command, cwd=REPO, env=env, timeout=60, check=False)
    assert proc.returncode == 2 and "unknown step(s) ['train']" in proc.stderr, proc.stderr
